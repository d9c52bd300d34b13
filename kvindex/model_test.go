package kvindex

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/state"
)

// The reference model: plain maps of sets, written for obviousness, not speed. The Index must
// agree with it after every operation.

type hkey struct {
	engine state.EngineID
	rank   int
}

type mentry struct {
	key   uint64
	tiers Tier
}

type mholder struct {
	hashes map[uint64]mentry // engine hash → block key and tiers
	approx map[uint64]int64  // block key → expiry (Unix ns)
}

type mparent struct {
	key  uint64
	root bool
}

type model struct {
	hasher  Hasher
	parent  map[uint64]mparent
	holders map[hkey]*mholder
	now     int64
	// defaultTTL is Options.ApproxTTL of the index under test.
	defaultTTL time.Duration
}

func newModel(h Hasher) *model {
	return &model{hasher: h, parent: map[uint64]mparent{}, holders: map[hkey]*mholder{}}
}

func (m *model) holder(k hkey) *mholder {
	h := m.holders[k]
	if h == nil {
		h = &mholder{hashes: map[uint64]mentry{}, approx: map[uint64]int64{}}
		m.holders[k] = h
	}
	return h
}

func hasDup(vs []uint64) bool {
	seen := map[uint64]bool{}
	for _, v := range vs {
		if seen[v] {
			return true
		}
		seen[v] = true
	}
	return false
}

func (m *model) store(ev StoreEvent) error {
	switch {
	case ev.DPRank < 0:
		return ErrInvalidRank
	case ev.Tier == 0 || ev.Tier&^allTiers != 0:
		return ErrInvalidTier
	case len(ev.TokenIDs) != len(ev.BlockHashes)*m.hasher.BlockTokens():
		return ErrBlockSizeMismatch
	case len(ev.BlockHashes) == 0:
		return nil
	case hasDup(ev.BlockHashes):
		return ErrDuplicateHash
	case ev.HasParent && slices.Contains(ev.BlockHashes, ev.ParentHash):
		return ErrCyclicChain
	}
	h := m.holders[hkey{ev.Engine, ev.DPRank}]
	parentKey, root := m.hasher.root, true
	if ev.HasParent {
		if h == nil {
			return ErrUnknownParent
		}
		e, ok := h.hashes[ev.ParentHash]
		if !ok {
			return ErrUnknownParent
		}
		parentKey, root = e.key, false
	}
	keys := m.hasher.appendFrom(nil, parentKey, ev.TokenIDs)
	if h != nil {
		for i, hash := range ev.BlockHashes {
			if e, ok := h.hashes[hash]; ok && e.key != keys[i] {
				return ErrDuplicateHash
			}
		}
	}
	h = m.holder(hkey{ev.Engine, ev.DPRank})
	prev := mparent{key: parentKey, root: root}
	for i, hash := range ev.BlockHashes {
		k := keys[i]
		m.parent[k] = prev
		prev = mparent{key: k}
		if e, ok := h.hashes[hash]; ok {
			e.tiers |= ev.Tier
			h.hashes[hash] = e
			continue
		}
		delete(h.approx, k)
		h.hashes[hash] = mentry{key: k, tiers: ev.Tier}
	}
	return nil
}

func (m *model) remove(engine state.EngineID, rank int, hashes []uint64, tiers Tier) error {
	switch {
	case rank < 0:
		return ErrInvalidRank
	case tiers&^allTiers != 0:
		return ErrInvalidTier
	}
	if tiers == 0 {
		tiers = allTiers
	}
	h := m.holders[hkey{engine, rank}]
	if h == nil {
		return ErrUnknownEngine
	}
	for _, hash := range hashes {
		if _, ok := h.hashes[hash]; !ok {
			return ErrUnknownHash
		}
	}
	for _, hash := range hashes {
		e, ok := h.hashes[hash]
		if !ok {
			continue
		}
		e.tiers &^= tiers
		if e.tiers == 0 {
			delete(h.hashes, hash)
		} else {
			h.hashes[hash] = e
		}
	}
	return nil
}

func (m *model) clear(engine state.EngineID, rank int) error {
	if rank < 0 {
		return ErrInvalidRank
	}
	h := m.holders[hkey{engine, rank}]
	if h == nil {
		return ErrUnknownEngine
	}
	clear(h.hashes)
	clear(h.approx)
	return nil
}

func (m *model) removeEngine(engine state.EngineID) error {
	found := false
	for k := range m.holders {
		if k.engine == engine {
			delete(m.holders, k)
			found = true
		}
	}
	if !found {
		return ErrUnknownEngine
	}
	return nil
}

func (m *model) expire(now int64) int {
	n := 0
	for _, h := range m.holders {
		for k, exp := range h.approx {
			if exp <= now {
				delete(h.approx, k)
				n++
			}
		}
	}
	return n
}

func (m *model) holdsReal(h *mholder, key uint64) bool {
	for _, e := range h.hashes {
		if e.key == key {
			return true
		}
	}
	return false
}

// place is LocalSource.Place's assume: held is the depth the engine's rank 0 matched; when its
// block keys[held-1] is real, only keys[held:] are assumed (the blocks before are not refreshed).
func (m *model) place(engine state.EngineID, keys []uint64, held int, ttl time.Duration) error {
	if ttl == 0 {
		ttl = m.defaultTTL
	}
	start := 0
	if h := m.holders[hkey{engine, 0}]; held > 0 && held <= len(keys) && h != nil && m.holdsReal(h, keys[held-1]) {
		start = held
	}
	if start == len(keys) {
		return nil
	}
	m.record(engine, keys, start, ttl)
	return nil
}

// record links keys into one chain from the root and gives the engine an approximate entry,
// expiring after ttl, for each of keys[start:] it does not hold through a real entry.
func (m *model) record(engine state.EngineID, keys []uint64, start int, ttl time.Duration) {
	m.expire(m.now)
	h := m.holder(hkey{engine, 0})
	prev := mparent{key: m.hasher.root, root: true}
	for i, k := range keys {
		m.parent[k] = prev
		prev = mparent{key: k}
		if i >= start && !m.holdsReal(h, k) {
			h.approx[k] = m.now + int64(ttl)
		}
	}
}

// depth is the number of leading keys holder hk holds, real or live approximate.
func (m *model) depth(hk hkey, keys []uint64) int {
	h := m.holders[hk]
	if h == nil {
		return 0
	}
	n := 0
	for _, k := range keys {
		exp, approx := h.approx[k]
		if !m.holdsReal(h, k) && (!approx || exp <= m.now) {
			break
		}
		n++
	}
	return n
}

func (m *model) assume(engine state.EngineID, keys []uint64, ttl time.Duration) error {
	if ttl < 0 {
		return state.ErrInvalidConfiguration
	}
	if ttl == 0 {
		ttl = m.defaultTTL
	}
	if len(keys) == 0 {
		return nil
	}
	if hasDup(keys) {
		return ErrCyclicChain
	}
	m.record(engine, keys, 0, ttl)
	return nil
}

// liveBlocks is the number of blocks the index must keep: every key held through a real entry
// and its ancestors. Approximate entries are records beside the tree, not blocks.
func (m *model) liveBlocks() int {
	live := map[uint64]bool{}
	mark := func(k uint64) {
		for !live[k] {
			live[k] = true
			p := m.parent[k]
			if p.root {
				return
			}
			k = p.key
		}
	}
	for _, h := range m.holders {
		for _, e := range h.hashes {
			mark(e.key)
		}
	}
	return len(live)
}

func (m *model) match(keys []uint64) map[state.EngineID]int {
	out := map[state.EngineID]int{}
	for hk, h := range m.holders {
		n := 0
		for _, k := range keys {
			exp, approx := h.approx[k]
			if m.holdsReal(h, k) || (approx && exp > m.now) {
				n++
				continue
			}
			break
		}
		if n > 0 && n > out[hk.engine] {
			out[hk.engine] = n
		}
	}
	return out
}

