package policy

import (
	"context"
	"fmt"
	"math"

	"github.com/cespare/xxhash/v2"

	"github.com/enginepick/enginepick/admission"
	"github.com/enginepick/enginepick/affinity"
	"github.com/enginepick/enginepick/internal/flowbridge"
	"github.com/enginepick/enginepick/internal/label"
	"github.com/enginepick/enginepick/state"
)

// StickyOptions configures Sticky. Exactly one mode: a Store (bindings shared through it), or
// Rendezvous (stateless hashing, no Store).
type StickyOptions struct {
	// Store holds the routing-key bindings. Required unless Rendezvous; must be nil with it.
	Store affinity.Store
	// Fallback names the policy for new, unbound and keyless routing keys: round_robin
	// (default, also ""), random, power_of_two or least_load. It is built with
	// admission.Limits{}; the sticky policy checks its pick with its own admission. In Rendezvous mode it
	// serves only keyless requests.
	Fallback string
	// Rendezvous selects the stateless mode: rendezvous (highest random weight) hashing of the
	// routing key over the candidates, with xxhash. Every router replica computes the same
	// engine without coordination, and a membership change moves only the keys of the engine
	// that left or joined.
	Rendezvous bool
	// LoadFactor, in Rendezvous mode, bounds load: a candidate is skipped when its router-local
	// in-flight count has reached ⌈LoadFactor × (total in-flight + 1) ÷ candidates⌉, so that
	// after this request no engine holds more than LoadFactor times the mean (consistent
	// hashing with bounded loads, Mirrokni, Thorup and Zadimoghaddam, SODA 2018). The key
	// then goes to its highest-weight engine below the bound; one always exists. 0 means
	// unbounded; otherwise it must be finite and ≥ 1. Invalid without Rendezvous.
	LoadFactor float64
	// FallbackOnUnavailable: as SessionAwareOptions.FallbackOnUnavailable.
	FallbackOnUnavailable bool
}

// sticky is the policy NewSticky returns.
type sticky struct {
	core       affinityCore // store mode
	rendezvous bool
	loadFactor float64
}

var _ Policy = (*sticky)(nil)

// NewSticky returns a sticky policy. Errors wrap ErrInvalidConfiguration: neither or both of
// Store and Rendezvous, an unknown Fallback, a LoadFactor that is negative, below 1, not finite
// or set without Rendezvous, or a nil required Config handle.
//
// The policy keeps each routing key (Request.RoutingKey) on one engine (docs/design.md §12).
//
// With a Store it follows NewSessionAware's rules exactly — reuse of an admitted binding whatever its
// pressure, binding only after admission, concurrent winners checked, rejections never rebinding
// — with its own namespace, the configured fallback, and the labels sticky_primary,
// sticky_assigned and no_routing_key.
//
// In Rendezvous mode it keeps no state: the engine is the candidate with the highest weight
// fmix64(xxhash(engine ID) XOR xxhash(routing key)), optionally below the load bound, and admission
// is checked once on it (rendezvous, or rendezvous_bounded when the bound moved the
// key); a rejection is returned, never replaced. A keyless request takes the fallback's pick,
// checked (no_routing_key). Pick errors are those of NewSessionAware's policy; Rendezvous
// mode allocates nothing.
func NewSticky(cfg Config, opts StickyOptions) (Policy, error) {
	fail := func(format string, args ...any) (Policy, error) {
		return nil, fmt.Errorf("policy: %s: "+format+": %w", append([]any{label.Sticky}, append(args, ErrInvalidConfiguration)...)...)
	}
	if err := cfg.validate(label.Sticky); err != nil {
		return nil, err
	}
	switch {
	case opts.Rendezvous && opts.Store != nil:
		return fail("StickyOptions.Store is set with Rendezvous: choose one mode")
	case !opts.Rendezvous && opts.Store == nil:
		return fail("StickyOptions.Store is nil and Rendezvous is off: choose one mode")
	}
	if err := opts.check(); err != nil {
		return nil, err
	}
	fb := cfg
	fb.Admission = admission.Limits{}
	var fallback Policy
	var err error
	switch opts.Fallback {
	case "", label.RoundRobin:
		fallback, err = NewRoundRobin(fb)
	case label.Random:
		fallback, err = NewRandom(fb)
	case label.PowerOfTwo:
		fallback, err = NewPowerOfN(fb, 2)
	case label.LeastLoad:
		fallback, err = NewLeastLoad(fb)
	}
	if err != nil {
		return nil, err
	}
	return &sticky{
		core: affinityCore{
			cfg: cfg, store: opts.Store, namespace: stickyNamespace, fallback: fallback,
			failOpen: opts.FallbackOnUnavailable, name: label.Sticky,
			primary: label.ReasonStickyPrimary, assigned: label.ReasonStickyAssigned, noKey: label.ReasonNoRoutingKey,
		},
		rendezvous: opts.Rendezvous,
		loadFactor: opts.LoadFactor,
	}, nil
}

