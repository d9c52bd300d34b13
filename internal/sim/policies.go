package sim

import (
	"time"

	"github.com/enginepick/enginepick/admission"
	"github.com/enginepick/enginepick/affinity"
	"github.com/enginepick/enginepick/internal/label"
	"github.com/enginepick/enginepick/kvindex"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

// PolicyEnv is what a PolicyFactory receives: the shared state handles of one policy run, all on
// the replay's virtual clock. A policy run is one replay of the whole trace under one policy name;
// its handles are fresh and shared by nothing else.
type PolicyEnv struct {
	// Load is the engine-reported load table the simulated engines report into every
	// Config.ReportInterval of virtual time (loadmon.WithClock on the virtual clock).
	Load *loadmon.Table
	// InFlight is the router-local in-flight counters; the run's Router acquires a guard per
	// selected engine and releases it when the request ends.
	InFlight *loadmon.InFlight
	// Index is the prefix index the simulated plain and prefill engines publish their KV events
	// to; its Hasher's block size is EngineModel.BlockTokens.
	Index *kvindex.Index
	// Rand returns a uniform integer in [0, n) from the run's seeded PCG source. The replay calls
	// policies from one goroutine, so it is not safe for concurrent use.
	Rand func(n int) int
	// Admission is the run's admission checker (Config.Admission, or admission.Limits{}).
	Admission admission.Checker
	// Now is the virtual clock.
	Now func() time.Time
	// Affinity is the run's affinity store (an affinity.MemoryStore on the virtual clock), one
	// per policy run and shared by every router replica of the run, as replicas share one Redis
	// store in production.
	Affinity affinity.Store

	// run is the replay behind the handles, for the oracle baselines that read the simulated
	// engines (Oracle); nil outside a replay.
	run *run
}

// PolicyConfig returns the policy.Config every built-in policy takes: Load, InFlight, Admission and
// Rand from env.
func (env PolicyEnv) PolicyConfig() policy.Config {
	return policy.Config{Load: env.Load, InFlight: env.InFlight, Admission: env.Admission, Rand: env.Rand}
}

// PolicyFactory builds the policy of one engine group for one policy run: stage is StagePlain for a
// plain fleet, StagePrefill for the prefill group of a PD fleet (the decode group always uses
// power_of_two). It is called once per group and run, on the replay's goroutine for that run. An
// error aborts the replay.
type PolicyFactory func(env PolicyEnv, stage state.Stage) (policy.Policy, error)

// Policy names of the replay: the configuration names of the library's policies.
const (
	NameRoundRobin = label.RoundRobin
	NameRandom     = label.Random
	NamePowerOfTwo = label.PowerOfTwo
	NameLeastLoad  = label.LeastLoad
	NameCacheAware = label.CacheAware
)

// DefaultPolicyNames returns the policies a replay compares when Config.Policies is nil, in
// report order: round_robin, random, power_of_two, least_load, cache_aware. The slice is new on
// every call.
func DefaultPolicyNames() []string {
	return []string{NameRoundRobin, NameRandom, NamePowerOfTwo, NameLeastLoad, NameCacheAware}
}

// DefaultPolicies returns a new name → factory table with the library's policies: round_robin
// (policy.NewRoundRobin), random (policy.NewRandom), power_of_two (policy.NewPowerOfN, N = 2),
// least_load (policy.NewLeastLoad), cache_aware (policy.NewCacheAware over a
// kvindex.LocalSource of the run's index, with the policy's default options), and the peer
// baselines dynamo (NewDynamo), llmd (NewLLMD), smg (NewSMG), dynamo_legacy (NewDynamoLegacy),
// llmd_legacy (NewLLMDLegacy), sglang_legacy (NewSGLangLegacy) and llmd_lora (NewLLMDLoRA), the oracle
// baselines oracle and oracle_work (NewOracle with work weight 0 and 1; they read the simulated
// engines, so they only run inside a replay), and the
// affinity policies session_aware and sticky (over PolicyEnv.Affinity) and sticky_rendezvous (see
// Request.SessionKey for their keys). The caller owns the map and may add or replace entries.
func DefaultPolicies() map[string]PolicyFactory {
	return map[string]PolicyFactory{
		NameRoundRobin: func(env PolicyEnv, _ state.Stage) (policy.Policy, error) {
			return policy.NewRoundRobin(env.PolicyConfig())
		},
		NameRandom: func(env PolicyEnv, _ state.Stage) (policy.Policy, error) {
			return policy.NewRandom(env.PolicyConfig())
		},
		NamePowerOfTwo: powerOfTwo,
		NameLeastLoad:  leastLoad,
		NameCacheAware: cacheAware,
		NameDynamo: func(env PolicyEnv, _ state.Stage) (policy.Policy, error) {
			return NewDynamo(env)
		},
		NameLLMD: func(env PolicyEnv, _ state.Stage) (policy.Policy, error) {
			return NewLLMD(env)
		},
		NameSMG: func(env PolicyEnv, _ state.Stage) (policy.Policy, error) {
			return NewSMG(env)
		},
		NameDynamoLegacy: func(env PolicyEnv, _ state.Stage) (policy.Policy, error) {
			return NewDynamoLegacy(env)
		},
		NameLLMDLegacy: func(env PolicyEnv, _ state.Stage) (policy.Policy, error) {
			return NewLLMDLegacy(env)
		},
		NameSGLangLegacy: func(env PolicyEnv, _ state.Stage) (policy.Policy, error) {
			return NewSGLangLegacy(env)
		},
		NameLLMDLoRA: func(env PolicyEnv, _ state.Stage) (policy.Policy, error) {
			return NewLLMDLoRA(env)
		},
		NameOracle: func(env PolicyEnv, _ state.Stage) (policy.Policy, error) {
			return NewOracle(env, NameOracle, 0)
		},
		NameOracleWork: func(env PolicyEnv, _ state.Stage) (policy.Policy, error) {
			return NewOracle(env, NameOracleWork, 1)
		},
		NameSessionAware:     sessionAware,
		NameSticky:           sticky,
		NameStickyRendezvous: stickyRendezvous,
	}
}

// cacheAware builds policy.NewCacheAware over a kvindex.LocalSource of the run's index, with the
// policy's default options.
func cacheAware(env PolicyEnv, _ state.Stage) (policy.Policy, error) {
	src, err := kvindex.NewLocalSource(env.Index)
	if err != nil {
		return nil, err
	}
	return policy.NewCacheAware(env.PolicyConfig(), policy.CacheAwareOptions{Source: src})
}

func powerOfTwo(env PolicyEnv, _ state.Stage) (policy.Policy, error) {
	return policy.NewPowerOfN(env.PolicyConfig(), 2)
}

func leastLoad(env PolicyEnv, _ state.Stage) (policy.Policy, error) {
	return policy.NewLeastLoad(env.PolicyConfig())
}
