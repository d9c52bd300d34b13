package sim

import (
	"context"
	"encoding/binary"
	"slices"
	"sync"

	"github.com/cespare/xxhash/v2"

	"github.com/enginepick/enginepick/kvindex"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

// Defaults of the llm-d baselines (LLMD, and LLMDDefaultLRUCapacity for LLMDLegacy too).
const (
	// LLMDAffinityThreshold is the prefix score at or above which the prefix affinity filter
	// counts an endpoint as sticky; LLMDMaxTTFTPenaltyMs is the estimated TTFT gap (best sticky
	// minus best non-sticky) above which it keeps every endpoint; LLMDPeakPrefillThroughput is the
	// prefill throughput, in tokens per second, that turns an endpoint's in-flight tokens into
	// that estimate. DefaultConfig (0.80, 18,000 ms, 15,928 tokens/s; penaltySource constant,
	// explorationProbability 0) in llm-d/llm-d-router
	// `pkg/epp/framework/plugins/scheduling/filter/prefixcacheaffinity/plugin.go`.
	LLMDAffinityThreshold     = 0.80
	LLMDMaxTTFTPenaltyMs      = 18_000.0
	LLMDPeakPrefillThroughput = 15_928.0

	// LLMDQueueThresholdTokens is the in-flight token load at which the token-load scorer's score
	// reaches 0: tokenQueueThresholdDefault 4,194,304 in llm-d/llm-d-router
	// `pkg/epp/framework/plugins/scheduling/scorer/tokenload/token_load.go`.
	LLMDQueueThresholdTokens = 4_194_304

	// LLMDMaxPrefixTokens caps the prompt tokens the current prefix index hashes and matches
	// (defaultMaxPrefixTokens 131,072, which supersedes the block cap), and LLMDDefaultLRUCapacity
	// is the per-endpoint capacity of either prefix index, in blocks, when the endpoint does not
	// report its KV capacity (defaultLRUCapacityPerServer 31,250): llm-d/llm-d-router
	// `pkg/epp/framework/plugins/requestcontrol/dataproducer/approximateprefix/types.go`.
	LLMDMaxPrefixTokens    = 131_072
	LLMDDefaultLRUCapacity = 31_250
)

// LLMD is the llm-d router's current default scheduling profile, "sticky until saturated", as a
// replay baseline (name "llmd"; the earlier scorer blend is LLMDLegacy). Sources: the profile in
// llm-d/llm-d `guides/optimized-baseline/router/optimized-baseline.values.yaml` and
// `guides/optimized-baseline/README.md` (approx-prefix-cache-producer, inflight-load-producer,
// prefix-cache-affinity-filter, token-load-scorer, then the max-score picker the loader adds; the
// plugins at their defaults, which are calibrated for the guide's reference fleet; an earlier
// revision set the same gate in tokens, maxTokensInFlightPenalty 286,720); the filter in
// llm-d/llm-d-router
// `pkg/epp/framework/plugins/scheduling/filter/prefixcacheaffinity/plugin.go` and its README.md;
// the scorer in llm-d/llm-d-router `pkg/epp/framework/plugins/scheduling/scorer/tokenload/token_load.go`;
// the in-flight tokens in llm-d/llm-d-router
// `pkg/epp/framework/plugins/requestcontrol/dataproducer/inflightload/producer.go` and its
// README.md; the prefix index in llm-d/llm-d-router
// `pkg/epp/framework/plugins/requestcontrol/dataproducer/approximateprefix/hashing.go` and
// `pkg/epp/framework/plugins/requestcontrol/dataproducer/approximateprefix/types.go`.
//
// Per request, with B the engines' block size (the index auto-tunes to it):
//   - the prompt's first LLMDMaxPrefixTokens tokens are hashed in blocks of B, a trailing partial
//     block included; total = the number of blocks, matched(e) = the leading blocks endpoint e holds in the router's own index (as
//     LLMDLegacy's, recorded after each decision, at most the endpoint's KV capacity in blocks per
//     endpoint, least recently added evicted);
//   - prefix(e) = matched(e) ÷ total; uncached(e) = (total − matched(e))·B + the prompt tokens
//     beyond total·B;
//   - inflight(e) = the uncached tokens of the requests the router sent to e that have not
//     produced their first token (added when routed, dropped at the first token, or at the end of
//     a request that never produced one);
//   - filter: the sticky endpoints are those with prefix(e) ≥ LLMDAffinityThreshold. With none,
//     every candidate stays. Otherwise, when some candidate is not sticky and
//     (min over sticky − min over non-sticky of inflight(e)) ÷ LLMDPeakPrefillThroughput · 1000 ms
//     exceeds LLMDMaxTTFTPenaltyMs (about 286,704 tokens at the defaults), every candidate stays:
//     the sticky set is saturated. Else only the sticky endpoints stay (label ReasonLLMDSticky);
//   - score(e) = 1 − min(1, (inflight(e) + uncached(e)) ÷ LLMDQueueThresholdTokens) over the
//     endpoints that stayed; the highest wins, exact ties uniformly at random (the max-score
//     picker shuffles, then sorts stably).
//
// Everything this profile reads is the router's own bookkeeping: it reads none of the fleet's load
// reports, so a basic report (running and waiting requests only) changes nothing but the prefix
// index's capacity, which without a reported KV capacity is LLMDDefaultLRUCapacity blocks per
// endpoint (the auto-tuned capacity comes from the engine's cache configuration otherwise).
//
// Deviations: the full blocks' keys are the run's kvindex.Hasher keys and a partial block's key
// chains from the last of them (llm-d chains xxhash digests of the blocks' tokens; either way two
// prompts share a key exactly when they share the tokens up to it); every request streams, so its
// tokens leave inflight at its first token. Not modelled: flow control (off unless configured) and
// the state sync between router replicas. The engine's admission checker (Config.Admission) runs
// once on the winner.
//
// LLMD implements policy.Policy and is safe for concurrent use, but its in-flight bookkeeping
// pairs each pick with the request the replay binds next, so it is meant for the replay's
// sequential calls.
type LLMD struct {
	peerBase

	mu       sync.Mutex
	index    llmdPrefixIndex
	inflight map[state.EngineID]int64
	pending  *llmdRequest
	active   map[int32]*llmdRequest
	uncached []int64
	keep     []int // candidates the filter kept
}

var (
	_ policy.Policy  = (*LLMD)(nil)
	_ requestTracker = (*LLMD)(nil)
)

// llmdRequest is one routed request's uncached tokens on its endpoint (0 after its first token).
type llmdRequest struct {
	id     state.EngineID
	tokens int64
}

// NewLLMD returns the current llm-d baseline over env: env.Index's Hasher supplies the block keys,
// env.Load the endpoints' KV capacity (the index's size), env.Rand breaks ties and env.Admission
// checks the winner. A PolicyEnv without Load, InFlight, Index or Rand is an error wrapping
// state.ErrInvalidConfiguration.
func NewLLMD(env PolicyEnv) (*LLMD, error) {
	base, err := newPeerBase(NameLLMD, env)
	if err != nil {
		return nil, err
	}
	h := env.Index.Hasher()
	return &LLMD{peerBase: base, index: newLLMDPrefixIndex(h, LLMDMaxPrefixTokens/h.BlockTokens(), true),
		inflight: map[state.EngineID]int64{}, active: map[int32]*llmdRequest{}}, nil
}

// Pick implements policy.Policy. No candidates → policy.ErrNoCandidates. A request without
// TokenIDs hashes no block: no endpoint is sticky and its InputTokens are all uncached.
func (l *LLMD) Pick(_ context.Context, engines []state.Engine, req *policy.Request) (policy.Pick, error) {
	if len(engines) == 0 {
		return policy.Pick{}, policy.ErrNoCandidates
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	var tokens []uint32
	input := 0
	if req != nil {
		tokens, input = req.TokenIDs, int(req.InputTokens)
	}
	if len(tokens) > 0 {
		input = len(tokens)
	}
	x := &l.index
	x.match(tokens)
	bs := int64(x.hasher.BlockTokens())
	total := int64(len(x.keys))
	l.uncached = l.uncached[:0]
	for _, e := range engines {
		u := (total - int64(x.matched[e.ID()])) * bs
		l.uncached = append(l.uncached, u+max(int64(input)-total*bs, 0))
	}

	sticky := l.filter(engines)
	t := tieBreak{rand: l.env.Rand, best: -1}
	best := 0.0
	for _, i := range l.keep {
		load := float64(l.inflight[engines[i].ID()] + l.uncached[i])
		s := 1.0
		if load > 0 {
			s = 1 - min(load, LLMDQueueThresholdTokens)/LLMDQueueThresholdTokens
		}
		t.offer(i, t.best < 0 || s > best, s == best)
		if t.best == i {
			best = s
		}
	}
	winner := engines[t.best]
	if err := l.admit(winner); err != nil {
		return policy.Pick{}, err
	}
	x.record(winner.ID(), l.env.Load.Snapshot())
	if l.pending != nil { // a pick the replay never bound: the group did not use it
		l.inflight[l.pending.id] -= l.pending.tokens
	}
	l.pending = &llmdRequest{id: winner.ID(), tokens: l.uncached[t.best]}
	l.inflight[winner.ID()] += l.pending.tokens
	reason := ReasonLLMDMaxScore
	if sticky {
		reason = ReasonLLMDSticky
	}
	return policy.Pick{Engine: winner, Reason: reason}, nil
}

// filter sets l.keep to the indexes of the candidates the prefix affinity filter keeps and reports
// whether it narrowed them to the sticky set.
func (l *LLMD) filter(engines []state.Engine) bool {
	l.keep = l.keep[:0]
	all := func() bool {
		l.keep = l.keep[:0]
		for i := range engines {
			l.keep = append(l.keep, i)
		}
		return false
	}
	if len(engines) <= 1 {
		return all()
	}
	var bestSticky, bestOther int64 = -1, -1
	for i, e := range engines {
		load := l.inflight[e.ID()]
		if l.index.score(e.ID()) >= LLMDAffinityThreshold {
			l.keep = append(l.keep, i)
			if bestSticky < 0 || load < bestSticky {
				bestSticky = load
			}
		} else if bestOther < 0 || load < bestOther {
			bestOther = load
		}
	}
	if len(l.keep) == 0 {
		return all()
	}
	if bestOther >= 0 {
		ms := func(tokens int64) float64 { return float64(tokens) / LLMDPeakPrefillThroughput * 1000 }
		if ms(bestSticky)-ms(bestOther) > LLMDMaxTTFTPenaltyMs {
			return all()
		}
	}
	return true
}

func (l *LLMD) bind(id int32) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.pending != nil {
		l.active[id] = l.pending
		l.pending = nil
	}
}

func (l *LLMD) discard() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.pending != nil {
		l.inflight[l.pending.id] -= l.pending.tokens
		l.pending = nil
	}
}

