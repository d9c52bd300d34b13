package enginepick_test

import (
	"testing"

	"go.uber.org/goleak"
)

// TestMain fails the package's tests if a goroutine is still running when they end: the tests run
// concurrent pickers and event streams, and every one must have returned.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }
