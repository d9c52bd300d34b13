package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"time"

	"github.com/enginepick/enginepick/internal/sim"
	"github.com/enginepick/enginepick/state"
)

// defaultSweepLimit is -limit under -sweep when -limit is not given: every probe replays the
// first 3,000 requests (about a quarter of the embedded trace), so that a sweep of the eight
// policies (about 8 replays each) runs in a minute or two on two cores. -limit 0 sweeps the
// whole trace.
const defaultSweepLimit = 3000

// scenarioFlags are the replay's scenario flags, kept apart from the basic ones: a shared system
// prompt in front of every request (-system-prompt), router replicas (-routers, -share,
// -share-delay), arrivals spread within each second (-spread-arrivals), the engines'
// prefill time model (-prefill-model) and scheduling (-engine-priority), what their load reports
// carry (-reports) and a generated
// workload instead of a trace (-workload).
type scenarioFlags struct {
	systemPrompt *int
	reports      *string
	routers      *int
	share        *bool
	shareDelay   *time.Duration
	spread       *bool
	prefillModel *string
	priority     *bool
	sweep        *bool
	slo          *time.Duration
	workload     *string
	workloadSeed *uint64
}

// addScenarioFlags defines the scenario flags on fs.
func addScenarioFlags(fs *flag.FlagSet) *scenarioFlags {
	return &scenarioFlags{
		systemPrompt: fs.Int("system-prompt", 0, "prepend one shared prompt of N tokens to every request (0: none)"),
		routers: fs.Int("routers", 1, fmt.Sprintf("N independent router replicas (at most %d), requests round-robin over them, "+
			"every engine's events and load reports delivered to all", sim.MaxRouters)),
		share: fs.Bool("share", false, "the -routers replicas share their dispatches and route-time placements, "+
			"as replicas with a replicas block do over Redis"),
		shareDelay: fs.Duration("share-delay", sim.DefaultShareDelay, "how long a shared decision takes to reach the other replicas (-share)"),
		spread: fs.Bool("spread-arrivals", false, "spread each second's arrivals uniformly over that second, in their order, "+
			"drawn from -seed: the Mooncake trace's timestamps are whole seconds, so without it each second's requests arrive at one instant"),
		reports: fs.String("reports", string(sim.ReportsNative), fmt.Sprintf(
			"what the engines' load reports carry: %q (as SGLang: running, waiting, KV and the native fields) or %q (as vLLM's /metrics: running, waiting and KV only)",
			sim.ReportsNative, sim.ReportsBasic)),
		prefillModel: fs.String("prefill-model", string(sim.PrefillAttention), fmt.Sprintf(
			"prefill time model: %q (attention over the whole context, cached tokens included) or %q (one rate for uncached tokens, the earlier model)",
			sim.PrefillAttention, sim.PrefillFlat)),
		priority: fs.Bool("engine-priority", false, "the engines schedule waiting requests by priority, as vLLM's --scheduling-policy priority, "+
			"the router forwarding each request's priority negated (vLLM serves lower values first; see sim.EngineModel.PriorityScheduling)"),
		sweep: fs.Bool("sweep", false, fmt.Sprintf("instead of one replay, find per policy the highest -speed with TTFT p99 <= -slo, "+
			"by bisection to 5 %% (each probe replays -limit requests, default %d under -sweep)", defaultSweepLimit)),
		slo: fs.Duration("slo", sim.DefaultSweepSLO, "TTFT p99 target of -sweep"),
		workload: fs.String("workload", "", fmt.Sprintf("replay a generated workload instead of a trace: %s, %s, %s or %s, "+
			"optionally with parameters, e.g. %s:conversations=500,rate=5 (see sim.ParseWorkload); -speed then defaults to 1",
			sim.WorkloadChats, sim.WorkloadPrefixGroups, sim.WorkloadTenants, sim.WorkloadLoRA, sim.WorkloadChats)),
		workloadSeed: fs.Uint64("workload-seed", 0, "random seed of -workload (default: -seed)"),
	}
}