// firstToken drops the request's tokens from its endpoint (StartOfStream).
func (l *LLMD) firstToken(id int32) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if q := l.active[id]; q != nil {
		l.inflight[q.id] -= q.tokens
		q.tokens = 0
	}
}

// finished forgets the request, dropping its tokens if it never produced a first token
// (EndOfStream).
func (l *LLMD) finished(id int32) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if q := l.active[id]; q != nil {
		l.inflight[q.id] -= q.tokens
		delete(l.active, id)
	}
}

// llmdPrefixIndex is llm-d's approximate prefix index (the approx-prefix-cache-producer): the
// router records the prompt block hashes of each decision for the chosen endpoint in that
// endpoint's LRU, and matches later prompts against them. A llmdPrefixIndex is used under its
// owner's lock.
type llmdPrefixIndex struct {
	hasher    kvindex.Hasher
	maxBlocks int  // blocks hashed at most, a partial one included
	tail      bool // hash a trailing partial block too (the current producer does; the legacy one did not)

	lrus    map[state.EngineID]*blockLRU
	holders map[uint64][]state.EngineID // block → endpoints whose LRU holds it (hashToPods)
	keys    []uint64                    // the last matched prompt's block hashes
	matched map[state.EngineID]int      // the last match: leading blocks per endpoint
	digest  *xxhash.Digest
}

