package sim

import (
	"cmp"
	"fmt"
	"time"

	"github.com/enginepick/enginepick"
	"github.com/enginepick/enginepick/affinity"
	"github.com/enginepick/enginepick/config"
	"github.com/enginepick/enginepick/flowcontrol"
	"github.com/enginepick/enginepick/internal/flowbridge"
	"github.com/enginepick/enginepick/kvindex"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/state"
)

// Routing replays a routing configuration, the file a production router is built from
// (config.Load, docs/design.md §14), instead of comparing built-in policies: the replay
// simulates exactly the engines the configuration lists for Model, with their IDs and stages, and
// routes every request of the trace through config.New(Config, …), so that the buckets,
// groups, memberships, policies, admission caps, load freshness, KV block size and hashing and
// affinity idle time are the file's. The same file thus describes the fleet in the replay and in
// production.
//
// What production has and the replay replaces:
//
//   - each engine's load endpoint and KV-event publisher: the simulated engines report their load
//     (every Config.ReportInterval) and publish their KV events straight into each router
//     replica's load table and index, so engines[].load and engines[].kv_events are not dialled;
//   - engines[].dp_ranks: each simulated engine is one DP rank;
//   - affinity.store redis: the bindings live in one in-memory store on the virtual clock per run,
//     shared by every router replica as replicas share Redis, with the file's idle timeout.
type Routing struct {
	// Config is the routing configuration. Required; it is only read.
	Config *config.Config
	// Model is the model of Config whose engines the replay simulates and whose buckets route
	// every request. Empty means Config.Models[0].
	Model state.ModelID
	// Name is the run's name in the report (the policy column). Empty means "config".
	Name string
}

// configBlockTokens is the block size config.New hashes with when kv.block_tokens is unset
// (config.KVSettings.BlockTokens).
const configBlockTokens = 16

// DefaultRoutingName is the report name of a Routing run without a Name.
const DefaultRoutingName = "config"

// ErrRoutingConflict: Config.Routing is set together with a field that it replaces (Fleet,
// Policies, Factories, Admission or FlowControl), or with an EngineModel.BlockTokens that differs
// from the configuration's kv.block_tokens (16 when unset).
var ErrRoutingConflict = fmt.Errorf("sim: Config.Routing replaces Fleet, Policies, Factories and Admission: %w", state.ErrInvalidConfiguration)

// routingPlan is a resolved Routing: the model and its engines.
type routingPlan struct {
	cfg     *config.Config
	model   state.ModelID
	engines []config.Engine // of model, in file order
}

// resolveRouting validates rc.Routing and fills rc.Fleet, rc.Model.BlockTokens, rc.names and
// rc.factories from it.
func (rc *resolved) resolveRouting() error {
	rt := rc.Routing
	switch {
	case rt.Config == nil:
		return &configError{msg: "sim: Config.Routing.Config is nil", errs: []error{state.ErrInvalidConfiguration}}
	case rc.Fleet != (Fleet{}) || rc.Policies != nil || rc.Factories != nil || rc.Admission != nil:
		return ErrRoutingConflict
	}
	if err := rt.Config.Validate(); err != nil {
		return wrapf(err, "Config.Routing")
	}
	p := &routingPlan{cfg: rt.Config, model: rt.Model}
	if p.model == "" {
		p.model = state.ModelID(rt.Config.Models[0].ID) // Validate: at least one model
	}
	found := false
	for i := range rt.Config.Models {
		found = found || state.ModelID(rt.Config.Models[i].ID) == p.model
	}
	if !found {
		return &configError{msg: fmt.Sprintf("sim: Config.Routing.Model %q is not a model of the configuration", p.model),
			errs: []error{state.ErrInvalidConfiguration}}
	}
	for _, e := range rt.Config.Engines {
		if state.ModelID(e.Model) != p.model {
			continue
		}
		p.engines = append(p.engines, e)
		switch e.Stage {
		case "prefill":
			rc.Fleet.Prefill++
		case "decode":
			rc.Fleet.Decode++
		default:
			rc.Fleet.Plain++
		}
	}
	if len(p.engines) == 0 {
		return fmt.Errorf("%w: the configuration lists no engines of model %q", ErrEmptyFleet, p.model)
	}
	bt := cmp.Or(rt.Config.KV.BlockTokens, configBlockTokens) // what config.New hashes
	if rc.Model.BlockTokens != 0 && rc.Model.BlockTokens != bt {
		return fmt.Errorf("%w: EngineModel.BlockTokens %d, but kv.block_tokens is %d", ErrRoutingConflict, rc.Model.BlockTokens, bt)
	}
	rc.Model.BlockTokens = bt
	rc.routing = p
	name := rt.Name
	if name == "" {
		name = DefaultRoutingName
	}
	rc.names = []string{name}
	rc.factories = []PolicyFactory{nil}
	return nil
}

