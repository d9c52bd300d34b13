package policy_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/affinity"
	"github.com/enginepick/enginepick/internal/affinitysuite"
)

// The acceptance scenarios of SessionAware and store-mode Sticky on the memory store
// (affinity/redisstore runs the same scenarios on Redis and Redis Cluster).
func TestAffinityScenariosMemoryStore(t *testing.T) {
	t.Parallel()
	affinitysuite.Run(t, func(t *testing.T, now func() time.Time, idle time.Duration) affinity.Store {
		st, err := affinity.NewMemoryStore(affinity.Options{Now: now, IdleTimeout: idle})
		require.NoError(t, err)
		return st
	})
}