// llmdTailSalt separates partial-block keys from the Hasher's full-block keys.
const llmdTailSalt = 0x6c6c6d2d74616c69 // "llm-tali"

func newLLMDPrefixIndex(h kvindex.Hasher, maxBlocks int, tail bool) llmdPrefixIndex {
	return llmdPrefixIndex{hasher: h, maxBlocks: max(maxBlocks, 1), tail: tail, lrus: map[state.EngineID]*blockLRU{},
		holders: map[uint64][]state.EngineID{}, matched: map[state.EngineID]int{}, digest: xxhash.New()}
}

// match hashes tokens into x.keys (at most maxBlocks blocks) and counts, in x.matched, each
// endpoint's leading blocks: walking the keys in order while some endpoint holds the block, each
// holder's count goes up by one (matchLongestPrefix).
func (x *llmdPrefixIndex) match(tokens []uint32) {
	bs := x.hasher.BlockTokens()
	if n := bs * x.maxBlocks; len(tokens) > n {
		tokens = tokens[:n]
	}
	x.keys = x.hasher.AppendKeys(x.keys[:0], tokens)
	if rest := tokens[len(x.keys)*bs:]; x.tail && len(rest) > 0 {
		parent := uint64(0)
		if n := len(x.keys); n > 0 {
			parent = x.keys[n-1]
		}
		x.keys = append(x.keys, x.tailKey(parent, rest))
	}
	clear(x.matched)
	for _, k := range x.keys {
		hs := x.holders[k]
		if len(hs) == 0 {
			break
		}
		for _, id := range hs {
			x.matched[id]++
		}
	}
}