func (m *model) stats() (blocks, approx int, engines map[state.EngineID]EngineStats) {
	engines = map[state.EngineID]EngineStats{}
	for hk, h := range m.holders {
		es := engines[hk.engine]
		es.Ranks++
		for _, e := range h.hashes {
			for i, p := range []*int{&es.DeviceBlocks, &es.HostBlocks, &es.DiskBlocks, &es.ExternalBlocks} {
				if e.tiers&(1<<i) != 0 {
					*p++
				}
			}
		}
		es.ApproximateBlocks += len(h.approx)
		approx += len(h.approx)
		engines[hk.engine] = es
	}
	if len(engines) == 0 {
		engines = nil
	}
	return m.liveBlocks(), approx, engines
}

// intner is the walk's source of choices: a seeded *rand.Rand for the random walk, the fuzzer's
// bytes for FuzzStoreRemove.
type intner interface{ IntN(n int) int }

// walk drives an Index and the model with the same random operations.
type walk struct {
	t     testing.TB
	rng   intner
	x     *Index
	m     *model
	clock time.Time
	log   []string
	// invariantsEvery > 1 checks the invariants (O(index)) after every invariantsEvery-th step
	// only, for walks over a large index; the model's answers are checked after every step.
	invariantsEvery, steps int
	// midClears counts the checks run between two chunks of a Clear or RemoveEngine
	// (checkMidClear), whose prompts midRng draws.
	midClears int
	midRng    *rand.Rand
}

const walkBlockTokens = 2

var walkEngines = []state.EngineID{"http://e0", "http://e1", "http://e2", "http://e3"}

// prompt returns a prompt of 1–6 blocks drawn from 3 block patterns, so prompts share
// prefixes often, and a trailing partial block sometimes (walkPrompt).
func (w *walk) prompt() []uint32 { return walkPrompt(w.rng) }

// walkPrompt is the walk's prompt, its choices drawn from rng.
func walkPrompt(rng intner) []uint32 {
	n := 1 + rng.IntN(6)
	var toks []uint32
	for range n {
		p := uint32(rng.IntN(3))
		toks = append(toks, 10*p+1, 10*p+2)
	}
	if rng.IntN(4) == 0 {
		toks = append(toks, 99)
	}
	return toks
}

// engineHash is the fake engine's own hash of a block: a function of the block key, the engine
// and an alias variant, so the same block gets the same hash unless the variant differs.
func engineHash(e state.EngineID, key uint64, variant int) uint64 {
	h := key ^ uint64(len(e))*0x9E3779B97F4A7C15 ^ uint64(e[len(e)-1])<<40 ^ uint64(variant)*0xBF58476D1CE4E5B9
	return h*0x94D049BB133111EB + 1
}

func (w *walk) tier() Tier {
	switch r := w.rng.IntN(20); {
	case r == 0:
		return 0
	case r == 1:
		return 0x20
	case r < 12:
		return TierDevice
	default:
		return Tier(1 << w.rng.IntN(4))
	}
}

