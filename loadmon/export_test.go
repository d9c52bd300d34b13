package loadmon

import (
	"time"

	"github.com/enginepick/enginepick/state"
)

// HasNative exposes hasNative to tests.
func (o *Observation) HasNative() bool { return o.hasNative() }

// TokensTime exposes tokensTime to tests.
func (l *EngineLoad) TokensTime(tokens uint64) time.Duration { return l.tokensTime(tokens) }

// CountRank exposes rankCount to tests.
func (f *InFlight) CountRank(engine state.EngineID, rank int) uint64 {
	return f.rankCount(engine, rank)
}

// Rank exposes rank to tests.
func (l *EngineLoad) Rank(rank int) (*EngineLoad, bool) { return l.rank(rank) }