// tailKey is the key of a partial block after the block whose key is parent.
func (x *llmdPrefixIndex) tailKey(parent uint64, rest []uint32) uint64 {
	var b [8]byte
	x.digest.Reset()
	binary.LittleEndian.PutUint64(b[:], parent^llmdTailSalt)
	_, _ = x.digest.Write(b[:])
	for _, t := range rest {
		binary.LittleEndian.PutUint32(b[:4], t)
		_, _ = x.digest.Write(b[:4])
	}
	return x.digest.Sum64()
}

// score is the last match's matched blocks of id ÷ hashed blocks, 0 when nothing was hashed.
func (x *llmdPrefixIndex) score(id state.EngineID) float64 {
	if len(x.keys) == 0 {
		return 0
	}
	return float64(x.matched[id]) / float64(len(x.keys))
}

// record adds the last matched prompt's blocks to the endpoint's LRU, then the endpoint to each
// block's holders (PreRequest → indexer.Add, in that order). The LRU's capacity is fixed when the
// endpoint is first recorded: its reported KV capacity in blocks, or LLMDDefaultLRUCapacity.
func (x *llmdPrefixIndex) record(id state.EngineID, snap loadmon.Snapshot) {
	c := x.lrus[id]
	if c == nil {
		capacity := LLMDDefaultLRUCapacity
		if ld, ok := snap.Load(id); ok && ld.KVCapacityTokens > 0 {
			capacity = max(int(ld.KVCapacityTokens)/x.hasher.BlockTokens(), 1)
		}
		c = newBlockLRU(capacity)
		x.lrus[id] = c
	}
	for _, k := range x.keys {
		if old, ok := c.add(k); ok {
			hs := x.holders[old]
			if i := slices.Index(hs, id); i >= 0 {
				hs = slices.Delete(hs, i, i+1)
			}
			if len(hs) == 0 {
				delete(x.holders, old)
			} else {
				x.holders[old] = hs
			}
		}
	}
	for _, k := range x.keys {
		if hs := x.holders[k]; !slices.Contains(hs, id) {
			x.holders[k] = append(hs, id)
		}
	}
}

// blockLRU is a fixed-capacity set of block keys in least-recently-added order (the
// hashicorp/golang-lru cache llm-d's indexer keeps per endpoint, reduced to what it uses).
type blockLRU struct {
	capacity int
	slot     map[uint64]int32
	nodes    []lruNode
	head     int32 // most recent; -1 when empty
	tail     int32 // least recent
}

type lruNode struct {
	key        uint64
	prev, next int32
}

func newBlockLRU(capacity int) *blockLRU {
	return &blockLRU{capacity: capacity, slot: map[uint64]int32{}, head: -1, tail: -1}
}

// add makes k the most recent key. When k was absent and the LRU was full, the least recent key
// is evicted and returned with true.
func (c *blockLRU) add(k uint64) (uint64, bool) {
	if i, ok := c.slot[k]; ok {
		c.unlink(i)
		c.pushHead(i)
		return 0, false
	}
	var evicted uint64
	full := len(c.slot) >= c.capacity
	var i int32
	if full {
		i = c.tail
		evicted = c.nodes[i].key
		c.unlink(i)
		delete(c.slot, evicted)
	} else {
		i = int32(len(c.nodes))
		c.nodes = append(c.nodes, lruNode{})
	}
	c.nodes[i].key = k
	c.slot[k] = i
	c.pushHead(i)
	return evicted, full
}

func (c *blockLRU) unlink(i int32) {
	n := &c.nodes[i]
	if n.prev >= 0 {
		c.nodes[n.prev].next = n.next
	} else {
		c.head = n.next
	}
	if n.next >= 0 {
		c.nodes[n.next].prev = n.prev
	} else {
		c.tail = n.prev
	}
}

func (c *blockLRU) pushHead(i int32) {
	n := &c.nodes[i]
	n.prev, n.next = -1, c.head
	if c.head >= 0 {
		c.nodes[c.head].prev = i
	} else {
		c.tail = i
	}
	c.head = i
}
