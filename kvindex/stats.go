package kvindex

import (
	"cmp"
	"slices"

	"github.com/enginepick/enginepick/state"
)

// Stats is a point-in-time summary of an Index, for metrics and diagnostics (docs/design.md §15).
type Stats struct {
	// Blocks is the number of blocks (tree nodes) in the index, including blocks no engine holds
	// any more that are kept because a descendant is held. Approximate entries are not tree
	// nodes: a block only a placement (LocalSource.Place) recorded is not counted.
	Blocks int
	// ApproximateBlocks is the number of approximate (block, engine) entries, expired or not.
	ApproximateBlocks int
	// EvictedBlocks counts blocks evicted under Options.MaxBlocks since the index was built.
	EvictedBlocks uint64
	// Ranks has one entry per (engine, DP rank) the index knows, including ranks that hold
	// nothing after a Clear, sorted by engine then rank; nil when there is none. An engine's
	// blocks are the sum over its ranks.
	Ranks []RankStats
	// Untrusted lists the engines with at least one DP rank marked untrusted, sorted; nil when
	// there is none. Their ranks may hold nothing in the index, or be unknown to it. LocalSource
	// reports such an engine as holding nothing until every rank is trusted again (docs/design.md
	// §13.1).
	Untrusted []state.EngineID
}

// RankStats counts the blocks one DP rank of an engine holds. A block held in two tiers counts
// once in each tier's field; a block held under two hashes (aliases) counts once per hash.
type RankStats struct {
	Engine state.EngineID
	DPRank int
	// DeviceBlocks, HostBlocks, DiskBlocks and ExternalBlocks count real (event-reported)
	// blocks per tier.
	DeviceBlocks, HostBlocks, DiskBlocks, ExternalBlocks int
	// ApproximateBlocks counts approximate entries not yet dropped (they may have expired).
	ApproximateBlocks int
	// Untrusted: the rank is marked untrusted (its KV-event stream lost its place or fell
	// silent; docs/design.md §13.1).
	Untrusted bool
}

// Stats returns the index's counts. It takes the read lock and allocates; it is meant for a
// metrics scrape, not the pick path. Cost: O(ranks × log ranks). While a Clear or RemoveEngine
// runs (in chunks, Index.Clear), the ranks it clears count no blocks, as Match sees them, an
// engine being removed is still listed, and Blocks still counts the blocks not yet freed.
func (x *Index) Stats() Stats {
	x.mu.RLock()
	s := Stats{Blocks: x.live, ApproximateBlocks: x.approxCount, EvictedBlocks: x.evicted}
	for id, e := range x.engineByID {
		for _, rh := range x.engines[e].ranks {
			h := &x.holders[rh.holder]
			rs := RankStats{Engine: id, DPRank: rh.rank}
			if !h.hidden { // a rank being cleared holds nothing as Match sees it
				rs.DeviceBlocks, rs.HostBlocks, rs.DiskBlocks, rs.ExternalBlocks = h.tiers[0], h.tiers[1], h.tiers[2], h.tiers[3]
				rs.ApproximateBlocks = h.approx
			}
			s.Ranks = append(s.Ranks, rs)
		}
	}
	x.mu.RUnlock()
	slices.SortFunc(s.Ranks, func(a, b RankStats) int {
		return cmp.Or(cmp.Compare(a.Engine, b.Engine), cmp.Compare(a.DPRank, b.DPRank))
	})
	x.trust.mu.Lock()
	for i := range s.Ranks {
		_, s.Ranks[i].Untrusted = x.trust.ranks[s.Ranks[i].Engine][s.Ranks[i].DPRank]
	}
	x.trust.mu.Unlock()
	s.Untrusted = x.untrusted()
	return s
}
