package main

import (
	"context"
	"fmt"
	"net/http"
	"slices"
	"sync"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/enginepick/enginepick"
	"github.com/enginepick/enginepick/admission"
	"github.com/enginepick/enginepick/bucket"
	"github.com/enginepick/enginepick/examples/gateway/internal/gw"
	"github.com/enginepick/enginepick/kvindex"
	"github.com/enginepick/enginepick/kvindex/kvevents"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/loadmon/loadsource"
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

// gateway is everything build wires together.
type gateway struct {
	registry *gw.Registry
	table    *loadmon.Table
	inflight *loadmon.InFlight
	index    *kvindex.Index // nil unless a cache-aware policy is configured
	router   *enginepick.Router
	server   *gw.Server
	handler  http.Handler
	poller   *loadsource.Poller // nil without load sources
	prober   *gw.Prober
	kv       *kvFeed        // nil without KV-event endpoints
	closers  []func() error // with --config: the Router, then the Redis client; close calls them in reverse
}

// build validates the options and the engine list and wires the gateway. Nothing runs yet:
// runBackground starts the pollers and subscribers.
func build(o options, log *zap.Logger) (*gateway, error) {
	if o.config != "" {
		return buildFromConfig(o, log)
	}
	var specs []engineSpec
	if o.enginesFile != "" {
		fromFile, err := loadFile(o.enginesFile)
		if err != nil {
			return nil, err
		}
		specs = append(specs, fromFile...)
	}
	for _, text := range o.engines {
		s, err := parseEngineFlag(text)
		if err != nil {
			return nil, err
		}
		specs = append(specs, s)
	}
	if len(specs) == 0 {
		return nil, fmt.Errorf("no engines: give --config, --engine, --engines-file or --fake-engines N: %w", state.ErrInvalidConfiguration)
	}
	configs := make([]gw.EngineConfig, len(specs))
	for i, s := range specs {
		c, err := s.engineConfig()
		if err != nil {
			return nil, err
		}
		configs[i] = c
	}
	registry, err := gw.NewRegistry(configs, gw.BreakerConfig{FailureStreak: o.breakerFailures})
	if err != nil {
		return nil, err
	}
	g := &gateway{registry: registry, table: loadmon.NewTable(loadmon.WithFreshness(o.freshness)), inflight: loadmon.NewInFlight(nil)}
	for _, e := range registry.All() {
		if n := e.Config().DPRanks; n > 1 {
			if err := g.table.Expect(e.ID(), n); err != nil {
				return nil, err
			}
		}
	}

	var source kvindex.Source
	if o.policy == "cache_aware" {
		h, err := kvindex.NewHasher(kvindex.HasherConfig{BlockTokens: o.blockTokens})
		if err != nil {
			return nil, fmt.Errorf("--block-tokens: %w", err)
		}
		if g.index, err = kvindex.NewIndex(h, kvindex.Options{}); err != nil {
			return nil, err
		}
		if source, err = kvindex.NewLocalSource(g.index); err != nil {
			return nil, err
		}
	}
	newPolicy := func(name string) (policy.Policy, error) {
		cfg := policy.Config{Load: g.table, InFlight: g.inflight, Admission: admission.Limits{}}
		switch name {
		case "round_robin":
			return policy.NewRoundRobin(cfg)
		case "random":
			return policy.NewRandom(cfg)
		case "power_of_two":
			return policy.NewPowerOfN(cfg, 2)
		case "least_load":
			return policy.NewLeastLoad(cfg)
		case "cache_aware":
			if source == nil {
				return nil, fmt.Errorf("policy cache_aware is only allowed as --policy: %w", state.ErrInvalidConfiguration)
			}
			opts := policy.CacheAwareOptions{Source: source, MinMatchedTokens: o.minMatched}
			if o.engineQueueLimit > 0 {
				limit := o.engineQueueLimit
				opts.EngineQueueLimit = &limit
			}
			return policy.NewCacheAware(cfg, opts)
		}
		return nil, fmt.Errorf("policy %q: want round_robin, random, power_of_two, least_load or cache_aware: %w", name, state.ErrInvalidConfiguration)
	}
	group := func(name string) (*bucket.EngineGroup, error) {
		p, err := newPolicy(name)
		if err != nil {
			return nil, err
		}
		return bucket.NewEngineGroup(p, nil)
	}
	resolvers := map[state.ModelID]*bucket.Resolver{}
	for _, m := range registry.Models() {
		var plain, prefill, decode int
		for _, e := range registry.Engines(m) {
			switch e.Stage() {
			case state.StagePlain:
				plain++
			case state.StagePrefill:
				prefill++
			case state.StageDecode:
				decode++
			}
		}
		if (prefill == 0) != (decode == 0) {
			return nil, fmt.Errorf("model %q has %d prefill and %d decode engines: a PD model needs both: %w", m, prefill, decode, state.ErrInvalidConfiguration)
		}
		var buckets []*bucket.Bucket
		if plain > 0 {
			gp, err := group(o.policy)
			if err != nil {
				return nil, err
			}
			b, err := bucket.NewPlainBucket(bucket.Spec{ID: "plain"}, gp)
			if err != nil {
				return nil, err
			}
			buckets = append(buckets, b)
		}
		if prefill > 0 {
			gp, err := group(o.policy)
			if err != nil {
				return nil, err
			}
			gd, err := group(o.decodePolicy)
			if err != nil {
				return nil, err
			}
			b, err := bucket.NewPDBucket(bucket.Spec{ID: "pd", Rank: 1}, gp, gd)
			if err != nil {
				return nil, err
			}
			buckets = append(buckets, b)
		}
		if resolvers[m], err = bucket.NewResolver(buckets, bucket.ResolverOptions{}); err != nil {
			return nil, err
		}
	}
	g.router, err = enginepick.NewRouter(enginepick.Options{Registry: registry, Resolvers: resolvers,
		InFlight: g.inflight, Load: g.table, Index: g.index, Logger: log})
	if err != nil {
		return nil, err
	}

	var targets []loadsource.Target
	for i, s := range specs {
		t, ok, err := s.loadTarget(configs[i].Kind)
		if err != nil {
			return nil, err
		}
		if ok {
			targets = append(targets, t)
		}
	}
	reg := prometheus.NewRegistry()
	metrics := gw.NewMetrics(reg, registry)
	if len(targets) > 0 {
		g.poller, err = loadsource.NewPoller(g.table, targets, loadsource.Options{Interval: o.loadInterval,
			Timeout: o.loadTimeout, Jitter: o.loadJitter, Logger: log})
		if err != nil {
			return nil, err
		}
		registerPollerMetrics(reg, g.poller, len(targets))
	}
	if g.kv, err = newKVFeed(specs, g.index, g.inflight, log); err != nil {
		return nil, err
	}
	if g.kv != nil {
		g.kv.register(reg)
	}
	var tok gw.Tokenizer
	if o.tokenize {
		tok = &gw.EngineTokenizer{Registry: registry, Timeout: o.tokenizeTimeout}
	}
	g.prober = &gw.Prober{Registry: registry, Interval: o.probeInterval, Path: o.probePath}
	g.server, err = gw.NewServer(gw.Options{Router: g.router, Registry: registry, Tokenizer: tok,
		BytesPerToken: o.bytesPerToken, SessionHeader: o.sessionHeader, RoutingKeyHeader: o.routingKeyHeader,
		MaxBodyBytes: o.maxBodyBytes, PrefillTimeout: o.prefillTimeout, Metrics: metrics, Logger: log, Prober: g.prober,
		EnginePriority: enginePriority(o.enginePriority, nil)})
	if err != nil {
		return nil, err
	}
	g.handler = withKVDebug(g.server, g.index, func() kvevents.Stats {
		if g.kv == nil {
			return kvevents.Stats{}
		}
		return g.kv.sub.Stats()
	})
	return g, nil
}

// registerPollerMetrics exports each load target's poll counters.
func registerPollerMetrics(reg *prometheus.Registry, p *loadsource.Poller, n int) {
	for i := range n {
		engine := p.Stats()[i].Engine
		labels := prometheus.Labels{"engine": string(engine)}
		reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "gateway_load_polls_total",
			Help: "Load polls of the engine.", ConstLabels: labels}, func() float64 { return float64(p.Stats()[i].Polls) }))
		reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "gateway_load_poll_failures_total",
			Help: "Failed load polls of the engine (its load goes stale).", ConstLabels: labels}, func() float64 { return float64(p.Stats()[i].Failures) }))
	}
}

