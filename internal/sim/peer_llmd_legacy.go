package sim

import (
	"context"
	"slices"
	"sync"

	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

// Defaults of the legacy llm-d baseline (LLMDLegacy).
const (
	// LLMDQueueWeight, LLMDKVCacheWeight and LLMDPrefixWeight are the weights of the queue,
	// KV-cache-utilization and prefix-cache scorers in the default scheduling profile: 2, 2 and 3
	// in loadDefaultConfig of llm-d/llm-d-inference-scheduler `pkg/epp/config/loader/defaults.go`.
	LLMDQueueWeight   = 2.0
	LLMDKVCacheWeight = 2.0
	LLMDPrefixWeight  = 3.0

	// LLMDMaxPrefixBlocks is how many leading blocks of a prompt the legacy prefix index hashes,
	// records and matches: defaultMaxPrefixBlocks 256 in llm-d/llm-d-inference-scheduler
	// `pkg/epp/framework/plugins/requestcontrol/dataproducer/approximateprefix/types.go`.
	LLMDMaxPrefixBlocks = 256

	// LLMDLoRAWeight is the LoRA affinity scorer's weight in NewLLMDLoRA: the default profile
	// lists no LoRA scorer, and a scorer a profile lists without a weight gets DefaultScorerWeight,
	// 1 (kubernetes-sigs/gateway-api-inference-extension `pkg/epp/config/loader/defaults.go`,
	// whose default profile weighs queue 2, KV cache 2 and prefix 3 as LLMDLegacy does).
	LLMDLoRAWeight = 1.0
)

// LLMDLegacy is the llm-d inference scheduler's earlier default scheduling profile, as a replay
// baseline (name "llmd_legacy"; the llm-d router's current default is LLMD).
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
// With a basic load report (running and waiting requests only) the queue score works as above
// and usage reads 0 (kv = 1 everywhere), as a metrics struct without the KV-usage gauge does in
// llm-d; the prefix index keeps LLMDDefaultLRUCapacity blocks per endpoint, since no capacity is
// reported.
//
// LLMDLegacy implements policy.Policy and is safe for concurrent use.
type LLMDLegacy struct {
	peerBase

	mu     sync.Mutex
	index  llmdPrefixIndex
	scores []float64
	lora   float64 // the LoRA affinity scorer's weight; 0 without it
}

var _ policy.Policy = (*LLMDLegacy)(nil)

// NewLLMDLegacy returns the legacy llm-d baseline over env: env.Load supplies the engine metrics,
// env.Index's Hasher the block keys, env.Rand breaks ties and env.Admission checks the winner. A
// PolicyEnv without Load, InFlight, Index or Rand is an error wrapping
// state.ErrInvalidConfiguration.
func NewLLMDLegacy(env PolicyEnv) (*LLMDLegacy, error) {
	base, err := newPeerBase(NameLLMDLegacy, env)
	if err != nil {
		return nil, err
	}
	return &LLMDLegacy{peerBase: base, index: newLLMDPrefixIndex(env.Index.Hasher(), LLMDMaxPrefixBlocks, false)}, nil
}

// NewLLMDLoRA returns llm-d's scorer profile for LoRA adapters as a replay baseline (name
// "llmd_lora"): LLMDLegacy's queue, KV-cache and prefix scorers at their default weights (2, 2, 3)
// and the LoRA affinity scorer at LLMDLoRAWeight, as a profile that adds lora-affinity-scorer to
// the default one without a weight configures it. The scorer
// (kubernetes-sigs/gateway-api-inference-extension
// `pkg/epp/framework/plugins/scheduling/scorer/loraaffinity/lora_affinity.go`) reads each
// engine's vllm:lora_requests_info (loadmon.Report.LoRA: active = the running requests' adapters,
// waiting = the waiting requests', max = the slots) and scores the request's target model:
//   - 1.0 when it is active;
//   - else 0.8 when active + waiting adapters (counted apart, an adapter in both twice) are fewer
//     than the slots;
//   - else 0.6 when it is waiting;
//   - else 0.
//
// The target of a base-model request is the base model, never an adapter, so it scores 0.8 on an
// engine with a free slot and 0 elsewhere, as upstream; an engine that reports no adapters (no
// LoRA report, whose slots count as 0) scores 0, so on a trace without adapters NewLLMDLoRA picks
// as NewLLMDLegacy. Errors as NewLLMDLegacy.
func NewLLMDLoRA(env PolicyEnv) (*LLMDLegacy, error) {
	l, err := NewLLMDLegacy(env)
	if err != nil {
		return nil, err
	}
	l.name, l.lora = NameLLMDLoRA, LLMDLoRAWeight
	return l, nil
}

// llmdLoRAScore is the LoRA affinity scorer's score of an engine reporting l for a request whose
// target is adapter ("" for the base model; see NewLLMDLoRA).
func llmdLoRAScore(l *loadmon.LoRALoad, adapter string) float64 {
	if l == nil {
		return 0
	}
	active := adapter != "" && slices.Contains(l.Running, adapter)
	waiting := adapter != "" && slices.Contains(l.Waiting, adapter)
	switch {
	case active:
		return 1
	case len(l.Running)+len(l.Waiting) < l.MaxAdapters:
		return 0.8
	case waiting:
		return 0.6
	}
	return 0
}

// Pick implements policy.Policy. No candidates → policy.ErrNoCandidates. A request without
// TokenIDs hashes no block: every prefix score is 0.
func (l *LLMDLegacy) Pick(_ context.Context, engines []state.Engine, req *policy.Request) (policy.Pick, error) {
	if len(engines) == 0 {
		return policy.Pick{}, policy.ErrNoCandidates
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	var tokens []uint32
	adapter := ""
	if req != nil {
		tokens, adapter = req.TokenIDs, req.Adapter
	}
	x := &l.index
	x.match(tokens)

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
		usage, lora := 0.0, 0.0
		if ld, ok := snap.Load(e.ID()); ok {
			q = ld.WaitingRequests
			if f, ok := ld.KVUsageFraction(); ok {
				usage = f
			}
			if l.lora > 0 {
				lora = llmdLoRAScore(ld.LoRA, adapter)
			}
		}
		queue := 1.0
		if maxQ > minQ {
			queue = float64(maxQ-q) / float64(maxQ-minQ)
		}
		prefix := x.score(e.ID())
		s := LLMDQueueWeight*queue + LLMDKVCacheWeight*(1-usage) + LLMDPrefixWeight*prefix + l.lora*lora
		t.offer(i, t.best < 0 || s > best, s == best)
		if t.best == i {
			best = s
		}
	}
	winner := engines[t.best]
	if err := l.admit(winner); err != nil {
		return policy.Pick{}, err
	}
	x.record(winner.ID(), snap)
	return policy.Pick{Engine: winner, Reason: ReasonLLMDMaxScore}, nil
}
