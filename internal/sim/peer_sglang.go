package sim

import (
	"cmp"
	"container/heap"
	"context"
	"slices"
	"sync"
	"time"

	"github.com/cespare/xxhash/v2"

	"github.com/enginepick/enginepick/internal/label"
	"github.com/enginepick/enginepick/kvindex"
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

// Defaults of the SGLang legacy baseline (SGLangLegacy): the SGLang router's launcher defaults
// for cache_aware (sgl-project/sglang `sgl-router/py_src/sglang_router/router_args.py`,
// RouterArgs: cache_threshold 0.3, balance_abs_threshold 64, balance_rel_threshold 1.5,
// eviction_interval_secs 120, max_tree_size 2^26). CacheAwareConfig::default in sgl-project/sglang
// `sgl-router/src/policies/mod.rs` differs (0.5, 32, 1.1, 30 s, 10,000); the router as launched
// uses the launcher's values.
const (
	SGLangCacheThreshold       = 0.3
	SGLangBalanceAbsThreshold  = 64
	SGLangBalanceRelThreshold  = 1.5
	SGLangEvictionInterval     = 120 * time.Second
	SGLangMaxTreeSizeChars     = 1 << 26
	SGLangCharsPerToken        = 4 // llm-d's averageCharactersPerToken, to size the character tree in tokens
	sglangMaxTreeSizeTokens    = SGLangMaxTreeSizeChars / SGLangCharsPerToken
	sglangRootTenantSaltOffset = 0x7369676c616e67 // "siglang": separates the tenant order from node salts
)

// SGLangLegacy is the SGLang router's legacy cache_aware policy, as a replay baseline. Sources:
// sgl-project/sglang `sgl-router/src/policies/cache_aware.rs` and `sgl-router/src/policies/tree.rs`:
// CacheAwarePolicy.select_worker in the first; Tree.insert, prefix_match, get_smallest_tenant and
// evict_tenant_by_size in the second. Defaults as SGLangCacheThreshold and the constants beside it.
//
// Per request, with load(w) the router's in-flight requests to w (the run's loadmon.InFlight,
// which the Router increments at dispatch and decrements when the request ends, as the SGLang
// router counts a worker's load):
//  1. If max − min > SGLangBalanceAbsThreshold and max > SGLangBalanceRelThreshold · min over the
//     candidates, the first least-loaded candidate (in ID order) takes the request (label
//     least_load).
//  2. Otherwise the prompt is matched in the router's own radix tree of the prompts it routed to
//     each worker. If matched ÷ prompt tokens > SGLangCacheThreshold, a worker recorded at the
//     deepest matched node takes it (cache_candidate); else the worker with the
//     smallest tree (no_cache_candidate).
//  3. The prompt is inserted into the tree for the chosen worker, in both branches.
//
// Every SGLangEvictionInterval of virtual time, each worker whose tree holds more than
// SGLangMaxTreeSizeChars characters loses least-recently-used leaves until it fits.
//
// Deviations, each forced by the replay's synthetic prompts: SGLang's tree holds characters; here
// it holds the prompt's full KV blocks (the run's kvindex.Hasher keys, 512 tokens on the Mooncake
// traces, which record reuse in whole 512-token blocks anyway), so matches are counted in whole
// blocks and a tree's size is its blocks' tokens × SGLangCharsPerToken characters. Where SGLang
// takes "the first" of several workers in a DashMap (the workers at the deepest node; the smallest
// of equally small trees), whose iteration order is a per-map random hash order, this baseline
// takes the first in a per-node (per-tree) pseudo-random order drawn from the run's seed. The
// engine's admission checker (Config.Admission) runs once on the chosen worker.
//
// SGLangLegacy implements policy.Policy and is safe for concurrent use.
type SGLangLegacy struct {
	peerBase

	mu   sync.Mutex
	tree sglangTree
}

var _ policy.Policy = (*SGLangLegacy)(nil)

// NewSGLangLegacy returns the SGLang legacy baseline over env: env.InFlight supplies the loads,
// env.Index's Hasher the block keys, env.Now the clock of the tree's access times and eviction,
// env.Rand the seed of its tie orders, env.Admission checks the chosen worker. A PolicyEnv without
// Load, InFlight, Index, Rand or Now is an error wrapping state.ErrInvalidConfiguration.
func NewSGLangLegacy(env PolicyEnv) (*SGLangLegacy, error) {
	base, err := newPeerBase(NameSGLangLegacy, env)
	if err != nil {
		return nil, err
	}
	if env.Now == nil {
		return nil, errNoClock(NameSGLangLegacy)
	}
	s := &SGLangLegacy{peerBase: base}
	s.tree.init(env, sglangMaxTreeSizeTokens, SGLangEvictionInterval, false)
	return s, nil
}

// Pick implements policy.Policy. No candidates → policy.ErrNoCandidates. A request without
// TokenIDs matches nothing and goes to the smallest tree unless the loads are imbalanced.
func (s *SGLangLegacy) Pick(_ context.Context, engines []state.Engine, req *policy.Request) (policy.Pick, error) {
	if len(engines) == 0 {
		return policy.Pick{}, policy.ErrNoCandidates
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.env.Now()
	t := &s.tree
	t.prepare(now, engines, req)

	minI, minLoad, maxLoad := 0, uint64(0), uint64(0)
	for i, e := range engines {
		l := s.env.InFlight.Count(e.ID())
		if i == 0 || l < minLoad {
			minI, minLoad = i, l
		}
		maxLoad = max(maxLoad, l)
	}
	var chosen state.Engine
	reason := label.ReasonLeastLoad
	if maxLoad-minLoad > SGLangBalanceAbsThreshold && float32(maxLoad) > float32(minLoad)*SGLangBalanceRelThreshold {
		chosen = engines[minI]
	} else {
		node, depth := t.match()
		rate := 0.0
		if n := t.promptTokens; n > 0 {
			rate = float64(depth*t.bs) / float64(n)
		}
		var id state.EngineID
		if i := t.firstTenant(node); i >= 0 {
			id = node.tenants[i].id
			for n := node; n != nil; n = n.parent { // prefix_match refreshes the matched path
				n.touch(id, now)
			}
		}
		if rate > SGLangCacheThreshold {
			reason = label.ReasonCacheCandidate
		} else {
			reason = label.ReasonNoCacheCandidate
			id = t.smallestTenant()
		}
		for _, e := range engines {
			if e.ID() == id {
				chosen = e
				break
			}
		}
		if chosen == nil { // the tenant is not a candidate: SGLang falls back to the first healthy worker
			chosen = engines[0]
		}
	}
	if err := s.admit(chosen); err != nil {
		return policy.Pick{}, err
	}
	t.insert(chosen.ID(), now)
	return policy.Pick{Engine: chosen, Reason: reason}, nil
}

// sglangNode is one block of the tree: the workers whose routed prompts passed through it, with
// the time each last did.
type sglangNode struct {
	key      uint64
	parent   *sglangNode
	children []*sglangNode
	salt     uint64
	tenants  []sglangTenant
}

type sglangTenant struct {
	id   state.EngineID
	last time.Time
}

// sglangTree is the router's own radix tree of the prompts it routed to each worker (tenant), in
// whole blocks of the run's kvindex.Hasher, shared by SGLangLegacy and SMG. It is used under its
// owner's lock.
type sglangTree struct {
	hasher kvindex.Hasher
	bs     int

	// Tunables, set by init (tests shrink them).
	maxTreeTokens    int
	evictionInterval time.Duration
	sharedBudget     bool // maxTreeTokens bounds the whole tree (SMG), not each tenant (legacy)

	root         *sglangNode
	nodes        map[uint64]*sglangNode
	size         map[state.EngineID]int // tokens per tenant (tenant_char_count ÷ chars per token)
	total        int                    // Σ size
	tenantHash   map[state.EngineID]uint64
	tenants      []state.EngineID // every tenant ever seen, for the smallest-tree scan
	seed         uint64
	salts        uint64 // nodes created, to derive node salts
	nextEviction time.Time
	promptTokens int      // the prepared request's prompt length
	keys         []uint64 // its full blocks' keys
	seq          uint64   // tie order of eviction entries
}

func (s *sglangTree) init(env PolicyEnv, maxTreeTokens int, evictionInterval time.Duration, sharedBudget bool) {
	h := env.Index.Hasher()
	*s = sglangTree{hasher: h, bs: h.BlockTokens(), maxTreeTokens: maxTreeTokens, evictionInterval: evictionInterval,
		sharedBudget: sharedBudget, nodes: map[uint64]*sglangNode{}, size: map[state.EngineID]int{},
		tenantHash: map[state.EngineID]uint64{}, seed: uint64(env.Rand(1<<30))<<32 | uint64(env.Rand(1<<30))}
	s.root = &sglangNode{salt: mix64(s.seed ^ sglangRootTenantSaltOffset)}
	s.nextEviction = env.Now().Add(s.evictionInterval)
}

// prepare runs the evictions due by now, registers the candidates as tenants and hashes the
// request's prompt.
func (s *sglangTree) prepare(now time.Time, engines []state.Engine, req *policy.Request) {
	for !now.Before(s.nextEviction) {
		s.evict(s.maxTreeTokens)
		s.nextEviction = s.nextEviction.Add(s.evictionInterval)
	}
	for _, e := range engines {
		s.register(e.ID())
	}
	var tokens []uint32
	if req != nil {
		tokens = req.TokenIDs
	}
	s.promptTokens = len(tokens)
	s.keys = s.hasher.AppendKeys(s.keys[:0], tokens)
}

// register makes id a tenant with an empty tree (init_workers inserts "" for every worker).
func (s *sglangTree) register(id state.EngineID) {
	if _, ok := s.tenantHash[id]; ok {
		return
	}
	s.tenantHash[id] = xxhash.Sum64String(string(id))
	s.size[id] = 0
	s.tenants = append(s.tenants, id)
	s.root.touch(id, time.Time{})
}

// match walks the prompt's keys down the tree and returns the deepest matched node and its depth
// in blocks (the root and 0 when nothing matches).
func (s *sglangTree) match() (*sglangNode, int) {
	n := s.root
	depth := 0
	for _, k := range s.keys {
		c := s.nodes[k]
		if c == nil || c.parent != n {
			break
		}
		n = c
		depth++
	}
	return n, depth
}

// order is the position of tenant id in the pseudo-random iteration order salted by salt.
func (s *sglangTree) order(salt uint64, id state.EngineID) uint64 {
	return mix64(salt ^ s.tenantHash[id])
}

// firstTenant returns the index in n.tenants of the tenant DashMap iteration would yield first,
// or -1 when n has none.
func (s *sglangTree) firstTenant(n *sglangNode) int {
	best, bestOrder := -1, uint64(0)
	for i, t := range n.tenants {
		if o := s.order(n.salt, t.id); best < 0 || o < bestOrder {
			best, bestOrder = i, o
		}
	}
	return best
}

// firstTenants appends to dst up to n tenants of node in the order DashMap iteration would yield
// them (the per-node pseudo-random order of firstTenant).
func (s *sglangTree) firstTenants(dst []state.EngineID, node *sglangNode, n int) []state.EngineID {
	start := len(dst)
	for _, t := range node.tenants {
		dst = append(dst, t.id)
	}
	slices.SortFunc(dst[start:], func(a, b state.EngineID) int {
		return cmp.Compare(s.order(node.salt, a), s.order(node.salt, b))
	})
	return dst[:min(len(dst), start+n)]
}

// smallestTenant returns the tenant with the smallest tree; among equal sizes, the first in the
// tree's own iteration order.
func (s *sglangTree) smallestTenant() state.EngineID {
	var best state.EngineID
	bestSize, bestOrder := 0, uint64(0)
	for i, id := range s.tenants {
		sz, o := s.size[id], s.order(s.root.salt^sglangRootTenantSaltOffset, id)
		if i == 0 || sz < bestSize || (sz == bestSize && o < bestOrder) {
			best, bestSize, bestOrder = id, sz, o
		}
	}
	return best
}

// insert records the prompt's blocks for id: every node on the path gets id with access time now;
// a block new to id adds its tokens to id's size.
func (s *sglangTree) insert(id state.EngineID, now time.Time) {
	n := s.root
	n.touch(id, now)
	for _, k := range s.keys {
		c := s.nodes[k]
		if c == nil || c.parent != n {
			s.salts++
			c = &sglangNode{key: k, parent: n, salt: mix64(s.seed + s.salts*splitmixGamma)}
			n.children = append(n.children, c)
			s.nodes[k] = c
		}
		if c.touch(id, now) {
			s.size[id] += s.bs
			s.total += s.bs
		}
		n = c
	}
}

// touch sets id's access time at n to now, adding id if absent; it reports whether id was new.
func (n *sglangNode) touch(id state.EngineID, now time.Time) bool {
	for i := range n.tenants {
		if n.tenants[i].id == id {
			n.tenants[i].last = now
			return false
		}
	}
	n.tenants = append(n.tenants, sglangTenant{id: id, last: now})
	return true
}

func (n *sglangNode) has(id state.EngineID) bool {
	return slices.ContainsFunc(n.tenants, func(t sglangTenant) bool { return t.id == id })
}

// leafFor reports whether n holds id and none of its children does.
func (n *sglangNode) leafFor(id state.EngineID) bool {
	if !n.has(id) {
		return false
	}
	for _, c := range n.children {
		if c.has(id) {
			return false
		}
	}
	return true
}

// evict is evict_tenant_by_size: every (leaf, tenant) entry goes into a min-heap by access time;
// entries are popped oldest first, and each pop while the budget is exceeded removes the tenant
// from that node (a node left with no tenant leaves the tree), then queues the parent if it has
// become a leaf for the tenant. The budget is per tenant (the popped entry's tenant above
// maxTokens) or, with sharedBudget, the whole tree's (the total above maxTokens).
func (s *sglangTree) evict(maxTokens int) {
	within := func(id state.EngineID) bool {
		if s.sharedBudget {
			return s.total <= maxTokens
		}
		return s.size[id] <= maxTokens
	}
	over := false
	for _, id := range s.tenants {
		over = over || !within(id)
	}
	if !over {
		return
	}
	var h evictionHeap
	var walk func(n *sglangNode)
	walk = func(n *sglangNode) {
		for _, c := range n.children {
			walk(c)
		}
		if n == s.root {
			return
		}
		for _, t := range n.tenants {
			if n.leafFor(t.id) {
				s.seq++
				h = append(h, evictionEntry{last: t.last, seq: s.seq, id: t.id, node: n})
			}
		}
	}
	walk(s.root)
	heap.Init(&h)
	for h.Len() > 0 {
		e := heap.Pop(&h).(evictionEntry)
		if within(e.id) {
			if s.sharedBudget {
				break
			}
			continue
		}
		n := e.node
		i := slices.IndexFunc(n.tenants, func(t sglangTenant) bool { return t.id == e.id })
		if i < 0 {
			continue
		}
		n.tenants = slices.Delete(n.tenants, i, i+1)
		s.size[e.id] -= s.bs
		s.total -= s.bs
		p := n.parent
		if len(n.tenants) == 0 {
			if j := slices.Index(p.children, n); j >= 0 {
				p.children = slices.Delete(p.children, j, j+1)
			}
			delete(s.nodes, n.key)
		}
		if p != s.root && p.leafFor(e.id) {
			for _, t := range p.tenants {
				if t.id == e.id {
					s.seq++
					heap.Push(&h, evictionEntry{last: t.last, seq: s.seq, id: e.id, node: p})
				}
			}
		}
	}
}

type evictionEntry struct {
	last time.Time
	seq  uint64
	id   state.EngineID
	node *sglangNode
}

// evictionHeap orders entries oldest access first, then in push order.
type evictionHeap []evictionEntry

func (h evictionHeap) Len() int { return len(h) }
func (h evictionHeap) Less(i, j int) bool {
	if !h[i].last.Equal(h[j].last) {
		return h[i].last.Before(h[j].last)
	}
	return h[i].seq < h[j].seq
}
func (h evictionHeap) Swap(i, j int) { h[i], h[j] = h[j], h[i] }
func (h *evictionHeap) Push(x any)   { *h = append(*h, x.(evictionEntry)) }
func (h *evictionHeap) Pop() any {
	old := *h
	e := old[len(old)-1]
	*h = old[:len(old)-1]
	return e
}