// runBackground runs the load poller, the health prober and the KV-event subscriber until ctx is
// done, and returns once all have stopped.
func (g *gateway) runBackground(ctx context.Context) error {
	var wg sync.WaitGroup
	errs := make(chan error, 3)
	if g.poller != nil {
		wg.Go(func() { errs <- g.poller.Run(ctx) })
	}
	wg.Go(func() { errs <- g.prober.Run(ctx) })
	if g.kv != nil {
		wg.Go(func() { errs <- g.kv.run(ctx) })
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}

// close releases what build allocated outside runBackground.
func (g *gateway) close() {
	if g.kv != nil {
		g.kv.close()
	}
	for i := len(g.closers) - 1; i >= 0; i-- {
		_ = g.closers[i]()
	}
	g.closers = nil
}

// enginePriority is gw.Options.EnginePriority under --engine-priority (nil without): a request's
// band, the highest of bands at or below its priority (the lowest when none is; the priority
// itself without bands, as flowcontrol.Config.Bands places it), negated, since enginepick serves
// higher priorities first and vLLM lower values.
func enginePriority(on bool, bands []int) func(int) int {
	if !on {
		return nil
	}
	return func(p int) int {
		if len(bands) == 0 {
			return -p
		}
		band, found := slices.Min(bands), false
		for _, b := range bands {
			if b <= p && (!found || b > band) {
				band, found = b, true
			}
		}
		return -band
	}
}