func (w *walk) step() {
	var want, got error
	var desc string
	engine := walkEngines[w.rng.IntN(len(walkEngines))]
	rank := w.rng.IntN(2)
	switch op := w.rng.IntN(100); {
	case op < 45:
		toks := w.prompt()
		keys := w.x.hasher.Keys(toks)
		if len(keys) == 0 {
			return
		}
		p := 0
		if w.rng.IntN(2) == 0 {
			p = w.rng.IntN(len(keys))
		}
		end := p + 1 + w.rng.IntN(len(keys)-p)
		variant := 0
		if w.rng.IntN(10) == 0 {
			variant = 1
		}
		ev := StoreEvent{Engine: engine, DPRank: rank, Tier: w.tier(),
			TokenIDs: toks[p*walkBlockTokens : end*walkBlockTokens]}
		for i := p; i < end; i++ {
			ev.BlockHashes = append(ev.BlockHashes, engineHash(engine, keys[i], variant))
		}
		if p > 0 {
			ev.HasParent = true
			ev.ParentHash = engineHash(engine, keys[p-1], w.rng.IntN(2)*variant)
		}
		switch w.rng.IntN(40) {
		case 0:
			ev.TokenIDs = ev.TokenIDs[:len(ev.TokenIDs)-1]
		case 1:
			ev.BlockHashes = append(ev.BlockHashes, ev.BlockHashes[0])
			ev.TokenIDs = append(ev.TokenIDs, 5, 5)
		case 2:
			ev.HasParent, ev.ParentHash = true, ev.BlockHashes[len(ev.BlockHashes)-1]
		case 3:
			ev.DPRank = -1
		case 4:
			ev.BlockHashes, ev.TokenIDs = nil, nil
		}
		desc = fmt.Sprintf("store %s/%d parent=%v:%#x hashes=%#x tier=%v tokens=%v",
			ev.Engine, ev.DPRank, ev.HasParent, ev.ParentHash, ev.BlockHashes, ev.Tier, ev.TokenIDs)
		want, got = w.m.store(ev), w.x.Store(ev)
	case op < 65:
		var hashes []uint64
		if h := w.m.holders[hkey{engine, rank}]; h != nil {
			for hash := range h.hashes {
				hashes = append(hashes, hash)
			}
			slices.Sort(hashes)
			for i := len(hashes) - 1; i > 0; i-- {
				j := w.rng.IntN(i + 1)
				hashes[i], hashes[j] = hashes[j], hashes[i]
			}
			hashes = hashes[:min(len(hashes), 1+w.rng.IntN(4))]
		}
		if w.rng.IntN(10) == 0 {
			hashes = append(hashes, 0xDEAD)
		}
		if len(hashes) > 0 && w.rng.IntN(10) == 0 {
			hashes = append(hashes, hashes[0])
		}
		tiers := []Tier{0, allTiers, TierDevice, TierHost, TierDisk, TierExternal, TierDevice | TierHost, 0x40}[w.rng.IntN(8)]
		desc = fmt.Sprintf("remove %s/%d %#x tiers=%v", engine, rank, hashes, tiers)
		want, got = w.m.remove(engine, rank, hashes, tiers), w.x.Remove(engine, rank, hashes, tiers)
	case op < 70:
		if w.rng.IntN(8) == 0 {
			rank = -1
		}
		desc = fmt.Sprintf("clear %s/%d", engine, rank)
		want, got = w.m.clear(engine, rank), w.x.Clear(engine, rank)
	case op < 73:
		desc = fmt.Sprintf("remove engine %s", engine)
		want, got = w.m.removeEngine(engine), w.x.RemoveEngine(engine)
	case op < 88:
		keys := w.x.hasher.Keys(w.prompt())
		if len(keys) > 1 && w.rng.IntN(30) == 0 {
			keys = append(keys, keys[0])
		}
		ttl := []time.Duration{0, time.Second, 2 * time.Second, 5 * time.Second, -time.Second}[w.rng.IntN(5)]
		if ttl == 2*time.Second {
			// A route-time placement (LocalSource.Place): the index's own keys, with the depth
			// the engine's rank 0 holds as the hint.
			if len(keys) > 1 && keys[len(keys)-1] == keys[0] {
				keys = keys[:len(keys)-1]
			}
			held := w.m.depth(hkey{engine, 0}, keys)
			desc = fmt.Sprintf("place %s %#x held=%d ttl=%v", engine, keys, held, ttl)
			want, got = w.m.place(engine, keys, held, ttl), w.x.assume(engine, 0, keys, held, ttl, true)
			break
		}
		desc = fmt.Sprintf("assume %s %#x ttl=%v", engine, keys, ttl)
		want, got = w.m.assume(engine, keys, ttl), w.x.Assume(engine, keys, ttl)
	case op < 93:
		desc = "expire"
		wantN, gotN := w.m.expire(w.m.now), w.x.Expire(w.clock)
		require.Equal(w.t, wantN, gotN, "%s: expired count", desc)
	default:
		d := time.Duration(w.rng.IntN(1500)) * time.Millisecond
		w.clock = w.clock.Add(d)
		w.m.now = w.clock.UnixNano()
		desc = fmt.Sprintf("advance %v", d)
	}
	w.log = append(w.log, desc)
	if len(w.log) > 12 {
		w.log = w.log[1:]
	}
	if want == nil {
		require.NoError(w.t, got, "%s\nrecent: %q", desc, w.log)
	} else {
		require.ErrorIs(w.t, got, want, "%s\nrecent: %q", desc, w.log)
		var ee *EventError
		if !errors.Is(want, state.ErrInvalidConfiguration) {
			require.ErrorAs(w.t, got, &ee, "%s", desc)
		}
	}
	w.check(desc)
}