// Pick implements Policy. Rendezvous mode allocates nothing.
func (p *sticky) Pick(ctx context.Context, engines []state.Engine, req *Request) (Pick, error) {
	key := ""
	if req != nil {
		key = req.RoutingKey
	}
	if !p.rendezvous {
		return p.core.pick(ctx, engines, req, key)
	}
	if len(engines) == 0 {
		return Pick{}, ErrNoCandidates
	}
	if key == "" {
		return p.core.fallbackPick(ctx, engines, req, "", label.ReasonNoRoutingKey)
	}
	if len(key) > affinity.MaxKeyBytes {
		return Pick{}, fmt.Errorf("policy: %s: %w: key of %d bytes, limit %d", label.Sticky, affinity.ErrInvalidKey, len(key), affinity.MaxKeyBytes)
	}
	i, reason := p.rendezvousIndex(engines, key)
	return p.core.cfg.pickKeyed(flowbridge.PrefillHold(ctx), engines[i], key, reason, stageOf(req))
}

// rendezvousWindow is how many candidates' in-flight counts rendezvousIndex keeps on the stack
// between its two passes; larger groups read the counters twice.
const rendezvousWindow = 64

// rendezvousIndex returns the index of the key's engine and the reason label.
func (p *sticky) rendezvousIndex(engines []state.Engine, key string) (int, string) {
	seed := xxhash.Sum64String(key)
	bounded := p.loadFactor > 0
	var counts [rendezvousWindow]uint64
	var limit uint64
	if bounded {
		var total uint64
		for i, e := range engines {
			c := p.core.cfg.InFlight.Count(e.ID())
			if i < rendezvousWindow {
				counts[i] = c
			}
			total += c
		}
		limit = uint64(math.Ceil(p.loadFactor * float64(total+1) / float64(len(engines))))
	}
	best, top := -1, -1
	var bestW, topW uint64
	for i, e := range engines {
		w := rendezvousWeight(seed, e.ID())
		if top < 0 || w > topW {
			top, topW = i, w
		}
		if bounded {
			c := counts[min(i, rendezvousWindow-1)]
			if i >= rendezvousWindow {
				c = p.core.cfg.InFlight.Count(e.ID())
			}
			if c >= limit {
				continue
			}
		}
		if best < 0 || w > bestW {
			best, bestW = i, w
		}
	}
	if best < 0 {
		// Counters moved between the passes (concurrent dispatches) so that every engine
		// reached the bound: the key's own engine.
		return top, label.ReasonRendezvousBounded
	}
	if best != top {
		return best, label.ReasonRendezvousBounded
	}
	return best, label.ReasonRendezvous
}

// rendezvousWeight is the engine's weight for the key whose xxhash is seed: the engine ID's xxhash
// XORed with the key's, through the 64-bit finalizer of MurmurHash3 (fmix64), so that every key
// orders the engines independently. Combining two hashes with a mixer, instead of hashing key and
// ID together per engine, is the scheme of dgryski/go-rendezvous `rendezvous.go`; it costs about half
// the instructions of a seeded xxhash digest per engine.
func rendezvousWeight(seed uint64, id state.EngineID) uint64 {
	return fmix64(xxhash.Sum64String(string(id)) ^ seed)
}

// fmix64 is the 64-bit finalizer of MurmurHash3: every input bit affects every output bit.
func fmix64(x uint64) uint64 {
	x ^= x >> 33
	x *= 0xff51afd7ed558ccd
	x ^= x >> 33
	x *= 0xc4ceb9fe1a85ec53
	x ^= x >> 33
	return x
}

// check applies the rules on Fallback and LoadFactor, which NewSticky and the configuration's
// sticky block share; errors are *OptionError values.
func (opts StickyOptions) check() error {
	switch opts.Fallback {
	case "", label.RoundRobin, label.Random, label.PowerOfTwo, label.LeastLoad:
	default:
		return optionErr(label.Sticky, "Fallback", state.ErrBadValue, "%q: want %s, %s, %s or %s", opts.Fallback,
			label.RoundRobin, label.Random, label.PowerOfTwo, label.LeastLoad)
	}
	switch {
	case opts.LoadFactor != 0 && !opts.Rendezvous:
		return optionErr(label.Sticky, "LoadFactor", state.ErrConflict, "%v: bounds rendezvous hashing, so it needs Rendezvous", opts.LoadFactor)
	case opts.LoadFactor != 0 && !(opts.LoadFactor >= 1 && !math.IsInf(opts.LoadFactor, 1)):
		return optionErr(label.Sticky, "LoadFactor", state.ErrOutOfRange, "%v: must be a finite number >= 1", opts.LoadFactor)
	}
	return nil
}
