package config_test

import (
	"testing"

	"go.uber.org/goleak"
)

// TestMain fails the package when a goroutine outlives its test: every Router a test builds is
// closed, so a load poller, KV-event subscriber, affinity sweeper or health check that Close does
// not stop shows here. The ZMQ publishers the tests start as engines leave a writer behind.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4.(*pubMWriter).run"))
}