func (w *walk) check(desc string) {
	w.steps++
	if w.invariantsEvery <= 1 || w.steps%w.invariantsEvery == 0 {
		require.NoError(w.t, checkInvariants(w.x), "after %s\nrecent: %q", desc, w.log)
	}
	blocks, approx, engines := w.m.stats()
	st := w.x.Stats()
	require.Equal(w.t, blocks, st.Blocks, "blocks after %s\nrecent: %q", desc, w.log)
	require.Equal(w.t, approx, st.ApproximateBlocks, "approximate blocks after %s", desc)
	require.Equal(w.t, engines, st.Engines(), "engine stats after %s\nrecent: %q", desc, w.log)
	for range 3 {
		w.checkMatch(w.prompt(), "after "+desc)
	}
}

// checkMatch checks Match on the prompt toks against the model, its order, and the token path
// and the linear walk against it; when says at which point of the walk, for the messages.
func (w *walk) checkMatch(toks []uint32, when string) {
	var ms, mt, ml matches
	keys := w.x.hasher.Keys(toks)
	want := w.m.match(keys)
	w.x.matchInto(keys, &ms)
	got := map[state.EngineID]int{}
	for _, e := range ms.Engines {
		got[e.Engine] = e.Blocks
	}
	require.Equal(w.t, want, got, "match %#x %s\nrecent: %q", keys, when, w.log)
	// The token path and the linear walk agree.
	w.x.matchTokensInto(toks, &mt)
	require.Equal(w.t, ms.Engines, mt.Engines, "matchTokensInto %v %s\nrecent: %q", toks, when, w.log)
	w.x.matchLinearInto(keys, &ml)
	require.Equal(w.t, ms.Engines, ml.Engines, "linear walk %#x %s\nrecent: %q", keys, when, w.log)
	require.True(w.t, slices.IsSortedFunc(ms.Engines, func(a, b EngineMatch) int {
		if a.Blocks != b.Blocks {
			return b.Blocks - a.Blocks
		}
		return cmpString(a.Engine, b.Engine)
	}), "match order %v", ms.Engines)
}

func cmpString(a, b state.EngineID) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

func newWalk(t testing.TB, h Hasher, rng intner) *walk {
	return newWalkWith(t, h, rng, Options{})
}

// newWalkWith is newWalk with the sizing fields of opts (ExpectedBlocks, ExpectedHolderBlocks).
func newWalkWith(t testing.TB, h Hasher, rng intner, opts Options) *walk {
	w := &walk{t: t, rng: rng, clock: time.Unix(1000, 0)}
	w.m = newModel(h)
	w.m.now = w.clock.UnixNano()
	w.m.defaultTTL = 3 * time.Second
	var err error
	w.x, err = NewIndex(h, Options{ApproxTTL: 3 * time.Second, Now: func() time.Time { return w.clock },
		ExpectedBlocks: opts.ExpectedBlocks, ExpectedHolderBlocks: opts.ExpectedHolderBlocks})
	require.NoError(t, err)
	// Clear and RemoveEngine drop 2 entries per chunk, and Match is checked between chunks.
	w.x.clearChunk = 2
	w.midRng = rand.New(rand.NewPCG(7, 7))
	w.x.clearHook = w.checkMidClear
	return w
}

