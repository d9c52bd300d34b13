package config

import (
	"cmp"
	"context"
	crand "crypto/rand"
	"fmt"
	"maps"
	"net/http"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/enginepick/enginepick"
	"github.com/enginepick/enginepick/admission"
	"github.com/enginepick/enginepick/affinity"
	"github.com/enginepick/enginepick/bucket"
	"github.com/enginepick/enginepick/flowcontrol"
	"github.com/enginepick/enginepick/internal/peersync"
	"github.com/enginepick/enginepick/internal/peersync/redispeer"
	"github.com/enginepick/enginepick/kvindex"
	"github.com/enginepick/enginepick/kvindex/kvevents"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/loadmon/loadsource"
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

// Option configures New.
type Option func(*settings)

type settings struct {
	log            *zap.Logger
	obs            enginepick.Observer
	now            func() time.Time
	rand           func(n int) int
	load           *loadmon.Table
	inflight       *loadmon.InFlight
	index          *kvindex.Index
	remote         kvindex.RemoteIndexer
	store          affinity.Store
	client         *http.Client
	healthInterval time.Duration
	warnEvery      time.Duration
}

// Defaults of the degraded-state checks (docs/design.md §15).
const (
	// defaultHealthInterval is how often the Router checks for degraded state (stale loads, an
	// untrusted index).
	defaultHealthInterval = 10 * time.Second
	// defaultWarnInterval is the least time between two warnings with the same message.
	defaultWarnInterval = time.Minute
)

// WithLogger sets the logger. Nil (and the default) is zap.NewNop(). New logs a configuration
// summary at Info; the Router warns about degraded state at most once a minute per
// message (docs/design.md §15).
func WithLogger(l *zap.Logger) Option { return func(s *settings) { s.log = l } }

// WithObserver sets the Observer that receives the Router's decisions and dispatch outcomes (for
// example metrics.New's); with a flow_control block, one that implements flowcontrol.Observer
// also receives the queue's events. Nil (and the default) is none.
func WithObserver(o enginepick.Observer) Option { return func(s *settings) { s.obs = o } }

// WithClock sets the clock of every freshness, expiry and latency measurement New sets up. Nil
// (and the default) is time.Now.
func WithClock(now func() time.Time) Option { return func(s *settings) { s.now = now } }

// WithRand sets the random source of every policy (policy.Config.Rand): it returns a uniform
// integer in [0, n) and must be safe for concurrent use unless the Router is used from one
// goroutine. Nil (and the default) is math/rand/v2's IntN.
func WithRand(rand func(n int) int) Option { return func(s *settings) { s.rand = rand } }

// WithLoadTable makes the Router use the host's load table instead of building one; its freshness
// must then equal load.freshness when the configuration sets it. The host keeps reporting to it.
func WithLoadTable(t *loadmon.Table) Option { return func(s *settings) { s.load = t } }

// WithInFlight makes the Router use the host's in-flight counters instead of building them.
func WithInFlight(f *loadmon.InFlight) Option { return func(s *settings) { s.inflight = f } }

// WithIndex makes the Router use the host's KV-block index instead of building one; its block size
// must then equal kv.block_tokens when the configuration sets it.
func WithIndex(x *kvindex.Index) Option { return func(s *settings) { s.index = x } }

// WithRemoteIndexer sets the remote indexer that cache_aware policies with prefix_source remote
// query, through one shared kvindex.RemoteSource. Required when such a policy is configured.
func WithRemoteIndexer(ri kvindex.RemoteIndexer) Option { return func(s *settings) { s.remote = ri } }

// WithAffinityStore sets the affinity store every session_aware and sticky policy shares, for
// example a redisstore.Store built from affinity.redis (docs/design.md §12). Required with
// affinity.store redis; with store unset it replaces the in-memory store New would build; with
// store memory it is an error. The host owns the store (its client, its closing).
func WithAffinityStore(st affinity.Store) Option { return func(s *settings) { s.store = st } }

// WithHTTPClient sets the client of the load pollers. Nil (and the default) is a new http.Client.
func WithHTTPClient(c *http.Client) Option { return func(s *settings) { s.client = c } }

// WithHealthInterval sets how often the Router checks for degraded state; 0 turns the checks off.
// The default is 10 s. Negative is an error.
func WithHealthInterval(d time.Duration) Option { return func(s *settings) { s.healthInterval = d } }

// WithWarnInterval sets the least time between two degraded-state warnings with the same
// message. The default is one minute; 0 or negative is an error.
func WithWarnInterval(d time.Duration) Option { return func(s *settings) { s.warnEvery = d } }

// services are the goroutines New started; Close stops them.
type services struct {
	cancel context.CancelFunc
	wg     sync.WaitGroup
	once   sync.Once
}

// Router is an enginepick.Router built from a configuration, with the services that keep its
// shared state current: the load poller, the KV-event subscriber, the in-memory affinity store's
// sweeper and the degraded-state checks, which New starts and Close stops. Every method of the
// embedded Router is available; Select also maps LoRA adapter names (Model.Adapters), and
// RemoveEngine also drops the engine's KV-event streams.
type Router struct {
	*enginepick.Router

	config    *Config
	warn      *zap.Logger // rate-limited
	poller    *loadsource.Poller
	ownClient *http.Client // the pollers' client when New made it; Close drops its idle connections
	kvSub     *kvevents.Subscriber
	share     *peersync.Core  // nil without a replicas block
	peer      *redispeer.Peer // runs share over the broker
	svc       *services
	degraded  degradedChecks
	adapters  map[state.ModelID]state.ModelID // adapter name → base model (Select)
}

// replicaObserver is an optional interface of an enginepick.Observer (package metrics'): New
// passes it the replicas' sharing, whose counters it exports.
type replicaObserver interface {
	ObserveReplicas(p *redispeer.Peer)
}

// RouterAttacher is an optional interface of an enginepick.Observer: New calls AttachRouter once,
// after building the Router and before returning it. An error fails New (and stops what it
// started).
type RouterAttacher interface {
	AttachRouter(r *Router) error
}

// New builds a Router from cfg (docs/design.md §14). It validates cfg (Config.Validate), checks
// every group's members against registry (an engine of another model or stage is an error), then
// builds the state every policy shares, once: one load table and one in-flight counter set, and,
// on a policy's first request through policy.Env, one KV-block index with its local prefix
// source, one remote prefix source, and one affinity store. It builds each group's policy with its
// type's policy.Builder, builds the flowcontrol.Controller of a flow_control block (docs/design.md
// §17), assembles the Router with enginepick.NewRouter, and starts the shared
// services: one load poller for every engine with a load endpoint, one KV-event subscriber, the
// in-memory affinity store's sweeper, and the degraded-state checks. Close stops them.
//
// A nil registry means a static registry of cfg.Engines (every engine healthy). Hosts with their
// own registry pass it; it stays authoritative for role and health.
//
// Errors: a *Error (matching state.ErrInvalidConfiguration) naming the field for every
// configuration problem, including a missing WithRemoteIndexer, or a load table or index passed
// with options that disagrees with the configuration; an error wrapping
// state.ErrInvalidConfiguration for invalid options; RouterAttacher's error.
func New(cfg *Config, registry state.Registry, opts ...Option) (*Router, error) {
	if cfg == nil {
		return nil, cfgErr("", 0, state.ErrMissingField, "nil configuration")
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	s := settings{healthInterval: defaultHealthInterval, warnEvery: defaultWarnInterval}
	for _, o := range opts {
		o(&s)
	}
	if s.healthInterval < 0 {
		return nil, fmt.Errorf("config: WithHealthInterval(%v): must be >= 0: %w", s.healthInterval, state.ErrInvalidConfiguration)
	}
	if s.warnEvery <= 0 {
		return nil, fmt.Errorf("config: WithWarnInterval(%v): must be > 0: %w", s.warnEvery, state.ErrInvalidConfiguration)
	}
	if s.log == nil {
		s.log = zap.NewNop()
	}
	realClock := s.now == nil
	if realClock {
		s.now = time.Now
	}
	b := builder{cfg: cfg, s: &s, realClock: realClock,
		warnLog: s.log.WithOptions(zap.WrapCore(func(c zapcore.Core) zapcore.Core { return zapcore.NewSamplerWithOptions(c, s.warnEvery, 1, 0) }))}
	if err := b.registry(registry); err != nil {
		return nil, err
	}
	if err := b.shared(); err != nil {
		return nil, err
	}
	if err := b.resolvers(); err != nil {
		return nil, err
	}
	if err := b.kvEventsNeedIndex(); err != nil {
		return nil, err
	}
	ro := enginepick.Options{Registry: b.reg, Resolvers: b.res, InFlight: b.inflight, Load: b.load, Index: b.index,
		Logger: s.log, Observer: s.obs, Models: b.models, AffinityStore: b.store,
		PolicyName: func(bk *bucket.Bucket, st state.Stage) string { return b.labels[bk][st] }}
	if !realClock {
		ro.Now = s.now
	}
	fc, err := b.flowControl()
	if err != nil {
		return nil, err
	}
	ro.FlowControl = fc
	er, err := enginepick.NewRouter(ro)
	if err != nil {
		return nil, err
	}
	r := &Router{Router: er, config: cfg, warn: b.warnLog, adapters: adapterBases(cfg)}
	if err := b.start(r); err != nil {
		return nil, err
	}
	if o, ok := s.obs.(replicaObserver); ok && r.peer != nil {
		o.ObserveReplicas(r.peer)
	}
	if a, ok := s.obs.(RouterAttacher); ok {
		if err := a.AttachRouter(r); err != nil {
			_ = r.Close()
			return nil, err
		}
	}
	b.summary(r)
	return r, nil
}

// flowControl builds the Controller of the flow_control block, nil without one; an Observer that
// implements flowcontrol.Observer receives its events.
func (b *builder) flowControl() (*flowcontrol.Controller, error) {
	f := b.cfg.FlowControl
	if f == nil {
		return nil, nil
	}
	fc := flowcontrol.Config{MaxQueued: f.MaxQueued, HalfLife: f.HalfLife.D(), QueueThreshold: f.QueueThreshold, KVThreshold: f.KVThreshold}
	for _, bd := range f.Bands {
		fc.Bands = append(fc.Bands, flowcontrol.Band{Priority: bd.Priority, TTL: bd.TTL.D(), MaxQueued: bd.MaxQueued, Sheddable: bd.Sheddable})
	}
	if len(f.FlowWeights) > 0 {
		weights := maps.Clone(f.FlowWeights)
		fc.Weight = func(flow string) float64 { return weights[flow] } // 0 for the others: weight 1
	}
	fc.Observer, _ = b.s.obs.(flowcontrol.Observer)
	c, err := flowcontrol.New(fc)
	if err != nil {
		return nil, &Error{Path: "flow_control", Line: b.cfg.lines["flow_control"], Err: fmt.Errorf("%w: %v", state.ErrBadValue, err)}
	}
	return c, nil
}

// builder holds New's work in progress.
type builder struct {
	cfg       *Config
	s         *settings
	realClock bool // no WithClock: every clock is time.Now

	reg      state.Registry
	hasher   kvindex.Hasher
	warnLog  *zap.Logger // the logger with warnings rate-limited, for the policies
	load     *loadmon.Table
	inflight *loadmon.InFlight
	index    *kvindex.Index
	local    *kvindex.LocalSource
	remote   *kvindex.RemoteSource
	store    affinity.Store
	memStore *affinity.MemoryStore // the store New built, which its sweeper runs
	res      map[state.ModelID]*bucket.Resolver
	labels   map[*bucket.Bucket][3]string
	models   []state.ModelID
	degraded degradedChecks
}

// registry sets the registry (cfg.Engines when nil) and checks membership against it.
func (b *builder) registry(reg state.Registry) error {
	if reg == nil {
		if len(b.cfg.Engines) == 0 {
			return cfgErr("engines", 0, state.ErrMissingField, "no registry was passed to New and the configuration lists no engines")
		}
		sr := &state.StaticRegistry{}
		for i := range b.cfg.Engines {
			e := &b.cfg.Engines[i]
			st, _ := parseStage(e.Stage)
			if err := sr.Add(state.NewStaticEngine(state.EngineID(e.ID), state.ModelID(e.Model), st)); err != nil {
				return &Error{Path: fmt.Sprintf("engines[%d]", i), Err: fmt.Errorf("%w: %v", state.ErrBadValue, err)}
			}
		}
		reg = sr
	}
	b.reg = reg
	// Membership against the registry: an engine the registry knows under another model or
	// stage cannot be a member (docs/design.md §14.4). Unknown IDs are allowed: engines come
	// and go.
	type where struct {
		model state.ModelID
		stage state.Stage
	}
	known := map[state.EngineID]where{}
	for i := range b.cfg.Models {
		m := state.ModelID(b.cfg.Models[i].ID)
		for _, e := range reg.Engines(m) {
			if e != nil {
				known[e.ID()] = where{m, e.Stage()}
			}
		}
	}
	v := validator{lines: b.cfg.lines}
	v.checkMembers(b.cfg, func(id string) (string, state.Stage, bool) {
		w, ok := known[state.EngineID(id)]
		return string(w.model), w.stage, ok
	})
	return v.err
}

// shared builds the state handles every policy shares.
func (b *builder) shared() error {
	cfg, s := b.cfg, b.s
	if b.load = s.load; b.load == nil {
		b.load = loadmon.NewTable(loadmon.WithClock(s.now), loadmon.WithFreshness(cfg.Load.Freshness.D()))
	} else if f := cfg.Load.Freshness.D(); f != 0 && f != b.load.Freshness() {
		return cfgErr("load.freshness", cfg.lines["load.freshness"], state.ErrConflict,
			"%v, but the load table passed with WithLoadTable has freshness %v", f, b.load.Freshness())
	}
	for i := range cfg.Engines {
		if e := &cfg.Engines[i]; e.RankCount() > 1 {
			if err := b.load.Expect(state.EngineID(e.ID), e.RankCount()); err != nil {
				return &Error{Path: fmt.Sprintf("engines[%d].dp_ranks", i), Err: fmt.Errorf("%w: %v", state.ErrOutOfRange, err)}
			}
		}
	}
	if b.inflight = s.inflight; b.inflight == nil {
		var clock func() time.Time // nil: time.Now, which lets an observed Select reuse the dispatch's clock reading
		if !b.realClock {
			clock = s.now
		}
		b.inflight = loadmon.NewInFlight(clock)
	}
	bt := cfg.KV.BlockTokens
	if bt == 0 {
		bt = defaultBlockTokens
	}
	var err error
	if b.hasher, err = kvindex.NewHasher(kvindex.HasherConfig{BlockTokens: bt, Seed: cfg.KV.HashSeed, Namespace: cfg.KV.Namespace}); err != nil {
		return &Error{Path: "kv.block_tokens", Err: fmt.Errorf("%w: %v", state.ErrOutOfRange, err)}
	}
	if b.index = s.index; b.index != nil && cfg.KV.BlockTokens != 0 && cfg.KV.BlockTokens != b.index.Hasher().BlockTokens() {
		return cfgErr("kv.block_tokens", cfg.lines["kv.block_tokens"], state.ErrConflict,
			"%d, but the index passed with WithIndex has %d-token blocks", cfg.KV.BlockTokens, b.index.Hasher().BlockTokens())
	}
	if s.store != nil && cfg.Affinity.Store == "memory" {
		return cfgErr("affinity.store", cfg.lines["affinity.store"], state.ErrConflict,
			"memory, but a store was passed with WithAffinityStore: remove one of them")
	}
	b.store = s.store
	return nil
}

// localSource returns the prefix source over the shared KV-block index, building the index (unless
// the host passed one) and the source on the first call (policy.Env.LocalSource).
func (b *builder) localSource() (kvindex.Source, error) {
	if b.local != nil {
		return b.local, nil
	}
	kv := &b.cfg.KV
	if b.index == nil {
		x, err := kvindex.NewIndex(b.hasher, kvindex.Options{MaxBlocks: kv.MaxBlocks, MaxApproxBlocks: kv.MaxApproxBlocks,
			ApproxTTL: kv.ApproxTTL.D(), Now: b.s.now, ExpectedBlocks: kv.ExpectedBlocks, ExpectedHolderBlocks: kv.ExpectedHolderBlocks,
			WriterYieldBlocks: kv.WriterYieldBlocks})
		if err != nil {
			return nil, &Error{Path: "kv", Err: fmt.Errorf("%w: %v", state.ErrOutOfRange, err)}
		}
		b.index = x
	}
	local, err := kvindex.NewLocalSource(b.index)
	if err != nil {
		return nil, &Error{Path: "kv", Err: fmt.Errorf("%w: %v", state.ErrBadValue, err)}
	}
	b.local = local
	return local, nil
}

// remoteSource returns the one remote prefix source every policy shares, built on the first call
// over the host's remote indexer (policy.Env.RemoteSource).
func (b *builder) remoteSource() (kvindex.Source, error) {
	if b.remote != nil {
		return b.remote, nil
	}
	r, err := kvindex.NewRemoteSource(b.s.remote, b.hasher, kvindex.RemoteOptions{Timeout: b.cfg.KV.RemoteTimeout.D(), MaxConcurrent: b.cfg.KV.RemoteMaxConcurrent})
	if err != nil {
		return nil, &Error{Path: "kv", Err: fmt.Errorf("%w: %v", state.ErrBadValue, err)}
	}
	b.remote = r
	return r, nil
}

// kvEventsNeedIndex rejects kv_events publishers when no policy built the KV-block index and the
// host passed none: their events would feed nothing.
func (b *builder) kvEventsNeedIndex() error {
	if b.index != nil {
		return nil
	}
	for i := range b.cfg.Engines {
		e, p := &b.cfg.Engines[i], fmt.Sprintf("engines[%d].kv_events", i)
		if len(e.Ranks) > 0 {
			p = fmt.Sprintf("engines[%d].ranks[0].kv_events", i)
		}
		if e.KVEvents != nil || len(e.Ranks) > 0 && e.Ranks[0].KVEvents != nil {
			return cfgErr(p, b.cfg.lines[p], state.ErrConflict,
				"KV events feed the prefix index, which only a cache_aware policy with a local prefix source reads: attach one, or remove kv_events")
		}
	}
	return nil
}

// affinityStore returns the store session_aware and sticky policies share: the host's, or a new
// in-memory one built on the first call (policy.Env.AffinityStore; docs/design.md §14.5).
func (b *builder) affinityStore() (affinity.Store, error) {
	if b.store != nil {
		return b.store, nil
	}
	a := &b.cfg.Affinity
	if a.Store == "redis" {
		return nil, cfgErr("affinity.store", b.cfg.lines["affinity.store"], state.ErrMissingField,
			"store redis needs the Redis store: build it with affinity/redisstore from affinity.redis and pass config.WithAffinityStore to New")
	}
	ms, err := affinity.NewMemoryStore(affinity.Options{IdleTimeout: a.IdleTimeout.D(), SweepInterval: a.SweepInterval.D(),
		MaxBindings: a.MaxBindings, Now: b.s.now})
	if err != nil {
		return nil, &Error{Path: "affinity", Err: fmt.Errorf("%w: %v", state.ErrOutOfRange, err)}
	}
	b.store, b.memStore = ms, ms
	return ms, nil
}

// groupPath is one group of the configuration with its effective policy.
type groupPath struct {
	model      *Model
	bucket     *Bucket
	group      *Group
	stage      state.Stage
	path       string // the group's path
	policy     *Policy
	policyPath string // where the effective policy is written ("" for the built-in default)
}

// resolvers builds every model's policies, groups, buckets and resolver, in document order.
func (b *builder) resolvers() error {
	b.res = map[state.ModelID]*bucket.Resolver{}
	b.labels = map[*bucket.Bucket][3]string{}
	for i := range b.cfg.Models {
		m := &b.cfg.Models[i]
		mpath := fmt.Sprintf("models[%d]", i)
		var buckets []*bucket.Bucket
		for j := range m.Buckets {
			bc := &m.Buckets[j]
			path := fmt.Sprintf("%s.buckets[%d]", mpath, j)
			var (
				gs [3]*bucket.EngineGroup
				lb [3]string // the policy type of each group, by stage
			)
			for _, g := range groupsOf(bc, path+".groups") {
				p, pp := effectivePolicy(m, g.g, g.stage, mpath)
				if g.g.Policy != nil {
					pp = g.path + ".policy"
				}
				eg, err := b.group(groupPath{model: m, bucket: bc, group: g.g, stage: g.stage, path: g.path, policy: p, policyPath: pp})
				if err != nil {
					return err
				}
				gs[g.stage], lb[g.stage] = eg, p.Type
			}
			spec := bucket.Spec{ID: bc.ID, Rank: bc.Rank, MinInputTokens: bc.Limits.Min, MaxInputTokens: bc.Limits.Max,
				MaxContextTokens: bc.MaxContextTokens, TTFTEstimate: bc.TTFTEstimate.D(), TPSEstimate: bc.TPSEstimate}
			var (
				bk  *bucket.Bucket
				err error
			)
			if bc.Groups.Plain != nil {
				bk, err = bucket.NewPlainBucket(spec, gs[state.StagePlain])
			} else {
				bk, err = bucket.NewPDBucket(spec, gs[state.StagePrefill], gs[state.StageDecode])
			}
			if err != nil {
				return &Error{Path: path, Line: b.cfg.lines[path], Err: fmt.Errorf("%w: %v", state.ErrBadValue, err)}
			}
			b.labels[bk] = lb
			buckets = append(buckets, bk)
		}
		ttft, _ := parseSLOPreference(m.SLO.TTFTPreference)
		tps, _ := parseSLOPreference(m.SLO.TPSPreference)
		res, err := bucket.NewResolver(buckets, bucket.ResolverOptions{TTFTPreference: ttft, TPSPreference: tps})
		if err != nil {
			return &Error{Path: mpath, Err: fmt.Errorf("%w: %v", state.ErrBadValue, err)}
		}
		b.res[state.ModelID(m.ID)] = res
		b.models = append(b.models, state.ModelID(m.ID))
	}
	return nil
}

func (b *builder) policyName(m *Model, g *Group, s state.Stage) string {
	p, _ := effectivePolicy(m, g, s, "")
	return p.Type
}

// limits returns the policy's admission caps with the legacy in-flight cap folded in.
func limits(p *Policy) admission.Limits {
	l := p.Admission
	if p.MaxInFlight != nil && slices.Contains(p.Filter, "overloaded") {
		l.MaxInFlightRequests = admission.Cap(*p.MaxInFlight)
	}
	return l
}

// group builds one engine group with its policy, through the policy type's builder.
func (b *builder) group(gp groupPath) (*bucket.EngineGroup, error) {
	path := gp.policyPath
	if path == "" {
		path = gp.path
	}
	bpath := join(path, gp.policy.Type)
	lineOf := func(p string) int { return b.cfg.lines[p] }
	bl, ok := policy.Lookup(gp.policy.Type)
	if !ok { // Validate rejects it first
		return nil, cfgErr(join(path, "type"), lineOf(join(path, "type")), state.ErrBadValue, "unknown policy type %q", gp.policy.Type)
	}
	env := policy.Env{
		Config: policy.Config{Load: b.load, InFlight: b.inflight, Admission: limits(gp.policy), Rand: b.s.rand},
		Stage:  gp.stage, Logger: b.warnLog, Now: b.s.now, Observer: b.s.obs,
		LocalSource: b.localSource,
		RemoteSource: func() (kvindex.Source, error) {
			if b.s.remote == nil {
				return nil, cfgErr(bpath, lineOf(bpath), state.ErrMissingField, "prefix_source remote needs a remote indexer: pass config.WithRemoteIndexer to New")
			}
			return b.remoteSource()
		},
		AffinityStore: b.affinityStore,
	}
	p, err := bl.Build(gp.policy.Options, env)
	if err != nil {
		return nil, optionConfigErr(path, bpath, lineOf, err)
	}
	a := gp.policy.Admission // the legacy spelling caps in-flight requests only, which are not reported
	rl, _ := p.(interface{ ReadsReportedLoad() bool })
	if a.MaxRunningRequests != nil || a.MaxWaitingRequests != nil || a.MaxKVTokens != nil || a.MaxPendingPrefillTokens != nil ||
		rl != nil && rl.ReadsReportedLoad() {
		b.degraded.reportedCaps = append(b.degraded.reportedCaps, state.ModelID(gp.model.ID))
	}
	if b.s.obs != nil {
		if po := b.s.obs.ObserveGroup(enginepick.GroupInfo{Model: state.ModelID(gp.model.ID), Bucket: gp.bucket.ID, Stage: gp.stage, Policy: gp.policy.Type}); po != nil {
			p = &observedPolicy{inner: p, obs: po}
		}
	}
	var members []state.EngineID
	if gp.group.EngineIDs != nil {
		members = make([]state.EngineID, 0, len(*gp.group.EngineIDs))
		for _, id := range *gp.group.EngineIDs {
			members = append(members, state.EngineID(id))
		}
	}
	g, err := bucket.NewEngineGroup(p, members)
	if err != nil {
		return nil, &Error{Path: gp.path, Line: b.cfg.lines[gp.path], Err: fmt.Errorf("%w: %v", state.ErrBadValue, err)}
	}
	return g, nil
}

// start starts the shared services: the load poller and the degraded-state checks.
func (b *builder) start(r *Router) error {
	var targets []loadsource.Target
	for i := range b.cfg.Engines {
		e := &b.cfg.Engines[i]
		t := loadsource.Target{Engine: state.EngineID(e.ID), Ranks: e.RankCount(), RankStart: e.DPRankStart}
		switch {
		case e.Load != nil:
			t.URL, t.Format = e.Load.URL, loadFormat(e.Load.Format)
		case len(e.Ranks) > 0 && e.Ranks[0].Load != nil: // Validate checked that every rank has one, in one format
			t.Format = loadFormat(e.Ranks[0].Load.Format)
			for _, r := range e.Ranks {
				t.RankURLs = append(t.RankURLs, r.Load.URL)
			}
		default:
			continue
		}
		targets = append(targets, t)
		b.degraded.polled = append(b.degraded.polled, state.EngineID(e.ID))
	}
	var poller *loadsource.Poller
	if len(targets) > 0 {
		client := b.s.client
		if client == nil {
			// The Router's own connection pool, so that Close can drop its idle connections.
			client = &http.Client{Transport: http.DefaultTransport.(*http.Transport).Clone()}
			r.ownClient = client
		}
		var err error
		poller, err = loadsource.NewPoller(b.load, targets, loadsource.Options{Client: client, Interval: b.cfg.Load.PollInterval.D(),
			Timeout: b.cfg.Load.PollTimeout.D(), Jitter: b.cfg.Load.PollJitter, Logger: b.s.log})
		if err != nil {
			return &Error{Path: "engines", Err: fmt.Errorf("%w: %v", state.ErrBadValue, err)}
		}
	}
	sub, err := b.kvEvents()
	if err != nil {
		return err
	}
	if r.share, r.peer, err = b.replicas(); err != nil {
		if sub != nil {
			_ = sub.Close()
		}
		return err
	}
	r.poller = poller
	r.kvSub = sub
	r.degraded = b.degraded
	slices.Sort(r.degraded.reportedCaps)
	r.degraded.reportedCaps = slices.Compact(r.degraded.reportedCaps)
	if poller == nil && sub == nil && b.memStore == nil && b.s.healthInterval == 0 && r.peer == nil {
		return nil
	}
	ctx, cancel := context.WithCancel(context.Background())
	r.svc = &services{cancel: cancel}
	if sub != nil {
		if err := sub.Start(ctx); err != nil {
			cancel()
			_ = sub.Close()
			if r.share != nil {
				r.share.Close()
			}
			return &Error{Path: "engines", Err: fmt.Errorf("%w: KV events: %v", state.ErrBadValue, err)}
		}
	}
	if p := r.peer; p != nil {
		r.svc.wg.Go(func() { p.Run(ctx) })
	}
	if poller != nil {
		r.svc.wg.Go(func() { _ = poller.Run(ctx) })
	}
	if ms := b.memStore; ms != nil {
		r.svc.wg.Go(func() { _ = ms.Run(ctx) }) // the sweeper of the store New built
	}
	if iv := b.s.healthInterval; iv > 0 {
		r.svc.wg.Go(func() {
			t := time.NewTicker(iv)
			defer t.Stop()
			for {
				select {
				case <-ctx.Done():
					return
				case <-t.C:
					r.checkHealth()
				}
			}
		})
	}
	return nil
}

// replicas builds the sharing of the replicas block over the Router's in-flight counters and
// KV-block index (docs/design.md §6, "Router replicas"), or nils without one. Start runs it.
func (b *builder) replicas() (*peersync.Core, *redispeer.Peer, error) {
	rc := b.cfg.Replicas
	if rc == nil {
		return nil, nil, nil
	}
	host, _ := os.Hostname()
	var id [8]byte
	_, _ = crand.Read(id[:])
	f := &fleet{reg: b.reg, models: b.models}
	core, err := peersync.New(peersync.Config{ID: fmt.Sprintf("%s-%x", host, id), Incarnation: uint64(time.Now().UnixNano()),
		InFlight: b.inflight, Index: b.index, Known: f.known, Lease: replicasLease(rc)})
	if err != nil {
		return nil, nil, &Error{Path: "replicas", Err: fmt.Errorf("%w: %v", state.ErrBadValue, err)}
	}
	peer, err := redispeer.New(core, redispeer.Options{Channel: cmp.Or(rc.Channel, defaultReplicasChannel),
		FlushInterval: replicasFlush(rc), Logger: b.s.log,
		Redis: &redis.Options{Addr: rc.Redis.Addr, Password: rc.Redis.Password, DB: rc.Redis.DB}})
	if err != nil {
		core.Close()
		return nil, nil, &Error{Path: "replicas", Err: fmt.Errorf("%w: %v", state.ErrBadValue, err)}
	}
	return core, peer, nil
}

// fleet reports whether an engine is one of the registry's engines of the configured models: the
// engines peers' deltas may name (peersync.Config.Known). With a state.VersionedRegistry the set
// is kept until a model's version changes; otherwise every call scans the registry.
type fleet struct {
	reg    state.Registry
	models []state.ModelID
	cache  atomic.Pointer[fleetSet]
}

type fleetSet struct {
	versions []uint64 // per model, read before its engines
	ids      map[state.EngineID]bool
}

func (f *fleet) known(id state.EngineID) bool {
	vr, ok := f.reg.(state.VersionedRegistry)
	if !ok {
		for _, m := range f.models {
			for _, e := range f.reg.Engines(m) {
				if e != nil && e.ID() == id {
					return true
				}
			}
		}
		return false
	}
	s := f.cache.Load()
	stale := s == nil
	for i := 0; !stale && i < len(f.models); i++ {
		stale = vr.EnginesVersion(f.models[i]) != s.versions[i]
	}
	if stale {
		s = &fleetSet{ids: map[state.EngineID]bool{}}
		for _, m := range f.models {
			s.versions = append(s.versions, vr.EnginesVersion(m))
			for _, e := range vr.Engines(m) {
				if e != nil {
					s.ids[e.ID()] = true
				}
			}
		}
		f.cache.Store(s)
	}
	return s.ids[id]
}

// loadFormat returns the load format of a name Validate checked.
func loadFormat(name string) loadsource.Format {
	f, _ := loadsource.ParseFormat(name)
	return f
}

// kvEvents builds one KV-event subscriber for every engine with a kv_events publisher (its own or
// its ranks'), one stream per DP rank (docs/design.md §13.1), or nil when there is none. It is
// started by start.
func (b *builder) kvEvents() (*kvevents.Subscriber, error) {
	var eps []kvevents.Endpoint
	ranks := map[state.EngineID]int{}
	for i := range b.cfg.Engines {
		e := &b.cfg.Engines[i]
		ranks[state.EngineID(e.ID)] = e.RankCount()
		for r := range e.RankCount() {
			k, offset := e.KVEvents, r // the engine's publisher: rank r on the port + r
			if len(e.Ranks) > 0 {
				k, offset = e.Ranks[r].KVEvents, 0 // the rank's own publisher
			}
			if k == nil {
				break // Validate checked that every rank has one or none
			}
			ep := kvevents.Endpoint{Engine: state.EngineID(e.ID), DPRank: r, RankStart: e.DPRankStart, Bind: k.Bind, Topic: k.Topic}
			ep.Address, _ = rankAddress(k.Endpoint, offset) // Validate checked every rank
			if k.Replay != "" {
				ep.ReplayAddress, _ = rankAddress(k.Replay, offset)
			}
			eps = append(eps, ep)
		}
	}
	if len(eps) == 0 {
		return nil, nil
	}
	inflight := b.inflight
	var names map[int64]string
	for a, id := range b.cfg.KV.AdapterIDs {
		if names == nil {
			names = map[int64]string{}
		}
		names[id] = a
	}
	sub, err := kvevents.New(kvevents.Options{Index: b.index, AdapterNames: names, Logger: b.s.log, WarnInterval: b.s.warnEvery, Now: b.s.now,
		Dispatched: func(engine state.EngineID, rank int, since time.Time) bool {
			return dispatchedSince(inflight, ranks[engine], engine, rank, since)
		}})
	if err != nil {
		return nil, &Error{Path: "engines", Err: fmt.Errorf("%w: KV events: %v", state.ErrBadValue, err)}
	}
	for _, ep := range eps {
		if err := sub.Add(ep); err != nil {
			_ = sub.Close()
			return nil, &Error{Path: "engines", Err: fmt.Errorf("%w: KV events of %q rank %d: %v", state.ErrConflict, ep.Engine, ep.DPRank, err)}
		}
	}
	return sub, nil
}

// dispatchedSince reports whether a request was sent to the engine's DP rank at or after since,
// for the KV-event silence rule (docs/design.md §13.1): a dispatch that named the rank, or, for an
// engine of one rank, any dispatch to the engine. A dispatch to an engine of several ranks that
// named none is not counted for any rank.
func dispatchedSince(f *loadmon.InFlight, ranks int, engine state.EngineID, rank int, since time.Time) bool {
	n, _ := f.DispatchedSince(engine, rank, since)
	if n == 0 && ranks <= 1 {
		n, _ = f.DispatchedSince(engine, -1, since)
	}
	return n > 0
}

// summary logs the configuration at Info (docs/design.md §15).
func (b *builder) summary(r *Router) {
	ce := b.s.log.Check(zap.InfoLevel, "enginepick router configured")
	if ce == nil {
		return
	}
	var models []string
	for i := range b.cfg.Models {
		m := &b.cfg.Models[i]
		var bs []string
		for j := range m.Buckets {
			bc := &m.Buckets[j]
			var gs []string
			for _, g := range groupsOf(bc, "") {
				members := "all"
				if g.g.EngineIDs != nil {
					members = fmt.Sprintf("%d engines", len(*g.g.EngineIDs))
				}
				gs = append(gs, fmt.Sprintf("%s=%s(%s)", g.stage, b.policyName(m, g.g, g.stage), members))
			}
			maxIn := "∞"
			if bc.Limits.Max != 0 {
				maxIn = fmt.Sprint(bc.Limits.Max)
			}
			bs = append(bs, fmt.Sprintf("%s[%d,%s] %s", bc.ID, bc.Limits.Min, maxIn, strings.Join(gs, " ")))
		}
		models = append(models, fmt.Sprintf("%s: %s", m.ID, strings.Join(bs, "; ")))
	}
	ce.Write(zap.Strings("models", models), zap.Int("engines", len(b.cfg.Engines)),
		zap.Int("load_pollers", len(b.degraded.polled)), zap.Int("kv_event_streams", r.kvStreams()), zap.Duration("load_freshness", b.load.Freshness()),
		zap.Bool("kv_index", b.index != nil), zap.Bool("remote_prefix_source", b.remote != nil), zap.String("affinity_store", b.storeKind()), zap.Bool("flow_control", b.cfg.FlowControl != nil),
		zap.Bool("replicas", r.peer != nil))
}

// storeKind names the affinity store for the summary: none, memory or host.
func (b *builder) storeKind() string {
	switch {
	case b.store == nil:
		return "none"
	case b.memStore != nil:
		return "memory"
	}
	return "host"
}

// observedPolicy reports every pick of a group's policy to its PickObserver. It keeps the
// wrapped policy's stage support visible to the bucket.
type observedPolicy struct {
	inner policy.Policy
	obs   enginepick.PickObserver
}

// stageSupporter is a policy with the optional SupportsStage method (policy.Policy).
type stageSupporter interface {
	SupportsStage(s state.Stage) bool
}

var (
	_ policy.Policy  = (*observedPolicy)(nil)
	_ stageSupporter = (*observedPolicy)(nil)
)

func (p *observedPolicy) Pick(ctx context.Context, engines []state.Engine, req *policy.Request) (policy.Pick, error) {
	pk, err := p.inner.Pick(ctx, engines, req)
	p.obs.ObservePick(pk, err)
	return pk, err
}

func (p *observedPolicy) SupportsStage(s state.Stage) bool {
	if ss, ok := p.inner.(stageSupporter); ok {
		return ss.SupportsStage(s)
	}
	return true
}
