package sim

import (
	"context"
	"slices"
	"sync"
	"time"

	"github.com/enginepick/enginepick/internal/label"
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

// Defaults of the SMG baseline: the gateway's launch defaults for cache_aware in smg-project/smg
// `model_gateway/src/main.rs` (cache_threshold 0.3, balance_abs_threshold 64,
// balance_rel_threshold 1.5, eviction_interval 120 s, max_tree_size 2^26 for the whole tree;
// balance_token_usage_threshold and overload_token_usage_threshold 1.0, which disables both;
// overlap_decay 0, selection_temperature 0, cache_index tree, worker overload protection off) and
// the match's tenant cap in smg-project/smg `crates/kv_index/src/common.rs`
// (MATCHED_TENANTS_CAP 8). CacheAwareConfig::default in smg-project/smg
// `model_gateway/src/policies/mod.rs` differs (0.5, 32, 1.1, 30 s, 10,000); the gateway as
// launched uses the values here.
const (
	SMGCacheThreshold      = 0.3
	SMGBalanceAbsThreshold = 64
	SMGBalanceRelThreshold = 1.5
	SMGEvictionInterval    = 120 * time.Second
	SMGMaxTreeSizeTokens   = 1 << 26
	SMGMatchedTenantsCap   = 8
)

// SMG is the current cache_aware policy of the Shepherd Model Gateway (formerly the SGLang model
// gateway), as a replay baseline (name "smg"; the SGLang router's earlier cache_aware is
// SGLangLegacy). Sources: smg-project/smg `model_gateway/src/policies/cache_aware.rs`
// (CacheAwarePolicy.select_worker, select_worker_with_tokens, select_matched_candidate,
// argmax_with_random_ties, gate_selected_candidate, is_kv_imbalanced) and smg-project/smg
// `crates/kv_index/src/token_tree.rs` (the token tree: match_and_insert_with,
// PrefixMatchResult.matched_tenants, evict_tenant_by_size). Defaults as SMGCacheThreshold and the
// constants beside it.
//
// The replay's requests carry token IDs, so this is the token-tree path (a gRPC worker without
// KV events). Per request, with load(w) the router's in-flight requests to w (the run's
// loadmon.InFlight, which the Router increments at dispatch and decrements when the request ends,
// as the gateway's load guard does), processed(w) the requests this policy sent to w, and mean the
// candidates' mean load:
//  1. min = the candidate with the least (load, processed, position).
//  2. The prompt is matched in the router's own tree of the prompts it routed to each worker. If
//     matched ÷ prompt tokens > SMGCacheThreshold (in float32, as the gateway computes it), the
//     holders are up to SMGMatchedTenantsCap workers recorded at the deepest matched node (in the
//     node's own order); among those that are candidates the least loaded wins, exact ties
//     uniformly at random (label cache_candidate). If its load exceeds both
//     SMGBalanceRelThreshold · mean and mean + SMGBalanceAbsThreshold, the request spills to min
//     instead (ReasonSMGSpill). If no holder is a candidate, the first candidate takes it and the
//     tree is not updated.
//  3. Otherwise min takes it (no_cache_candidate).
//  4. The prompt is inserted into the tree for the chosen worker, and its processed count goes up.
//
// Every SMGEvictionInterval of virtual time, while the whole tree holds more than
// SMGMaxTreeSizeTokens tokens, least-recently-used leaves are removed across all workers.
//
// The fleet-wide KV-usage triggers (spread and ceiling of the backends' reported token usage) are
// disabled at their defaults, and with them the gateway polls no backend load at all: SMG reads
// none of the fleet's load reports. With the triggers enabled, a worker without a usage figure
// (a basic report, running and waiting requests only) would be left out of the usage bounds, as
// the gateway leaves out a worker without a load entry.
//
// Deviations, as for SGLangLegacy: the tree holds the prompt's full KV blocks (the run's
// kvindex.Hasher keys, 512 tokens on the Mooncake traces, which record reuse in whole 512-token
// blocks anyway) instead of 16-token pages, and where the gateway takes tenants in a DashMap's
// iteration order this baseline uses a per-node pseudo-random order drawn from the run's seed. The
// engine's admission checker (Config.Admission) runs once on the chosen worker.
//
// SMG implements policy.Policy and is safe for concurrent use.
type SMG struct {
	peerBase

	mu        sync.Mutex
	tree      sglangTree
	processed map[state.EngineID]uint64
	holders   []state.EngineID
}

var _ policy.Policy = (*SMG)(nil)

// NewSMG returns the SMG baseline over env: env.InFlight supplies the loads, env.Index's Hasher
// the block keys, env.Now the clock of the tree's access times and eviction, env.Rand the seed of
// its tenant orders and the tie draws, env.Admission checks the chosen worker. A PolicyEnv without
// Load, InFlight, Index, Rand or Now is an error wrapping state.ErrInvalidConfiguration.
func NewSMG(env PolicyEnv) (*SMG, error) {
	base, err := newPeerBase(NameSMG, env)
	if err != nil {
		return nil, err
	}
	if env.Now == nil {
		return nil, errNoClock(NameSMG)
	}
	s := &SMG{peerBase: base, processed: map[state.EngineID]uint64{}}
	s.tree.init(env, SMGMaxTreeSizeTokens, SMGEvictionInterval, true)
	return s, nil
}

// Pick implements policy.Policy. No candidates → policy.ErrNoCandidates. A request without
// TokenIDs matches nothing and goes to the least-loaded candidate.
func (s *SMG) Pick(_ context.Context, engines []state.Engine, req *policy.Request) (policy.Pick, error) {
	if len(engines) == 0 {
		return policy.Pick{}, policy.ErrNoCandidates
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.env.Now()
	t := &s.tree
	t.prepare(now, engines, req)

	minI, sum := 0, uint64(0)
	var minLoad, minProc uint64
	for i, e := range engines {
		l, p := s.env.InFlight.Count(e.ID()), s.processed[e.ID()]
		if i == 0 || l < minLoad || (l == minLoad && p < minProc) {
			minI, minLoad, minProc = i, l, p
		}
		sum += l
	}
	mean := float64(sum) / float64(len(engines))

	chosen, reason, insert := minI, label.ReasonNoCacheCandidate, true
	node, depth := t.match()
	rate := float32(0)
	if n := t.promptTokens; n > 0 {
		rate = float32(depth*t.bs) / float32(n)
	}
	if rate > SMGCacheThreshold {
		s.holders = t.firstTenants(s.holders[:0], node, SMGMatchedTenantsCap)
		tb := tieBreak{rand: s.env.Rand, best: -1}
		var best uint64
		for i, e := range engines {
			if !slices.Contains(s.holders, e.ID()) {
				continue
			}
			l := s.env.InFlight.Count(e.ID())
			tb.offer(i, tb.best < 0 || l < best, l == best)
			if tb.best == i {
				best = l
			}
		}
		switch {
		case tb.best < 0: // no holder is a candidate: the first healthy worker, tree untouched
			chosen, insert = 0, false
		case float64(best) > mean*SMGBalanceRelThreshold && float64(best) > mean+SMGBalanceAbsThreshold:
			reason = ReasonSMGSpill
		default:
			chosen, reason = tb.best, label.ReasonCacheCandidate
		}
	}
	winner := engines[chosen]
	if err := s.admit(winner); err != nil {
		return policy.Pick{}, err
	}
	if insert {
		t.insert(winner.ID(), now)
		s.processed[winner.ID()]++
	}
	return policy.Pick{Engine: winner, Reason: reason}, nil
}
