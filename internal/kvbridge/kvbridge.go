// Package kvbridge gives the module's own packages the kvindex.Index operations that are not
// part of kvindex's API: the trust marks package kvindex/kvevents sets on a rank whose event
// stream lost its place or fell silent, the store that reports which blocks the holder already
// held (vLLM's second copies, docs/design.md §13.1), and the writer-yield setting the
// configuration's tests read.
//
// Package kvindex sets the functions when it is initialised, so they are never nil once kvindex is
// imported. This package cannot name kvindex's types (kvindex imports it): x is always a
// *kvindex.Index and ev a kvindex.StoreEvent; anything else panics.
package kvbridge

import "github.com/enginepick/enginepick/state"

// Restored is a block of a stored event that its holder already held under the same hash.
type Restored struct {
	// Block is the block's position in the event's BlockHashes.
	Block int
	// Tiers are the kvindex.Tier bits the holder held the block in before the event.
	Tiers uint8
}

var (
	// StoreRestored is x.Store(ev) that also appends to restored, in prompt order, each block of
	// ev that ev's holder already held under the same hash, and returns the extended slice. A
	// block new to the holder, or held only under another hash (an alias), is not appended. On an
	// error it returns restored unchanged with Store's error. Cost: Store's, plus a lookup per
	// restored block.
	StoreRestored func(x, ev any, restored []Restored) ([]Restored, error)

	// MarkUntrusted records that engine's DP rank rank is out of step with the engine: its event
	// stream lost events, so the index may hold blocks the engine has dropped. Until every
	// untrusted rank of the engine is marked trusted again, a kvindex.LocalSource reports the
	// engine as holding nothing, and kvindex.Stats lists it in Untrusted; Match still reports its
	// entries, which are untouched. Marking an already untrusted rank again is a no-op; marks are
	// independent of the entries, so they survive Clear and RemoveEngine (docs/design.md §13.1).
	// Errors (a *kvindex.EventError with Op "mark untrusted"; nothing changes):
	// kvindex.ErrInvalidEngine for an empty engine, kvindex.ErrInvalidRank for a negative rank.
	// Safe for concurrent use.
	MarkUntrusted func(x any, engine state.EngineID, rank int) error

	// MarkTrusted clears the mark MarkUntrusted set on engine's DP rank rank: the rank has been
	// resynchronised. The engine is trusted again once none of its ranks is marked. Marking a
	// rank that is not marked is a no-op. Errors as MarkUntrusted (Op "mark trusted").
	MarkTrusted func(x any, engine state.EngineID, rank int) error

	// WriterYieldBlocks returns how many blocks x's Stores add between two yields of the writer's
	// processor (kvindex.Options.WriterYieldBlocks after its default); 0 means never.
	WriterYieldBlocks func(x any) int

	// SetPlaceHook makes x call fn, synchronously, after each route-time placement a
	// kvindex.LocalSource over x records (kvindex.Placer): engine's DP rank, the prompt's chained
	// block keys (read-only, valid during the call) and held, the leading blocks the rank held
	// through real events. nil removes the hook. fn must be safe for concurrent use and must not
	// block.
	SetPlaceHook func(x any, fn func(engine state.EngineID, rank int, keys []uint64, held int))

	// PlacePeer records another router replica's placement (SetPlaceHook's arguments) in x as
	// approximate entries, as kvindex.LocalSource.Place would (docs/design.md §9.10). keys come
	// from outside the process: a chain that repeats a key or conflicts with the index is
	// refused. Errors as LocalSource.Place's, and kvindex.ErrCyclicChain.
	PlacePeer func(x any, engine state.EngineID, rank int, keys []uint64, held int) error
)
