package sim

import (
	"context"
	"sync"

	"github.com/enginepick/enginepick/kvindex"
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

// Defaults of the Dynamo baselines.
const (
	// DynamoOverlapScoreCredit and DynamoPrefillLoadScale are the current cost's device-overlap
	// credit and prefill scale, both 1.0: KvRouterConfig::default in ai-dynamo/dynamo
	// `lib/kv-router/src/scheduling/config.rs` (overlap_score_credit 1.0, prefill_load_scale 1.0;
	// the deprecated overlap_score_weight now sets prefill_load_scale).
	DynamoOverlapScoreCredit = 1.0
	DynamoPrefillLoadScale   = 1.0

	// DynamoOverlapScoreWeight is the weight of the prefill term in the legacy cost, its default
	// then (ai-dynamo/dynamo `lib/llm/src/kv_router.rs` KvRouterConfig, overlap_score_weight 1.0;
	// --kv-overlap-score-weight on the frontend).
	DynamoOverlapScoreWeight = 1.0
)

// Dynamo is NVIDIA Dynamo's KV router at its defaults, as a replay baseline: NewDynamo builds the
// current cost, NewDynamoLegacy the cost of earlier releases. Both share the router's own request
// bookkeeping and differ in the cost's form and the tie-break.
//
// Current cost (NewDynamo, name "dynamo"). Sources: ai-dynamo/dynamo
// `lib/kv-router/src/scheduling/selector/default.rs` (DefaultWorkerScorer.worker_logit,
// pick_default_worker), ai-dynamo/dynamo `lib/kv-router/src/scheduling/selector/mod.rs` (the
// candidate row: raw prefill blocks, decode cost blocks), ai-dynamo/dynamo
// `lib/kv-router/src/scheduling/config.rs` (KvRouterConfig::default), ai-dynamo/dynamo
// `docs/components/router/router-concepts.md` (the cost model). For every candidate w, with block
// size B (EngineModel.BlockTokens), prompt length ISL and overlap(w) the prompt's leading full
// blocks w holds according to the run's kvindex.Index (the engines' KV events, as Dynamo's
// indexer receives them):
//
//	raw_prefill_blocks(w) = (active_prefill_tokens(w) + ISL) ÷ B
//	credit(w)             = DynamoOverlapScoreCredit · overlap(w)
//	decode_blocks(w)      = active_blocks(w) + the prompt's full blocks not among w's active blocks
//	cost(w)               = DynamoPrefillLoadScale · max(raw_prefill_blocks(w) − credit(w), 0) + decode_blocks(w)
//
// The lowest cost wins; exact ties are broken uniformly at random (router_temperature 0, the
// default, takes the argmin and draws among ties). The other defaults of that config leave the
// cost as written: overlap_score_credit_decay 0 (no decay of the credit with excess prefill
// load), decode_active_request_weight 0 (no per-request term), shared_cache_multiplier 0, no
// busy thresholds (no worker is filtered as overloaded), router_queue_threshold unset (no
// router-side queue), router_predicted_ttl_secs unset (no predicted-on-route index),
// router_track_output_blocks false. The credit also has host (0.75) and disk (0.25) weights for
// blocks held beyond the device prefix in lower tiers; the replay's engines store every block on
// the device tier (internal/sim/cache.go), so those terms are always 0 here.
//
// Legacy cost (NewDynamoLegacy, name "dynamo_legacy"). Sources: ai-dynamo/dynamo
// `lib/llm/src/kv_router/scheduler.rs` (DefaultWorkerSelector.select_worker, softmax_sample) and
// ai-dynamo/dynamo `lib/llm/src/kv_router/sequence.rs` (ActiveSequences):
//
//	prefill_tokens(w) = active_prefill_tokens(w) + ISL − overlap(w)·B
//	cost(w)           = DynamoOverlapScoreWeight · prefill_tokens(w) ÷ B + decode_blocks(w)
//
// The lowest cost wins; among exact ties the worker holding the fewest blocks in the index wins
// (select_worker's tree-size tie-breaker), and remaining ties are broken uniformly at random. On
// device-only caches the two costs are equal; only the tie-break differs.
//
// Bookkeeping, in both: active_prefill_tokens and active_blocks are the router's own records, not
// engine reports, so Dynamo reads none of the fleet's load reports (a basic report, running and
// waiting requests only, changes nothing). A routed request adds its uncached prompt tokens
// ISL − overlap·B and its prompt's block keys (reference-counted per worker) to the chosen worker,
// drops the tokens at its first token and the blocks when it ends (ActiveSequences:
// add_request, mark_prefill_completed, free).
//
// Not modelled: replica synchronisation between several routers (router_replica_sync, off by
// default). The engine's admission checker (Config.Admission) runs once on the winner.
//
// Dynamo implements policy.Policy and is safe for concurrent use, but its request bookkeeping
// pairs each pick with the request the replay binds next, so it is meant for the replay's
// sequential calls.
type Dynamo struct {
	peerBase
	hasher kvindex.Hasher
	bs     int
	legacy bool // the legacy cost and its tree-size tie-break

	mu        sync.Mutex
	workers   map[state.EngineID]*dynamoWorker
	active    map[int32]*dynamoRequest
	pending   *dynamoRequest
	keys      []uint64
	costs     []float64
	newTokens []int
	free      []*dynamoRequest
}

var (
	_ policy.Policy  = (*Dynamo)(nil)
	_ requestTracker = (*Dynamo)(nil)
)

// dynamoWorker is the router's view of one worker (ActiveSequences).
type dynamoWorker struct {
	prefillTokens int              // active_prefill_tokens
	blocks        map[uint64]int32 // active prompt blocks, reference-counted (unique_blocks)
}

// dynamoRequest is one routed request's contribution to its worker.
type dynamoRequest struct {
	worker  *dynamoWorker
	prefill int // tokens still counted in prefillTokens; 0 after the first token
	keys    []uint64
}

// NewDynamo returns the Dynamo baseline with the current cost over env: env.Index supplies the
// overlap, env.Rand breaks ties, env.Admission checks the winner. A PolicyEnv without Load,
// InFlight, Index or Rand is an error wrapping state.ErrInvalidConfiguration.
func NewDynamo(env PolicyEnv) (*Dynamo, error) { return newDynamo(NameDynamo, env, false) }

// NewDynamoLegacy returns the Dynamo baseline with the legacy cost and tie-break; otherwise as
// NewDynamo.
func NewDynamoLegacy(env PolicyEnv) (*Dynamo, error) { return newDynamo(NameDynamoLegacy, env, true) }

func newDynamo(name string, env PolicyEnv, legacy bool) (*Dynamo, error) {
	base, err := newPeerBase(name, env)
	if err != nil {
		return nil, err
	}
	h := env.Index.Hasher()
	return &Dynamo{peerBase: base, hasher: h, bs: h.BlockTokens(), legacy: legacy,
		workers: map[state.EngineID]*dynamoWorker{}, active: map[int32]*dynamoRequest{}}, nil
}

// Pick implements policy.Policy. No candidates → policy.ErrNoCandidates. A request without
// TokenIDs has no overlap and no blocks: only the prefill term of InputTokens counts.
func (d *Dynamo) Pick(_ context.Context, engines []state.Engine, req *policy.Request) (policy.Pick, error) {
	if len(engines) == 0 {
		return policy.Pick{}, policy.ErrNoCandidates
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	isl := 0
	var tokens []uint32
	if req != nil {
		isl = int(req.InputTokens)
		tokens = req.TokenIDs
	}
	d.keys = d.hasher.AppendKeys(d.keys[:0], tokens)
	match := d.env.Index.Match(d.keys)

	d.costs, d.newTokens = d.costs[:0], d.newTokens[:0]
	minCost := 0.0
	for i, e := range engines {
		w := d.worker(e.ID())
		overlap := match.Blocks(e.ID())
		newTokens := max(isl-overlap*d.bs, 0)
		newBlocks := 0
		for _, k := range d.keys {
			if w.blocks[k] == 0 {
				newBlocks++
			}
		}
		bs, decode := float64(d.bs), float64(len(w.blocks)+newBlocks)
		var cost float64
		if d.legacy {
			cost = DynamoOverlapScoreWeight*float64(w.prefillTokens+newTokens)/bs + decode
		} else {
			// The candidate row: active + (ISL − min(cached, ISL)) + cached tokens.
			raw := float64(w.prefillTokens+newTokens+overlap*d.bs) / bs
			cost = DynamoPrefillLoadScale*max(raw-DynamoOverlapScoreCredit*float64(overlap), 0) + decode
		}
		d.costs = append(d.costs, cost)
		d.newTokens = append(d.newTokens, newTokens)
		if i == 0 || cost < minCost {
			minCost = cost
		}
	}
	// Ties: a uniform draw; the legacy cost first prefers the smallest tree (blocks the worker
	// holds in the index).
	t := tieBreak{rand: d.env.Rand, best: -1}
	var stats kvindex.Stats
	ties, bestSize := 0, 0
	for i, c := range d.costs {
		if c != minCost {
			continue
		}
		if !d.legacy {
			t.offer(i, t.best < 0, t.best >= 0)
			continue
		}
		if ties++; ties == 2 {
			stats = d.env.Index.Stats()
			bestSize = treeSize(stats, engines[t.best].ID())
		}
		if ties == 1 {
			t.offer(i, true, false)
			continue
		}
		size := treeSize(stats, engines[i].ID())
		t.offer(i, size < bestSize, size == bestSize)
		if t.best == i {
			bestSize = size
		}
	}
	bestNew := d.newTokens[t.best]
	winner := engines[t.best]
	if err := d.admit(winner); err != nil {
		return policy.Pick{}, err
	}
	d.record(d.worker(winner.ID()), bestNew)
	return policy.Pick{Engine: winner, Reason: ReasonDynamoCost}, nil
}

func (d *Dynamo) worker(id state.EngineID) *dynamoWorker {
	w := d.workers[id]
	if w == nil {
		w = &dynamoWorker{blocks: map[uint64]int32{}}
		d.workers[id] = w
	}
	return w
}

// record adds the pick to its worker (add_request) and keeps it until bind or discard.
func (d *Dynamo) record(w *dynamoWorker, newTokens int) {
	if d.pending != nil {
		d.release(d.pending) // a pick the replay never bound: the group did not use it
	}
	var q *dynamoRequest
	if n := len(d.free); n > 0 {
		q, d.free = d.free[n-1], d.free[:n-1]
	} else {
		q = &dynamoRequest{}
	}
	q.worker, q.prefill = w, newTokens
	q.keys = append(q.keys[:0], d.keys...)
	w.prefillTokens += newTokens
	for _, k := range q.keys {
		w.blocks[k]++
	}
	d.pending = q
}

// release removes a request's remaining contribution from its worker and recycles it.
func (d *Dynamo) release(q *dynamoRequest) {
	w := q.worker
	w.prefillTokens -= q.prefill
	for _, k := range q.keys {
		if w.blocks[k]--; w.blocks[k] <= 0 {
			delete(w.blocks, k)
		}
	}
	*q = dynamoRequest{keys: q.keys[:0]}
	d.free = append(d.free, q)
}

func (d *Dynamo) bind(id int32) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.pending != nil {
		d.active[id] = d.pending
		d.pending = nil
	}
}

func (d *Dynamo) discard() {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.pending != nil {
		d.release(d.pending)
		d.pending = nil
	}
}

// firstToken drops the request's prefill tokens (mark_prefill_completed).
func (d *Dynamo) firstToken(id int32) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if q := d.active[id]; q != nil {
		q.worker.prefillTokens -= q.prefill
		q.prefill = 0
	}
}

// finished drops the request's blocks (free).
func (d *Dynamo) finished(id int32) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if q := d.active[id]; q != nil {
		delete(d.active, id)
		d.release(q)
	}
}

// treeSize returns the blocks engine id holds in the index, over every tier (Dynamo's
// OverlapScores.tree_sizes).
func treeSize(s kvindex.Stats, id state.EngineID) int {
	n := 0
	for _, r := range s.Ranks {
		if r.Engine == id {
			n += r.DeviceBlocks + r.HostBlocks + r.DiskBlocks + r.ExternalBlocks
		}
	}
	return n
}
