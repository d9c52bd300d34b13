package kvevents

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"

	"github.com/enginepick/enginepick/internal/kvbridge"
	"github.com/enginepick/enginepick/internal/kvwire"
	"github.com/enginepick/enginepick/kvindex"
	"github.com/enginepick/enginepick/state"
)

// allTiers is every kvindex tier.
const allTiers = kvindex.TierDevice | kvindex.TierHost | kvindex.TierDisk | kvindex.TierExternal

// defaultMedia is Options.Media when nil (its comment states the mapping).
var defaultMedia = map[string]kvindex.Tier{
	"GPU":        kvindex.TierDevice,
	"CPU":        kvindex.TierHost,
	"CPU_PINNED": kvindex.TierHost,
	"DISK":       kvindex.TierDisk,
	"EXTERNAL":   kvindex.TierExternal,
}

// counters are one stream's event counts; see StreamStats.
type counters struct {
	events, stored, removed, cleared, ignored, rejected, unknownRemovals uint64
	refused                                                              [numRefusals]uint64
}

// applier turns decoded events into index operations for one stream. It is owned by the stream's
// apply goroutine.
type applier struct {
	engine state.EngineID
	rank   int
	x      *kvindex.Index
	names  map[int64]string        // Options.AdapterNames
	media  map[string]kvindex.Tier // upper-case keys
	bt     int

	// copies counts the copies of a block the rank holds beyond the first, per engine hash and
	// tier: vLLM keeps a second copy of a block computed while an identical one is cached, stores
	// it again and removes each copy on its own (docs/design.md §13.1). Nil until a store repeats
	// a held block; an entry goes with its last extra copy, and every entry with a clear of the
	// rank, so there are never more entries than copies the engine holds.
	copies   map[copyKey]uint32
	restored []kvbridge.Restored // Store scratch

	remaining, known []uint64 // Remove scratch
}

// copyKey names a block's copies in one tier: its engine hash and one Tier bit.
type copyKey struct {
	hash uint64
	tier kvindex.Tier
}

func newApplier(engine state.EngineID, rank int, o *Options) *applier {
	return &applier{engine: engine, rank: rank, x: o.Index, names: o.AdapterNames, media: o.media,
		bt: o.Index.Hasher().BlockTokens()}
}

// normalizeMedia upper-cases the keys of m (nil: defaultMedia) and validates the tiers.
func normalizeMedia(m map[string]kvindex.Tier) (map[string]kvindex.Tier, error) {
	if m == nil {
		m = defaultMedia
	}
	out := make(map[string]kvindex.Tier, len(m))
	for k, t := range m {
		if t == 0 || t&^allTiers != 0 {
			return nil, fmt.Errorf("kvevents: Options.Media[%q]: tier %v, want one or more of the four kvindex tiers: %w", k, t, state.ErrInvalidConfiguration)
		}
		out[strings.ToUpper(k)] = t
	}
	return out, nil
}

// checkAdapterNames validates Options.AdapterNames: every name non-empty.
func checkAdapterNames(names map[int64]string) error {
	for _, id := range slices.Sorted(maps.Keys(names)) {
		if names[id] == "" {
			return fmt.Errorf("kvevents: Options.AdapterNames[%d]: empty name: %w", id, state.ErrInvalidConfiguration)
		}
	}
	return nil
}

// apply applies every event of b in order. Each event is applied whole or not at all (the index
// validates before it changes anything); a refused event is counted and reported and the others
// go on.
func (a *applier) apply(b *kvwire.Batch, seq uint64, c *counters, report func(*StreamError)) {
	for i := range b.Events {
		ev := &b.Events[i]
		c.events++
		if err := a.event(ev, c); err != nil {
			c.rejected++
			c.refused[refusalOf(err)]++
			report(&StreamError{Engine: a.engine, DPRank: a.rank, Seq: seq, Err: err})
		}
	}
}

func (a *applier) event(ev *kvwire.Event, c *counters) error {
	switch ev.Kind {
	case kvwire.KindStored:
		return a.store(ev, c)
	case kvwire.KindRemoved:
		return a.remove(ev, c)
	case kvwire.KindCleared:
		a.clear()
		c.cleared++
		return nil
	}
	c.ignored++ // an event type this package does not know
	return nil
}

func (a *applier) store(ev *kvwire.Event, c *counters) error {
	if !ev.MainGroup() || len(ev.BlockHashes) == 0 || (len(ev.TokenIDs) == 0 && ev.BlockSize == 0) {
		// Another KV-cache group, an empty event, or a CPU-offload placeholder (no tokens, block
		// size 0): nothing the index can key.
		c.ignored++
		return nil
	}
	if ev.BlockSize != 0 && ev.BlockSize != a.bt {
		return &BlockSizeMismatchError{EventBlockSize: ev.BlockSize, IndexBlockSize: a.bt}
	}
	tier := kvindex.TierDevice
	if ev.Medium != "" {
		t, ok := a.tier(ev.Medium)
		if !ok {
			return fmt.Errorf("%w %q", ErrUnknownMedium, ev.Medium)
		}
		tier = t
	}
	adapter, err := a.adapter(ev)
	if err != nil {
		return err
	}
	se := kvindex.StoreEvent{Engine: a.engine, DPRank: a.rank, ParentHash: ev.ParentHash,
		HasParent: ev.HasParent, BlockHashes: ev.BlockHashes, TokenIDs: ev.TokenIDs, Tier: tier, Adapter: adapter}
	a.restored, err = kvbridge.StoreRestored(a.x, se, a.restored[:0])
	if err != nil && se.HasParent && se.ParentHash == 0 && errors.Is(err, kvindex.ErrUnknownParent) {
		// Parent 0 that the rank does not hold is a root: llm-d's publishers send 0 where vLLM
		// sends nil (docs/design.md §13.1).
		se.HasParent = false
		a.restored, err = kvbridge.StoreRestored(a.x, se, a.restored[:0])
	}
	if err != nil {
		return err
	}
	c.stored += uint64(len(ev.BlockHashes))
	for _, r := range a.restored {
		// A block the rank already held in a tier it is stored in again: one more copy there.
		for t := kvindex.Tier(r.Tiers) & tier; t != 0; t &= t - 1 {
			if a.copies == nil {
				a.copies = map[copyKey]uint32{}
			}
			a.copies[copyKey{ev.BlockHashes[r.Block], t & -t}]++
		}
	}
	return nil
}

// dropCopy drops one extra copy of the block with engine hash h in each tier of tiers (0: every
// tier) that holds one, and reports whether it dropped any: the rank then still holds the block.
func (a *applier) dropCopy(h uint64, tiers kvindex.Tier) bool {
	if tiers == 0 {
		tiers = allTiers
	}
	dropped := false
	for t := tiers; t != 0; t &= t - 1 {
		k := copyKey{h, t & -t}
		switch n := a.copies[k]; n {
		case 0:
			continue
		case 1:
			delete(a.copies, k)
		default:
			a.copies[k] = n - 1
		}
		dropped = true
	}
	return dropped
}

func (a *applier) tier(medium string) (kvindex.Tier, bool) {
	if t, ok := a.media[medium]; ok {
		return t, true
	}
	t, ok := a.media[strings.ToUpper(medium)]
	return t, ok
}

// adapter returns the LoRA adapter ev's blocks belong to (kvindex.StoreEvent.Adapter): its
// lora_name, else the name Options.AdapterNames gives its lora_id, else the base model ("").
// A lora_id without a name or a mapping is ErrUnknownAdapter.
func (a *applier) adapter(ev *kvwire.Event) (string, error) {
	switch {
	case ev.LoRAName != "":
		return ev.LoRAName, nil
	case ev.HasLoRAID:
		if name, ok := a.names[ev.LoRAID]; ok {
			return name, nil
		}
		return "", fmt.Errorf("%w: lora_id %d", ErrUnknownAdapter, ev.LoRAID)
	}
	return "", nil
}

// remove removes ev's hashes from the index, every adapter's blocks alike (BlockRemoved names no
// adapter; the engine's hashes are its own IDs). A hash with an extra copy in a removed tier loses
// that copy instead, and the rank keeps the block. Hashes the index does not hold (blocks it
// evicted under its cap, or stored under a group or adapter this subscriber drops) are counted,
// not reported.
func (a *applier) remove(ev *kvwire.Event, c *counters) error {
	if !ev.MainGroup() || len(ev.BlockHashes) == 0 {
		c.ignored++
		return nil
	}
	var tier kvindex.Tier // 0: every tier, for no medium or an unknown one (SGLang's rule)
	if ev.Medium != "" {
		tier, _ = a.tier(ev.Medium)
	}
	a.remaining = append(a.remaining[:0], ev.BlockHashes...)
	if len(a.copies) > 0 {
		kept := a.remaining[:0]
		for _, h := range a.remaining {
			if a.dropCopy(h, tier) {
				c.removed++
			} else {
				kept = append(kept, h)
			}
		}
		a.remaining = kept
	}
	if len(a.remaining) == 0 {
		return nil
	}
	err := a.x.Remove(a.engine, a.rank, a.remaining, tier)
	var ee *kvindex.EventError
	switch {
	case err == nil:
		c.removed += uint64(len(a.remaining))
		return nil
	case errors.Is(err, kvindex.ErrUnknownEngine):
	case errors.Is(err, kvindex.ErrUnknownHash) && errors.As(err, &ee):
		a.known = a.known[:0]
		for _, h := range a.remaining {
			if !slices.Contains(ee.Hashes, h) {
				a.known = append(a.known, h)
			}
		}
		if len(a.known) > 0 {
			if err := a.x.Remove(a.engine, a.rank, a.known, tier); err != nil {
				return err
			}
			c.removed += uint64(len(a.known))
		}
		c.unknownRemovals += uint64(len(ee.Hashes))
		return nil
	default:
		return err
	}
	c.unknownRemovals += uint64(len(a.remaining))
	return nil
}

// clear drops every block of the stream's (engine, rank), and the count of their copies.
func (a *applier) clear() {
	a.copies = nil
	_ = a.x.Clear(a.engine, a.rank) // ErrUnknownEngine: it holds nothing there
}

// markUntrusted and markTrusted set the stream's trust mark in the index (kvbridge.MarkUntrusted).
func (a *applier) markUntrusted() {
	_ = kvbridge.MarkUntrusted(a.x, a.engine, a.rank)
}

func (a *applier) markTrusted() {
	_ = kvbridge.MarkTrusted(a.x, a.engine, a.rank)
}
