package kvindex

import (
	"testing"

	"go.uber.org/goleak"
)

// TestMain fails the package's tests if a goroutine is still running when they end: RemoteSource
// runs each remote lookup in a goroutine that must return once its indexer does, however the
// lookup ended.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }
