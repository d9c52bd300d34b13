package loadmon_test

import (
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/enginepick/enginepick/internal/loadbridge"
	"github.com/enginepick/enginepick/loadmon"
)

// TestReplicas: loadbridge.Replicas returns what SetReplicas recorded on the InFlight, and a
// router alone, (0, 1), before any call and for a count below 2 or a rank outside [0, count).
func TestReplicas(t *testing.T) {
	tests := []struct {
		name        string
		rank, n     int
		wantRank    int
		wantReplica int
	}{
		{"second of four", 1, 4, 1, 4},
		{"first of two", 0, 2, 0, 2},
		{"last of sixty-four", 63, 64, 63, 64},
		{"alone", 0, 1, 0, 1},
		{"no replicas", 0, 0, 0, 1},
		{"rank past the count", 4, 4, 0, 1},
		{"negative rank", -1, 4, 0, 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := loadmon.NewInFlight(nil)
			rank, n := loadbridge.Replicas(f)
			assert.Equal(t, [2]int{0, 1}, [2]int{rank, n}, "before SetReplicas")
			loadbridge.SetReplicas(f, 2, 3) // replaced by the next call, whatever it records
			loadbridge.SetReplicas(f, tt.rank, tt.n)
			rank, n = loadbridge.Replicas(f)
			assert.Equal(t, [2]int{tt.wantRank, tt.wantReplica}, [2]int{rank, n})
		})
	}
}