// apply sets the scenario fields of cfg, and its trace when -workload asks for a generated one. A
// bad value is a command-line mistake (usage error).
func (s *scenarioFlags) apply(fs *flag.FlagSet, cfg *sim.Config) error {
	if *s.systemPrompt < 0 || *s.systemPrompt > sim.MaxTraceTokens {
		return usage(fmt.Errorf("-system-prompt %d: must be in [0, %d]", *s.systemPrompt, sim.MaxTraceTokens))
	}
	if *s.routers < 1 || *s.routers > sim.MaxRouters {
		return usage(fmt.Errorf("-routers %d: must be in [1, %d]", *s.routers, sim.MaxRouters))
	}
	switch pm := sim.PrefillModel(*s.prefillModel); pm {
	case sim.PrefillAttention, sim.PrefillFlat:
		cfg.Model.PrefillModel = pm
	default:
		return usage(fmt.Errorf("-prefill-model %q: must be %q or %q", *s.prefillModel, sim.PrefillAttention, sim.PrefillFlat))
	}
	switch r := sim.LoadReports(*s.reports); r {
	case sim.ReportsNative, sim.ReportsBasic:
		cfg.Reports = r
	default:
		return usage(fmt.Errorf("-reports %q: must be %q or %q", *s.reports, sim.ReportsNative, sim.ReportsBasic))
	}
	if *s.shareDelay <= 0 {
		return usage(fmt.Errorf("-share-delay %v: must be > 0", *s.shareDelay))
	}
	if *s.slo <= 0 {
		return usage(fmt.Errorf("-slo %v: must be > 0", *s.slo))
	}
	cfg.SystemPromptTokens = *s.systemPrompt
	cfg.Model.PriorityScheduling = *s.priority
	cfg.Routers = *s.routers
	cfg.ShareRouters, cfg.ShareDelay = *s.share, *s.shareDelay
	cfg.SpreadArrivals = *s.spread
	return s.generate(fs, cfg)
}

// generate sets cfg.Trace to the -workload trace, if one is asked for, with -speed 1 unless given
// and, without -config (whose kv.block_tokens decides), sim.WorkloadBlockTokens-token KV blocks. A bad spec, a spec
// with -trace and a -workload-seed without -workload are command-line mistakes.
func (s *scenarioFlags) generate(fs *flag.FlagSet, cfg *sim.Config) error {
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	if *s.workload == "" {
		if set["workload-seed"] {
			return usage(errors.New("-workload-seed needs -workload"))
		}
		return nil
	}
	if set["trace"] {
		return usage(errors.New("-trace and -workload are exclusive: replay one or the other"))
	}
	w, err := sim.ParseWorkload(*s.workload)
	if err != nil {
		return usage(err)
	}
	seed := cfg.Seed
	if set["workload-seed"] {
		seed = *s.workloadSeed
	}
	if cfg.Trace, err = w.Generate(seed); err != nil {
		return usage(err)
	}
	if !set["speed"] {
		cfg.Speed = 1
	}
	if cfg.Routing == nil {
		cfg.Model.BlockTokens = sim.WorkloadBlockTokens
	}
	return nil
}

// runSweep runs the capacity sweep of cfg's policies and writes its table (or JSON) to stdout.
// -limit defaults to defaultSweepLimit unless given; -plot does not apply.
func (s *scenarioFlags) runSweep(ctx context.Context, fs *flag.FlagSet, cfg sim.Config, asJSON bool, stdout, stderr io.Writer) error {
	limitSet, plotSet := false, false
	fs.Visit(func(f *flag.Flag) {
		limitSet = limitSet || f.Name == "limit"
		plotSet = plotSet || f.Name == "plot"
	})
	if plotSet {
		return usage(errors.New("-plot does not apply to -sweep"))
	}
	if !limitSet {
		cfg.Limit = defaultSweepLimit
	}
	start := time.Now()
	rep, err := sim.Sweep(ctx, sim.SweepConfig{Config: cfg, SLO: *s.slo})
	if errors.Is(err, state.ErrInvalidConfiguration) {
		return usage(err)
	}
	if err != nil {
		return err
	}
	probes := 0
	for _, r := range rep.Results {
		probes += r.Probes
	}
	fmt.Fprintf(stderr, "swept %d policies over %d requests in %d replays, %.1f s\n", len(rep.Results), rep.Requests, probes,
		time.Since(start).Seconds())
	if asJSON {
		return rep.WriteJSON(stdout)
	}
	return rep.WriteTable(stdout)
}