// checkMidClear runs between two chunks of a Clear or RemoveEngine (Index.clearHook), after the
// model applied the whole operation: Match, matchTokensInto and the linear walk must already
// answer as if the cleared holders held nothing (index.go, clearHolders).
func (w *walk) checkMidClear(int) {
	w.midClears++
	// Stats counts the cleared ranks' blocks as none; an engine being removed is still listed.
	_, approx, engines := w.m.stats()
	st := w.x.Stats()
	require.Equal(w.t, approx, st.ApproximateBlocks, "approximate blocks between chunks of a clear")
	for id, es := range st.Engines() {
		if want, ok := engines[id]; ok {
			require.Equal(w.t, want, es, "engine %s's stats between chunks of a clear\nrecent: %q", id, w.log)
		} else {
			require.Equal(w.t, EngineStats{Ranks: es.Ranks}, es, "engine %s's stats between chunks of its removal", id)
		}
	}
	for id := range engines {
		require.Contains(w.t, st.Engines(), id, "engines listed between chunks of a clear")
	}
	for range 2 {
		w.checkMatch(walkPrompt(w.midRng), "between chunks of a clear")
	}
}

func TestRandomWalkAgreesWithModel(t *testing.T) {
	t.Parallel()
	const seeds, steps = 16, 1000
	for seed := range uint64(seeds) {
		t.Run(fmt.Sprintf("seed=%d", seed), func(t *testing.T) {
			t.Parallel()
			h, err := NewHasher(HasherConfig{BlockTokens: walkBlockTokens, Seed: seed})
			require.NoError(t, err)
			// Seeds 2, 3, 6, 7, … size the tables up front (Options.ExpectedBlocks,
			// ExpectedHolderBlocks), small enough that the walk outgrows them and removes back below.
			var opts Options
			if seed%4 >= 2 {
				opts = Options{ExpectedBlocks: 4 + int(seed)*8, ExpectedHolderBlocks: 1 + int(seed)*4}
			}
			w := newWalkWith(t, h, rand.New(rand.NewPCG(seed, 0x5eed)), opts)
			w.x.wideSearch = seed%2 == 1 // the general search, as for more than 64 holders
			for range steps {
				w.step()
			}
			assert.NotZero(t, w.x.Stats().Blocks+len(w.m.holders), "the walk should leave some state")
			assert.Greater(t, w.midClears, 20, "checks between chunks of a clear")
		})
	}
}

// TestRandomWalkMakesHoles checks that the random walk reaches the states the hole rule is for
// (index.go, "holes"), so that TestRandomWalkAgreesWithModel tests Match across them: some step
// leaves a holey block while Match runs.
func TestRandomWalkMakesHoles(t *testing.T) {
	t.Parallel()
	h, err := NewHasher(HasherConfig{BlockTokens: walkBlockTokens, Seed: 3})
	require.NoError(t, err)
	w := newWalk(t, h, rand.New(rand.NewPCG(3, 0x5eed)))
	holey, steps := 0, 0
	for range 1000 {
		w.step()
		steps++
		if w.x.holey.len() > 0 {
			holey++
		}
	}
	assert.Greater(t, holey, steps/20, "steps with a holey block")
}

