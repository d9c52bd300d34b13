package kvindex

import (
	"slices"
	"time"

	"github.com/enginepick/enginepick/state"
)

// Test-only exports: the allocation-free forms behind Match and LocalSource.Lookup, for the
// external tests (scale_test.go), which measure and check them, and approximate entries on given
// keys with a given TTL.

// Matches is the working memory matchInto and matchTokensInto fill.
type Matches = matches

// MatchInto is matchInto.
func (x *Index) MatchInto(keys []uint64, m *Matches) { x.matchInto(keys, m) }

// MatchTokensInto is matchTokensInto.
func (x *Index) MatchTokensInto(tokens []uint32, m *Matches) { x.matchTokensInto(tokens, m) }

// Assume records approximate entries for engine's DP rank 0 on keys (a prompt's chained keys),
// living ttl (0: Options.ApproxTTL): LocalSource.Place's operation, on keys, for the tests.
func (x *Index) Assume(engine state.EngineID, keys []uint64, ttl time.Duration) error {
	return x.assume(engine, 0, keys, 0, ttl, false)
}

// AssumeRank is Assume on engine's DP rank rank.
func (x *Index) AssumeRank(engine state.EngineID, rank int, keys []uint64, ttl time.Duration) error {
	return x.assume(engine, rank, keys, 0, ttl, false)
}

// Expire is expire.
func (x *Index) Expire(now time.Time) int { return x.expire(now) }

// EngineStats is one engine's RankStats summed over its ranks, with Ranks its rank count.
type EngineStats struct {
	Ranks                                                                   int
	DeviceBlocks, HostBlocks, DiskBlocks, ExternalBlocks, ApproximateBlocks int
}

// Engines folds s.Ranks by engine; nil when s has no rank.
func (s Stats) Engines() map[state.EngineID]EngineStats {
	if s.Ranks == nil {
		return nil
	}
	out := map[state.EngineID]EngineStats{}
	for _, r := range s.Ranks {
		es := out[r.Engine]
		es.Ranks++
		es.DeviceBlocks += r.DeviceBlocks
		es.HostBlocks += r.HostBlocks
		es.DiskBlocks += r.DiskBlocks
		es.ExternalBlocks += r.ExternalBlocks
		es.ApproximateBlocks += r.ApproximateBlocks
		out[r.Engine] = es
	}
	return out
}

// Trusted reports whether no DP rank of engine is marked untrusted (Stats.Untrusted).
func (x *Index) Trusted(engine state.EngineID) bool { return !slices.Contains(x.untrusted(), engine) }
