package sim

import (
	"fmt"

	"github.com/enginepick/enginepick/admission"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

// Names of the peer baselines: independent Go implementations of the engine-selection rule of
// public routers at their defaults, so that a replay can measure enginepick's policies against
// them on the same trace, fleet and seed. Each peer has its current defaults under its plain name
// and the rule of earlier releases under a _legacy name. They are measuring sticks, not
// production policies: they live in sim, not in policy, and the root Config cannot name them.
//
// Each baseline's doc comment cites the upstream files it follows; they were read at these
// revisions (a file without one was read at a revision not recorded):
//   - ai-dynamo/dynamo `lib/kv-router/src/scheduling/selector/default.rs` and
//     `lib/kv-router/src/scheduling/selector/mod.rs`: 07a6c9ce3bb096cfaf353fe69ee578e105c6a512
//   - ai-dynamo/dynamo `docs/components/router/router-concepts.md`:
//     03037af0f6eacf8114806cfa10dd823d120b3ce8
//   - ai-dynamo/dynamo `lib/llm/src/kv_router/scheduler.rs`: db19bd2a659d4cb04998fb4101cd0dbfbbeba9d4
//   - ai-dynamo/dynamo `lib/llm/src/kv_router/sequence.rs`: 581ee33e434f3f99b84f6ea99fcf0a3fda26a685
//   - llm-d/llm-d `guides/optimized-baseline/router/optimized-baseline.values.yaml`:
//     0a3b0c939d50576e91adddf8add79441c29957d1
//   - llm-d/llm-d-router `pkg/epp/framework/plugins/scheduling/filter/prefixcacheaffinity/plugin.go`:
//     066c20ea107e538797d3256ab0803a4f50625975
//   - llm-d/llm-d-router `pkg/epp/framework/plugins/requestcontrol/dataproducer/inflightload/producer.go`:
//     003369e0283f2ffc98ff0084be814289d2354a1a
//   - llm-d/llm-d-router `pkg/epp/framework/plugins/requestcontrol/dataproducer/approximateprefix/hashing.go`:
//     257db69a160e2575f30a9f49df66792177fc6054
//   - llm-d/llm-d-router `pkg/epp/framework/plugins/requestcontrol/dataproducer/approximateprefix/types.go`:
//     09a534fc42ff469ef78094ad116018672f96e335
//   - smg-project/smg `model_gateway/src/policies/cache_aware.rs` and `model_gateway/src/main.rs`:
//     56ad201813a222df0aca402ed6163ba737009d86
//   - smg-project/smg `crates/kv_index/src/common.rs`: 23b2e5b77c42f6b0b22b4224c9ac9a61ea3d3d6e
//   - llm-d/llm-d-inference-scheduler `pkg/epp/config/loader/defaults.go`:
//     159e739b98ed45c3974bd00a951edbf2778e3322
//   - llm-d/llm-d-inference-scheduler `pkg/epp/framework/plugins/scheduling/scorer/queuedepth/README.md`
//     and `pkg/epp/framework/plugins/scheduling/scorer/kvcacheutilization/README.md`:
//     12cb9eeaddd684b0cfa87553cdaa05333c2cef0e
//   - llm-d/llm-d-inference-scheduler `pkg/epp/framework/plugins/requestcontrol/dataproducer/approximateprefix/plugin.go`:
//     011f14dd8886215e97f6b2aa8d265e58f1e7c2e6
//   - llm-d/llm-d-inference-scheduler `pkg/epp/framework/plugins/requestcontrol/dataproducer/approximateprefix/indexer.go`:
//     1bd9b59efcb04787512925a6211833a142c2679b
//   - llm-d/llm-d-inference-scheduler `pkg/epp/framework/plugins/requestcontrol/dataproducer/approximateprefix/types.go`:
//     0a4fd844b18f40bcb2e3dba337e07c7b35153a71
//   - sgl-project/sglang `sgl-router/src/policies/cache_aware.rs`: 026f853ba7ae08a457a2e127b85a26256a29e300
//   - sgl-project/sglang `sgl-router/src/policies/tree.rs`: 4d40eec0266be06d0e65b919457691cab9e51547
//   - sgl-project/sglang `sgl-router/py_src/sglang_router/router_args.py`:
//     083d601378d0baaef6191e7f2d40fb70d06518af
//   - kubernetes-sigs/gateway-api-inference-extension
//     `pkg/epp/framework/plugins/scheduling/scorer/loraaffinity/lora_affinity.go`:
//     33173e4c83e87fece15b50f3ded861a3c0edb0ea
//   - kubernetes-sigs/gateway-api-inference-extension `pkg/epp/config/loader/defaults.go`:
//     0c8fd519270ebd8422e0bbbfc03ac4d91fc2f1b0
const (
	// NameDynamo is NVIDIA Dynamo's KV router with its current default cost (see Dynamo).
	NameDynamo = "dynamo"
	// NameLLMD is the llm-d router's current default profile, "sticky until saturated" (see LLMD).
	NameLLMD = "llmd"
	// NameSMG is the Shepherd Model Gateway's current cache_aware policy (see SMG).
	NameSMG = "smg"
	// NameDynamoLegacy is Dynamo's earlier default cost and tie-break (see Dynamo).
	NameDynamoLegacy = "dynamo_legacy"
	// NameLLMDLegacy is the llm-d inference scheduler's earlier default scorer profile (see
	// LLMDLegacy).
	NameLLMDLegacy = "llmd_legacy"
	// NameSGLangLegacy is the SGLang router's legacy cache_aware policy (see SGLangLegacy).
	NameSGLangLegacy = "sglang_legacy"
	// NameLLMDLoRA is llm-d's scorer profile for LoRA adapters: LLMDLegacy's scorers and the
	// LoRA affinity scorer (see NewLLMDLoRA). It is not in PeerPolicyNames: it runs when listed.
	NameLLMDLoRA = "llmd_lora"
)

// Reason labels of the peer baselines' picks (policy.Pick.Reason). SGLangLegacy and SMG reuse
// cache_candidate, no_cache_candidate and least_load for their
// branches.
const (
	// ReasonDynamoCost labels a Dynamo pick: the lowest cost.
	ReasonDynamoCost = "dynamo_cost"
	// ReasonLLMDMaxScore labels an LLMD or LLMDLegacy pick: the highest weighted score over every
	// candidate.
	ReasonLLMDMaxScore = "llmd_max_score"
	// ReasonLLMDSticky labels an LLMD pick made within the sticky set: the candidates the prefix
	// affinity filter kept.
	ReasonLLMDSticky = "llmd_sticky"
	// ReasonSMGSpill labels an SMG pick that left a matched worker for the least-loaded one
	// because the matched worker's load cleared both spill margins.
	ReasonSMGSpill = "smg_spill"
)

// PeerPolicyNames returns the peer baselines' names in report order: the current defaults dynamo,
// llmd, smg, then the earlier rules dynamo_legacy, llmd_legacy, sglang_legacy. The slice is new on
// every call. DefaultPolicies has a factory for each; they are not in DefaultPolicyNames, so a
// replay runs them only when Config.Policies names them.
func PeerPolicyNames() []string {
	return []string{NameDynamo, NameLLMD, NameSMG, NameDynamoLegacy, NameLLMDLegacy, NameSGLangLegacy}
}

// requestTracker is implemented by baselines that keep per-request bookkeeping of their own, as
// Dynamo's ActiveSequences and llm-d's in-flight load producer do: they must learn when a request
// they routed produces its first token and when it ends. The replay calls these methods on its own goroutine, one
// request at a time: after every Router.Select it calls bind with the request's position when the
// selection succeeded and discard when it failed, so a tracker pairs its most recent pick with the
// request; firstToken and finished follow for every bound request. A pick that the group did not
// end up using (another bucket's engine was chosen) is discarded too.
type requestTracker interface {
	bind(id int32)
	discard()
	firstToken(id int32)
	finished(id int32)
}

// peerBase holds what every peer baseline reads: the run's state handles and random source.
type peerBase struct {
	name string
	env  PolicyEnv
}

func newPeerBase(name string, env PolicyEnv) (peerBase, error) {
	switch {
	case env.Load == nil || env.InFlight == nil || env.Index == nil || env.Rand == nil:
		return peerBase{}, fmt.Errorf("sim: %s: PolicyEnv needs Load, InFlight, Index and Rand: %w", name, state.ErrInvalidConfiguration)
	}
	if env.Admission == nil {
		env.Admission = admission.Limits{}
	}
	return peerBase{name: name, env: env}, nil
}

// admit runs the admission checker once on the engine a baseline chose, as PowerOfN does for its
// winner (none of the peers has a per-engine admission cap of its own at its defaults;
// Config.Admission applies to them as to every replayed policy). It returns nil, a *policy.AdmissionRejectedError
// or the checker's error.
func (b *peerBase) admit(e state.Engine) error {
	o := loadmon.Observe(b.env.Load.Snapshot(), b.env.InFlight, e.ID())
	v, err := b.env.Admission.Check(e, admission.Observe(o))
	if err != nil {
		return fmt.Errorf("sim: %s: admission check of %q: %w", b.name, e.ID(), err)
	}
	if !v.Admit {
		return &policy.AdmissionRejectedError{Engine: e, Limit: v.Limit, Observed: v.Observed, Cap: v.Cap}
	}
	return nil
}

// tieBreak keeps a uniformly random one of the candidates that tie for the best value, in one
// pass without allocating (reservoir sampling over the ties).
type tieBreak struct {
	rand func(int) int
	best int // index of the kept candidate, -1 before the first offer
	ties int
}

// offer records candidate i: better displaces the kept one; equal joins the ties and replaces
// the kept one with probability 1/ties.
func (t *tieBreak) offer(i int, better, equal bool) {
	switch {
	case t.best < 0 || better:
		t.best, t.ties = i, 1
	case equal:
		t.ties++
		if t.rand(t.ties) == 0 {
			t.best = i
		}
	}
}

func errNoClock(name string) error {
	return fmt.Errorf("sim: %s: PolicyEnv.Now is nil: %w", name, state.ErrInvalidConfiguration)
}