// newIndex builds a replica's prefix index: the file's hashing and caps for a Routing run, else
// the engine model's block size with the defaults.
func (p *routingPlan) newIndex(blockTokens int, now func() time.Time) (*kvindex.Index, error) {
	hc := kvindex.HasherConfig{BlockTokens: blockTokens}
	var o kvindex.Options
	if p != nil {
		kv := &p.cfg.KV
		hc.Seed, hc.Namespace = kv.HashSeed, kv.Namespace
		o = kvindex.Options{MaxBlocks: kv.MaxBlocks, MaxApproxBlocks: kv.MaxApproxBlocks, ApproxTTL: kv.ApproxTTL.D(),
			ExpectedBlocks: kv.ExpectedBlocks, ExpectedHolderBlocks: kv.ExpectedHolderBlocks}
	}
	o.Now = now
	h, err := kvindex.NewHasher(hc)
	if err != nil {
		return nil, err
	}
	return kvindex.NewIndex(h, o)
}

// newLoadTable builds a replica's load table on the virtual clock, with the file's freshness for
// a Routing run.
func (p *routingPlan) newLoadTable(now func() time.Time) *loadmon.Table {
	if p != nil && p.cfg.Load.Freshness != 0 {
		return loadmon.NewTable(loadmon.WithClock(now), loadmon.WithFreshness(p.cfg.Load.Freshness.D()))
	}
	return loadmon.NewTable(loadmon.WithClock(now))
}

// affinityOptions returns the options of a run's affinity store: in memory, on the virtual clock,
// with the default idle timeout (600 s of virtual time), or the file's for a Routing run. Expired
// bindings are invisible at once; the replay runs no sweeper, since a trace holds at most a few
// thousand sessions.
func (p *routingPlan) affinityOptions(now func() time.Time) affinity.Options {
	o := affinity.Options{Now: now}
	if p != nil {
		o.IdleTimeout = p.cfg.Affinity.IdleTimeout.D()
	}
	return o
}

// simConfig returns the copy of the configuration a replica's Router is built from: the engines
// without load endpoints, KV-event publishers or DP ranks (the simulation feeds the load table and
// index itself, one rank per engine), and no affinity store setting (the run's in-memory store is
// passed instead).
func (p *routingPlan) simConfig() *config.Config {
	c := *p.cfg
	c.Engines = make([]config.Engine, len(p.cfg.Engines))
	for i, e := range p.cfg.Engines {
		e.Load, e.KVEvents, e.DPRanks, e.DPRankStart, e.Ranks = nil, nil, 0, 0, nil
		c.Engines[i] = e
	}
	c.Affinity.Store, c.Affinity.Redis = "", nil
	return &c
}

// newRouter builds replica rep's Router from the configuration over the simulated registry and the
// replica's own state.
func (p *routingPlan) newRouter(r *run, reg state.Registry, rep *replica, rand func(int) int) (*enginepick.Router, error) {
	opts := []config.Option{
		config.WithClock(r.clock), config.WithRand(rand), config.WithHealthInterval(0),
		config.WithLoadTable(rep.load), config.WithInFlight(rep.inflight), config.WithIndex(rep.index),
		config.WithAffinityStore(r.affinity),
	}
	cr, err := config.New(p.simConfig(), reg, opts...)
	if err != nil {
		return nil, err
	}
	if c, ok := flowbridge.Controller(cr.Router); ok { // the file's flow_control block
		flowbridge.SetClock(c, r.clock)
		rep.fc = c.(*flowcontrol.Controller)
	}
	return cr.Router, nil // with no pollers, publishers or health checks, nothing to close
}
