package enginepick_test

import (
	"testing"

	"go.uber.org/goleak"
)

// TestMain fails the package's tests if a goroutine is still running when they end: the tests run
// concurrent pickers, KV-event subscribers and publishers, and every one must have returned. The
// one exception is zmq4's PUB writer, which the test publishers' Close does not stop
// (go-zeromq/zmq4 `pub.go`, v0.17; package kvevents ignores it too).
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4.(*pubMWriter).run"))
}