// TestMatchWithManyHolders checks the search for more than 64 holders at the first block (sets
// of several words) against the linear walk and a brute-force answer: 150 engines on two DP
// ranks hold a shared prefix to depths spread over the prompt, some with holes and expired
// approximate entries.
func TestMatchWithManyHolders(t *testing.T) {
	t.Parallel()
	h, err := NewHasher(HasherConfig{BlockTokens: 2})
	require.NoError(t, err)
	clock := time.Unix(100, 0)
	x, err := NewIndex(h, Options{Now: func() time.Time { return clock }})
	require.NoError(t, err)
	rng := rand.New(rand.NewPCG(7, 7))
	toks := make([]uint32, 2*300)
	for i := range toks {
		toks[i] = uint32(i)
	}
	keys := h.Keys(toks)
	for e := range 150 {
		id := state.EngineID(fmt.Sprintf("http://e%03d", e))
		n := 1 + rng.IntN(len(keys))
		hs := make([]uint64, n)
		for i := range hs {
			hs[i] = uint64(e)<<32 | uint64(i+1)
		}
		require.NoError(t, x.Store(StoreEvent{Engine: id, DPRank: e % 2, BlockHashes: hs, TokenIDs: toks[:2*n], Tier: TierDevice}))
		if n > 2 && rng.IntN(4) == 0 {
			require.NoError(t, x.Remove(id, e%2, []uint64{hs[rng.IntN(n-1)]}, 0)) // a hole
		}
		if rng.IntN(5) == 0 {
			require.NoError(t, x.Assume(state.EngineID(fmt.Sprintf("http://a%03d", e)), keys[:1+rng.IntN(len(keys))], time.Duration(1+rng.IntN(3))*time.Second))
		}
	}
	clock = clock.Add(2 * time.Second)
	require.NoError(t, checkInvariants(x))
	for _, wide := range []bool{false, true} {
		x.wideSearch = wide
		for _, n := range []int{1, 2, 17, 150, 299, 300} {
			var m, l matches
			x.matchInto(keys[:n], &m)
			x.matchLinearInto(keys[:n], &l)
			require.Equal(t, l.Engines, m.Engines, "n=%d wide=%v", n, wide)
			require.Equal(t, bruteMatch(x, keys[:n], clock.UnixNano()), m.Engines, "n=%d wide=%v", n, wide)
		}
	}
}

// ballastEvent is a chain of n blocks for an engine of their own, with tokens no walk prompt
// uses, so that its blocks fill the node and holding slabs' first pages (slabPageLen entries)
// without changing any walk match: Stores after it build their new blocks before taking the lock
// (Index.prebuild), which a slab still in its first page never does.
func ballastEvent(h Hasher, n int) StoreEvent {
	engine := state.EngineID("http://ballast")
	toks := make([]uint32, 0, n*h.blockTokens)
	for i := range n * h.blockTokens {
		toks = append(toks, uint32(1_000_000+i))
	}
	ev := StoreEvent{Engine: engine, TokenIDs: toks, Tier: TierDevice}
	for _, k := range h.Keys(toks) {
		ev.BlockHashes = append(ev.BlockHashes, engineHash(engine, k, 0))
	}
	return ev
}

// TestRandomWalkPastTheFirstSlabPage runs the model walk on an index whose slabs are past their
// first page, so that its Stores take the prebuild path (new blocks built before the lock,
// published under it), reusing freed nodes and holding runs, and checks it against the model and
// the invariants after every step, as TestRandomWalkAgreesWithModel does.
func TestRandomWalkPastTheFirstSlabPage(t *testing.T) {
	t.Parallel()
	for seed := range uint64(2) {
		t.Run(fmt.Sprintf("seed=%d", seed), func(t *testing.T) {
			t.Parallel()
			h, err := NewHasher(HasherConfig{BlockTokens: walkBlockTokens, Seed: seed})
			require.NoError(t, err)
			w := newWalk(t, h, rand.New(rand.NewPCG(seed, 0xba11)))
			ev := ballastEvent(h, slabPageLen+100)
			require.Equal(t, w.m.store(ev), w.x.Store(ev))
			w.check("ballast")
			w.invariantsEvery = 25
			before := w.x.prebuilt
			for range 500 {
				w.step()
			}
			require.Greater(t, w.x.prebuilt, before, "the walk's Stores should build new blocks before the lock")
		})
	}
}
