package main

import (
	"cmp"
	"fmt"
	"os"
	"strings"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"

	"github.com/enginepick/enginepick/affinity/redisstore"
	"github.com/enginepick/enginepick/config"
	"github.com/enginepick/enginepick/examples/gateway/internal/gw"
	"github.com/enginepick/enginepick/metrics"
	"github.com/enginepick/enginepick/state"
)

// redisPasswordEnv names the environment variable the Redis password is read from: credentials do
// not belong in the routing configuration (config.RedisSettings).
const redisPasswordEnv = "ENGINEPICK_REDIS_PASSWORD"

// configReplaces are the flags whose settings a --config file holds; giving one with --config is
// an error rather than a silent override.
var configReplaces = []string{"engine", "engines-file", "policy", "decode-policy", "block-tokens", "engine-queue-limit",
	"min-matched-tokens", "session-header", "routing-key-header", "load-interval", "load-timeout", "load-jitter", "freshness"}

// buildFromConfig wires the gateway from a routing configuration file, the same file
// examples/replay -config replays (docs/design.md §14): the engines come from its engines list,
// the Router from config.New, which polls the listed load endpoints and follows the listed KV
// events itself (Router.Close stops them), and exports the enginepick_* metrics next to the
// gateway's. Each engine's server software is read from its load format (sglang_* is SGLang,
// vllm_metrics vLLM), else --engine-kind. A request picked for a rank of an engine whose ranks
// list their own url goes to that url. A request whose model is one of a model's adapters
// (models[].adapters) is routed on that model's buckets for the adapter and forwarded unchanged.
// With affinity.store redis, the Redis store is built from affinity.redis, with the password from
// $ENGINEPICK_REDIS_PASSWORD; a replicas block without a password takes it from there too
// (config.New dials the broker itself).
func buildFromConfig(o options, log *zap.Logger) (*gateway, error) {
	var clash []string
	for _, name := range configReplaces {
		if o.explicit[name] {
			clash = append(clash, "--"+name)
		}
	}
	if len(clash) > 0 {
		return nil, fmt.Errorf("--config and %s are exclusive: the file holds the engines, policies and shared settings: %w",
			strings.Join(clash, ", "), state.ErrInvalidConfiguration)
	}
	cfg, err := config.Load(o.config)
	if err != nil {
		return nil, err
	}
	if len(cfg.Engines) == 0 {
		return nil, fmt.Errorf("--config %s lists no engines: %w", o.config, state.ErrInvalidConfiguration)
	}
	if r := cfg.Replicas; r != nil && r.Redis.Password == "" {
		r.Redis.Password = os.Getenv(redisPasswordEnv)
	}
	defaultKind, err := gw.ParseKind(o.engineKind)
	if err != nil {
		return nil, fmt.Errorf("--engine-kind: %w", err)
	}
	configs := make([]gw.EngineConfig, len(cfg.Engines))
	for i, e := range cfg.Engines {
		if strings.HasSuffix(e.ID, "/") {
			return nil, fmt.Errorf("--config %s: engines[%d].id %q: the gateway's engine IDs are base URLs without a trailing slash: %w",
				o.config, i, e.ID, state.ErrInvalidConfiguration)
		}
		kind, load := defaultKind, e.Load
		if len(e.Ranks) > 0 {
			load = e.Ranks[0].Load // LoadConfig checked that every rank has one format, or none has a page
		}
		if load != nil {
			kind = gw.KindVLLM
			if strings.HasPrefix(load.Format, "sglang_") {
				kind = gw.KindSGLang
			}
		}
		st, err := state.ParseStage(cmp.Or(e.Stage, "plain"))
		if err != nil {
			return nil, err // LoadConfig checked it
		}
		var rankURLs []string
		if len(e.Ranks) > 0 && e.Ranks[0].URL != "" {
			for _, r := range e.Ranks {
				rankURLs = append(rankURLs, r.URL)
			}
		}
		configs[i] = gw.EngineConfig{URL: e.ID, Model: state.ModelID(e.Model), Kind: kind, Stage: st, DPRanks: e.RankCount(),
			DPRankStart: e.DPRankStart, RankURLs: rankURLs}
	}
	registry, err := gw.NewRegistry(configs, gw.BreakerConfig{FailureStreak: o.breakerFailures})
	if err != nil {
		return nil, err
	}
	reg := prometheus.NewRegistry()
	obs, err := metrics.New(reg, metrics.Options{})
	if err != nil {
		return nil, err
	}
	g := &gateway{registry: registry}
	opts := []config.Option{config.WithLogger(log), config.WithObserver(obs)}
	if cfg.Affinity.Store == "redis" {
		rs := cfg.Affinity.Redis
		client := redis.NewUniversalClient(&redis.UniversalOptions{Addrs: rs.Addrs, Password: os.Getenv(redisPasswordEnv)})
		store, err := redisstore.New(redisstore.Options{Client: client, Prefix: rs.Prefix, Shards: rs.Shards, IdleTimeout: cfg.Affinity.IdleTimeout.D()})
		if err != nil {
			_ = client.Close()
			return nil, fmt.Errorf("affinity.redis: %w", err)
		}
		g.closers = append(g.closers, client.Close)
		opts = append(opts, config.WithAffinityStore(store))
	}
	cr, err := config.New(cfg, registry, opts...)
	if err != nil {
		g.close()
		return nil, err
	}
	g.router = cr.Router
	g.closers = append(g.closers, cr.Close)
	g.table, g.inflight, g.index = g.router.LoadTable(), g.router.InFlight(), g.router.Index()

	var tok gw.Tokenizer
	if o.tokenize {
		tok = &gw.EngineTokenizer{Registry: registry, Timeout: o.tokenizeTimeout}
	}
	g.prober = &gw.Prober{Registry: registry, Interval: o.probeInterval, Path: o.probePath}
	adapters := map[state.ModelID]state.ModelID{}
	for _, m := range cfg.Models {
		for _, a := range m.Adapters {
			adapters[state.ModelID(a)] = state.ModelID(m.ID)
		}
	}
	g.server, err = gw.NewServer(gw.Options{Router: g.router, Registry: registry, Tokenizer: tok, Adapters: adapters,
		BytesPerToken: o.bytesPerToken, MaxBodyBytes: o.maxBodyBytes, PrefillTimeout: o.prefillTimeout, Logger: log, Prober: g.prober,
		SessionHeader:    cmp.Or(cfg.Affinity.SessionHeader, config.DefaultSessionHeader),
		RoutingKeyHeader: cmp.Or(cfg.Affinity.RoutingKeyHeader, config.DefaultRoutingKeyHeader),
		Metrics:          gw.NewMetrics(reg, registry), EnginePriority: enginePriority(o.enginePriority, bandsOf(cfg.FlowControl))})
	if err != nil {
		g.close()
		return nil, err
	}
	g.handler = withKVDebug(g.server, g.index, cr.KVEventStats)
	return g, nil
}

// bandsOf returns the priorities of the flow_control block's bands; nil without one. A block
// without bands has one band of priority 0.
func bandsOf(f *config.FlowControl) []int {
	if f == nil {
		return nil
	}
	if len(f.Bands) == 0 {
		return []int{0}
	}
	var out []int
	for _, b := range f.Bands {
		out = append(out, b.Priority)
	}
	return out
}
