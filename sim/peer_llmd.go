package sim

import (
	"context"
	"slices"
	"sync"

	"github.com/enginepick/enginepick/kvindex"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

// Defaults of the llm-d baseline (LLMD).
const (
	// LLMDQueueWeight, LLMDKVCacheWeight and LLMDPrefixWeight are the weights of the queue,
	// KV-cache-utilization and prefix-cache scorers in the default scheduling profile: 2, 2 and 3
	// in loadDefaultConfig of llm-d/llm-d-inference-scheduler `pkg/epp/config/loader/defaults.go`.
	LLMDQueueWeight   = 2.0
	LLMDKVCacheWeight = 2.0
	LLMDPrefixWeight  = 3.0

	// LLMDMaxPrefixBlocks is how many leading blocks of a prompt the prefix index hashes, records
	// and matches: defaultMaxPrefixBlocks 256 in llm-d/llm-d-inference-scheduler
	// `pkg/epp/framework/plugins/requestcontrol/dataproducer/approximateprefix/types.go`.
	LLMDMaxPrefixBlocks = 256

	// LLMDDefaultLRUCapacity is the per-endpoint capacity of the prefix index, in blocks, when the
	// endpoint does not report its KV capacity (same file, defaultLRUCapacityPerServer 31,250).
	LLMDDefaultLRUCapacity = 31_250
)

// LLMD is the llm-d inference scheduler's default scheduling profile, as a replay baseline.
// Sources: the profile and its weights in llm-d/llm-d-inference-scheduler
// `pkg/epp/config/loader/defaults.go`; the scorers in llm-d/llm-d-inference-scheduler
// `pkg/epp/framework/plugins/scheduling/scorer/queuedepth/`,
// `pkg/epp/framework/plugins/scheduling/scorer/kvcacheutilization/` and
// `pkg/epp/framework/plugins/scheduling/scorer/prefix/`; the prefix scorer's route-time index in
// llm-d/llm-d-inference-scheduler
// `pkg/epp/framework/plugins/requestcontrol/dataproducer/approximateprefix/plugin.go`,
// `pkg/epp/framework/plugins/requestcontrol/dataproducer/approximateprefix/indexer.go` and
// `pkg/epp/framework/plugins/requestcontrol/dataproducer/approximateprefix/types.go`; the picker in
// llm-d/llm-d-inference-scheduler `pkg/epp/framework/plugins/scheduling/picker/maxscore/`.
//
// Every candidate gets score = 2·queue + 2·kv + 3·prefix and the highest wins, exact ties
// uniformly at random (the max-score picker shuffles, then sorts stably):
//   - queue = (max − q) ÷ (max − min) over the candidates' reported waiting requests q, or 1 for
//     every candidate when all are equal;
//   - kv = 1 − the reported KV usage fraction (UsedKVTokens ÷ KVCapacityTokens);
//   - prefix = matched blocks ÷ hashed blocks of the prompt, from the scheduler's own approximate
//     index: the prompt's first LLMDMaxPrefixBlocks full blocks are hashed (with the run's
//     kvindex.Hasher, at the engines' block size, as auto-tuning from the engine's cache_config_info
//     does); walking them in order while some endpoint holds the block, each holder's count goes
//     up by one. After each decision the chosen endpoint's prompt blocks are recorded in its LRU,
//     whose capacity is the endpoint's KV capacity in blocks (auto-tuned; LLMDDefaultLRUCapacity
//     before it reports); an evicted block leaves the block → endpoints map.
//
// Engine metrics come from the run's load table, which the simulated engines refresh every
// Config.ReportInterval (llm-d scrapes every 50 ms by default); an engine without a fresh report
// counts as empty (queue 0, usage 0), as a zero metrics struct does in llm-d. Not modelled: flow
// control and the saturation detector, which hold requests in the gateway while every endpoint is
// saturated. The engine's admission checker (Config.Admission) runs once on the winner.
//
// LLMD implements policy.Policy and is safe for concurrent use.
type LLMD struct {
	peerBase
	hasher kvindex.Hasher

	mu      sync.Mutex
	lrus    map[state.EngineID]*blockLRU
	holders map[uint64][]state.EngineID // block → endpoints whose LRU holds it (hashToPods)
	keys    []uint64
	matched map[state.EngineID]int
	scores  []float64
}

var _ policy.Policy = (*LLMD)(nil)

// NewLLMD returns the llm-d baseline over env: env.Load supplies the engine metrics, env.Index's
// Hasher the block keys, env.Rand breaks ties and env.Admission checks the winner. A PolicyEnv
// without Load, InFlight, Index or Rand is an error wrapping state.ErrInvalidConfiguration.
func NewLLMD(env PolicyEnv) (*LLMD, error) {
	base, err := newPeerBase(NameLLMD, env)
	if err != nil {
		return nil, err
	}
	return &LLMD{peerBase: base, hasher: env.Index.Hasher(), lrus: map[state.EngineID]*blockLRU{},
		holders: map[uint64][]state.EngineID{}, matched: map[state.EngineID]int{}}, nil
}

// Pick implements policy.Policy. No candidates → policy.ErrNoCandidates. A request without
// TokenIDs hashes no block: every prefix score is 0.
func (l *LLMD) Pick(_ context.Context, engines []state.Engine, req *policy.Request) (policy.Pick, error) {
	if len(engines) == 0 {
		return policy.Pick{}, policy.ErrNoCandidates
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	var tokens []uint32
	if req != nil {
		tokens = req.TokenIDs
	}
	if n := l.hasher.BlockTokens() * LLMDMaxPrefixBlocks; len(tokens) > n {
		tokens = tokens[:n]
	}
	l.keys = l.hasher.AppendKeys(l.keys[:0], tokens)
	clear(l.matched)
	for _, k := range l.keys { // matchLongestPrefix
		hs := l.holders[k]
		if len(hs) == 0 {
			break
		}
		for _, id := range hs {
			l.matched[id]++
		}
	}

	snap := l.env.Load.Snapshot()
	l.scores = l.scores[:0]
	minQ, maxQ := uint64(0), uint64(0)
	for i, e := range engines {
		var q uint64
		if ld, ok := snap.Load(e.ID()); ok {
			q = ld.WaitingRequests
		}
		if i == 0 || q < minQ {
			minQ = q
		}
		maxQ = max(maxQ, q)
	}
	t := tieBreak{rand: l.env.Rand, best: -1}
	var best float64
	for i, e := range engines {
		var q uint64
		usage := 0.0
		if ld, ok := snap.Load(e.ID()); ok {
			q = ld.WaitingRequests
			if f, ok := ld.KVUsageFraction(); ok {
				usage = f
			}
		}
		queue := 1.0
		if maxQ > minQ {
			queue = float64(maxQ-q) / float64(maxQ-minQ)
		}
		prefix := 0.0
		if len(l.keys) > 0 {
			prefix = float64(l.matched[e.ID()]) / float64(len(l.keys))
		}
		s := LLMDQueueWeight*queue + LLMDKVCacheWeight*(1-usage) + LLMDPrefixWeight*prefix
		t.offer(i, t.best < 0 || s > best, s == best)
		if t.best == i {
			best = s
		}
	}
	winner := engines[t.best]
	if err := l.admit(winner); err != nil {
		return policy.Pick{}, err
	}
	l.record(winner.ID(), snap)
	return policy.Pick{Engine: winner, Reason: ReasonLLMDMaxScore}, nil
}

// record adds the prompt's hashed blocks to the endpoint's LRU, then the endpoint to each block's
// holders (PreRequest → indexer.Add, in that order). The LRU's capacity is fixed when the endpoint
// is first recorded: its reported KV capacity in blocks, or LLMDDefaultLRUCapacity.
func (l *LLMD) record(id state.EngineID, snap loadmon.Snapshot) {
	c := l.lrus[id]
	if c == nil {
		capacity := LLMDDefaultLRUCapacity
		if ld, ok := snap.Load(id); ok && ld.KVCapacityTokens > 0 {
			capacity = max(int(ld.KVCapacityTokens)/l.hasher.BlockTokens(), 1)
		}
		c = newBlockLRU(capacity)
		l.lrus[id] = c
	}
	for _, k := range l.keys {
		if old, ok := c.add(k); ok {
			hs := l.holders[old]
			if i := slices.Index(hs, id); i >= 0 {
				hs = slices.Delete(hs, i, i+1)
			}
			if len(hs) == 0 {
				delete(l.holders, old)
			} else {
				l.holders[old] = hs
			}
		}
	}
	for _, k := range l.keys {
		if hs := l.holders[k]; !slices.Contains(hs, id) {
			l.holders[k] = append(hs, id)
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
