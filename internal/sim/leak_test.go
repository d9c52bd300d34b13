package sim

import (
	"testing"

	"go.uber.org/goleak"
)

// TestMain fails the package's tests if a goroutine is still running when they end: Replay and
// Sweep run one goroutine per policy or load point, and each must return, canceled or not.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }
