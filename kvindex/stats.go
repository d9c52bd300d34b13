package kvindex

import (
	"cmp"
	"slices"

	"github.com/enginepick/enginepick/state"
)

// Stats is a point-in-time summary of an Index, for metrics (docs/design.md §15).
type Stats struct {
	// Blocks is the number of blocks (tree nodes) in the index, including blocks no engine holds
	// any more that are kept because a descendant is held. Approximate entries are not tree
	// nodes: a block only a placement (LocalSource.Place) recorded is not counted.
	Blocks int
	// ApproximateBlocks is the number of approximate (block, engine) entries, expired or not.
	ApproximateBlocks int
	// EvictedBlocks counts blocks evicted under Options.MaxBlocks since the index was built.
	EvictedBlocks uint64
	// Engines has one entry per engine in the index, including engines that hold nothing after a
	// Clear. nil when there is none.
	Engines map[state.EngineID]EngineStats
}

// EngineStats counts one engine's blocks over all its DP ranks. A block held by two ranks counts
// twice; a block held in two tiers counts once in each tier's field; a block held under two hashes
// (aliases) counts once per hash.
type EngineStats struct {
	// Ranks is the number of DP ranks the index knows for the engine.
	Ranks int
	// DeviceBlocks, HostBlocks, DiskBlocks and ExternalBlocks count real (event-reported)
	// blocks per tier.
	DeviceBlocks, HostBlocks, DiskBlocks, ExternalBlocks int
	// ApproximateBlocks counts approximate entries not yet dropped (they may have expired).
	ApproximateBlocks int
}

// Stats returns the index's counts. It takes the read lock and allocates the Engines map; it is
// meant for a metrics scrape, not the pick path. Cost: O(engines × ranks). While a Clear or
// RemoveEngine runs (in chunks, Index.Clear), the ranks it clears count no blocks, as Match sees
// them, an engine being removed is still listed, and Blocks still counts the blocks not yet freed.
func (x *Index) Stats() Stats {
	x.mu.RLock()
	defer x.mu.RUnlock()
	s := Stats{Blocks: x.live, ApproximateBlocks: x.approxCount, EvictedBlocks: x.evicted}
	for id, e := range x.engineByID {
		if s.Engines == nil {
			s.Engines = make(map[state.EngineID]EngineStats, len(x.engineByID))
		}
		var es EngineStats
		for _, rh := range x.engines[e].ranks {
			h := &x.holders[rh.holder]
			es.Ranks++
			if h.hidden {
				continue // being cleared: it holds nothing as Match sees it
			}
			es.DeviceBlocks += h.tiers[0]
			es.HostBlocks += h.tiers[1]
			es.DiskBlocks += h.tiers[2]
			es.ExternalBlocks += h.tiers[3]
			es.ApproximateBlocks += h.approx
		}
		s.Engines[id] = es
	}
	return s
}

// RankStats counts one DP rank's blocks as EngineStats counts an engine's, with the rank's trust
// mark.
type RankStats struct {
	Engine state.EngineID
	DPRank int
	// DeviceBlocks, HostBlocks, DiskBlocks and ExternalBlocks count real blocks per tier;
	// ApproximateBlocks counts approximate entries not yet dropped.
	DeviceBlocks, HostBlocks, DiskBlocks, ExternalBlocks, ApproximateBlocks int
	// Untrusted: the rank is marked untrusted (Index.MarkUntrusted).
	Untrusted bool
}

// RankStats returns one entry per (engine, DP rank) the index knows, sorted by engine then rank;
// nil when there is none. Like Stats it takes the read lock and allocates, for diagnostics and
// metrics rather than the pick path; a rank being cleared counts no blocks. Cost:
// O(engines × ranks).
func (x *Index) RankStats() []RankStats {
	x.mu.RLock()
	var out []RankStats
	for id, e := range x.engineByID {
		for _, rh := range x.engines[e].ranks {
			h := &x.holders[rh.holder]
			rs := RankStats{Engine: id, DPRank: rh.rank}
			if !h.hidden {
				rs.DeviceBlocks, rs.HostBlocks, rs.DiskBlocks, rs.ExternalBlocks = h.tiers[0], h.tiers[1], h.tiers[2], h.tiers[3]
				rs.ApproximateBlocks = h.approx
			}
			out = append(out, rs)
		}
	}
	x.mu.RUnlock()
	slices.SortFunc(out, func(a, b RankStats) int {
		return cmp.Or(cmp.Compare(a.Engine, b.Engine), cmp.Compare(a.DPRank, b.DPRank))
	})
	x.trust.mu.Lock()
	for i := range out {
		_, out[i].Untrusted = x.trust.ranks[out[i].Engine][out[i].DPRank]
	}
	x.trust.mu.Unlock()
	return out
}
