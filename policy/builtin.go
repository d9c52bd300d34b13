package policy

import (
	"errors"
	"math"
	"reflect"
	"strings"
	"time"

	"github.com/enginepick/enginepick/internal/label"
	"github.com/enginepick/enginepick/state"
)

// builtins returns the library's policy types, by name (docs/design.md §14.2).
func builtins() map[string]Builder {
	m := map[string]Builder{}
	for _, b := range []Builder{
		NewBuilder(label.RoundRobin, func(_ *struct{}, env Env) (Policy, error) { return NewRoundRobin(env.Config) }),
		NewBuilder(label.Random, func(_ *struct{}, env Env) (Policy, error) { return NewRandom(env.Config) }),
		NewBuilder(label.PowerOfTwo, func(_ *struct{}, env Env) (Policy, error) { return NewPowerOfN(env.Config, 2) }),
		NewBuilder(label.PowerOfN, func(o *powerOfNBlock, env Env) (Policy, error) {
			return NewPowerOfN(env.Config, deref(o.Choices, defaultChoices))
		}),
		NewBuilder(label.LeastLoad, func(_ *struct{}, env Env) (Policy, error) { return NewLeastLoad(env.Config) }),
		NewBuilder(label.SessionAware, buildSessionAware),
		NewBuilder(label.Sticky, buildSticky),
		&builder[cacheAwareBlock]{name: label.CacheAware, build: buildCacheAware,
			stages: func(s state.Stage) bool { return s != state.StageDecode }},
	} {
		m[b.Name()] = b
	}
	return m
}

func deref[T any](p *T, def T) T {
	if p == nil {
		return def
	}
	return *p
}

// keyOf returns the configuration key of a block's Go field (its json tag), or the Go name when
// the block has no such field.
func keyOf(block any, goField string) string {
	if f, ok := reflect.TypeOf(block).Elem().FieldByName(goField); ok {
		if k, _, _ := strings.Cut(f.Tag.Get("json"), ","); k != "" {
			return k
		}
	}
	return goField
}

// asBlockError renames an *OptionError of the Go options to the block's key.
func asBlockError(block any, err error) error {
	var oe *OptionError
	if errors.As(err, &oe) {
		c := *oe
		c.Field = keyOf(block, oe.Field)
		return &c
	}
	return err
}

// powerOfNBlock is power_of_n's block.
type powerOfNBlock struct {
	// Choices is N; unset means 2, otherwise >= 1.
	Choices *int `json:"choices,omitempty"`
}

// Validate checks the block.
func (b *powerOfNBlock) Validate() error {
	if b.Choices != nil && *b.Choices < 1 {
		return optionErr(label.PowerOfN, "choices", state.ErrOutOfRange, "%d: must be >= 1", *b.Choices)
	}
	return nil
}

// sessionAwareBlock is session_aware's block (SessionAwareOptions).
type sessionAwareBlock struct {
	Choices               *int  `json:"choices,omitempty"`
	FallbackOnUnavailable *bool `json:"fallback_on_unavailable,omitempty"`
}

// Validate checks the block.
func (b *sessionAwareBlock) Validate() error {
	if b.Choices != nil && *b.Choices < 1 {
		return optionErr(label.SessionAware, "choices", state.ErrOutOfRange, "%d: must be >= 1", *b.Choices)
	}
	return nil
}

func buildSessionAware(b *sessionAwareBlock, env Env) (Policy, error) {
	st, err := env.AffinityStore()
	if err != nil {
		return nil, err
	}
	return NewSessionAware(env.Config, SessionAwareOptions{Store: st, Choices: deref(b.Choices, 0),
		FallbackOnUnavailable: deref(b.FallbackOnUnavailable, false)})
}

// stickyBlock is sticky's block (StickyOptions): store mode unless rendezvous.
type stickyBlock struct {
	Fallback              string   `json:"fallback,omitempty"`
	Rendezvous            *bool    `json:"rendezvous,omitempty"`
	LoadFactor            *float64 `json:"load_factor,omitempty"`
	FallbackOnUnavailable *bool    `json:"fallback_on_unavailable,omitempty"`
}

func (b *stickyBlock) options() StickyOptions {
	return StickyOptions{Fallback: b.Fallback, Rendezvous: deref(b.Rendezvous, false), LoadFactor: deref(b.LoadFactor, 0),
		FallbackOnUnavailable: deref(b.FallbackOnUnavailable, false)}
}

// Validate checks the block with StickyOptions's rules; an explicit load_factor must be >= 1.
func (b *stickyBlock) Validate() error {
	if b.Fallback == "load_based" {
		return optionErr(label.Sticky, "fallback", state.ErrRemovedOption, `fallback "load_based" was renamed least_load: use least_load instead`)
	}
	if b.LoadFactor != nil && *b.LoadFactor == 0 {
		return optionErr(label.Sticky, "load_factor", state.ErrOutOfRange, "0: must be >= 1")
	}
	return asBlockError(b, b.options().check())
}

func buildSticky(b *stickyBlock, env Env) (Policy, error) {
	o := b.options()
	if !o.Rendezvous {
		st, err := env.AffinityStore()
		if err != nil {
			return nil, err
		}
		o.Store = st
	}
	return NewSticky(env.Config, o)
}

// cacheAwareBlock is cache_aware's block (CacheAwareOptions). Unset fields take the policy's
// defaults; an explicit zero where the option's zero means its default is out of range.
type cacheAwareBlock struct {
	// PrefixSource is "local" (the default: the shared KV-block index) or "remote" (the host's
	// remote indexer).
	PrefixSource               string   `json:"prefix_source,omitempty"`
	MinMatchedTokens           *uint64  `json:"min_matched_tokens,omitempty"`
	MinMatchRatio              *float64 `json:"min_match_ratio,omitempty"`
	CandidateMinEngines        *int     `json:"candidate_min_engines,omitempty"`
	CandidateRatio             *float64 `json:"candidate_ratio,omitempty"`
	CandidateMaxEngines        *int     `json:"candidate_max_engines,omitempty"`
	SwitchMarginTokens         *uint64  `json:"switch_margin_tokens,omitempty"`
	PressureGuard              *bool    `json:"pressure_guard,omitempty"`
	PressureAbsThresholdTokens *uint64  `json:"pressure_abs_threshold_tokens,omitempty"`
	PressureAbsThresholdMs     *uint64  `json:"pressure_abs_threshold_ms,omitempty"`
	PressureRelThreshold       *float64 `json:"pressure_rel_threshold,omitempty"`
	EngineQueueLimit           *uint64  `json:"engine_queue_limit,omitempty"`
	SaturationQueueFloor       *uint64  `json:"saturation_queue_floor,omitempty"`
	MinLoadChoices             *int     `json:"min_load_choices,omitempty"`
	RoutePlacements            *bool    `json:"route_placements,omitempty"`
	CostComparison             *bool    `json:"cost_comparison,omitempty"`
	CostMarginTokens           *uint64  `json:"cost_margin_tokens,omitempty"`
	RecomputeFactor            *float64 `json:"recompute_factor,omitempty"`
}

func (b *cacheAwareBlock) options() CacheAwareOptions {
	o := CacheAwareOptions{
		MinMatchedTokens:           deref(b.MinMatchedTokens, 0),
		MinMatchRatio:              deref(b.MinMatchRatio, 0),
		CandidateMinEngines:        deref(b.CandidateMinEngines, 0),
		CandidateRatio:             deref(b.CandidateRatio, 0),
		CandidateMaxEngines:        deref(b.CandidateMaxEngines, 0),
		SwitchMarginTokens:         b.SwitchMarginTokens,
		DisablePressureGuard:       !deref(b.PressureGuard, true),
		PressureAbsThresholdTokens: deref(b.PressureAbsThresholdTokens, 0),
		PressureRelThreshold:       deref(b.PressureRelThreshold, 0),
		EngineQueueLimit:           b.EngineQueueLimit,
		SaturationQueueFloor:       b.SaturationQueueFloor,
		MinLoadChoices:             deref(b.MinLoadChoices, 0),
		DisableRoutePlacements:     !deref(b.RoutePlacements, true),
		DisableCostComparison:      !deref(b.CostComparison, true),
		CostMarginTokens:           b.CostMarginTokens,
		RecomputeFactor:            deref(b.RecomputeFactor, 0),
	}
	if b.PressureAbsThresholdMs != nil {
		o.PressureAbsThreshold = time.Duration(*b.PressureAbsThresholdMs) * time.Millisecond
	}
	return o
}

// Validate checks what only the block can get wrong (a prefix source name, an explicit zero, a
// tuning of a comparison the block turns off), then the options with CacheAwareOptions's own rules
// (docs/design.md §9 and §14.4).
func (b *cacheAwareBlock) Validate() error {
	fail := func(field string, cause error, format string, args ...any) error {
		return optionErr(label.CacheAware, field, cause, format, args...)
	}
	if b.PrefixSource != "" && b.PrefixSource != "local" && b.PrefixSource != "remote" {
		return fail("prefix_source", state.ErrBadValue, "%q: want local or remote", b.PrefixSource)
	}
	for _, z := range []struct {
		name string
		zero bool
	}{
		{"min_matched_tokens", b.MinMatchedTokens != nil && *b.MinMatchedTokens == 0},
		{"min_match_ratio", b.MinMatchRatio != nil && *b.MinMatchRatio == 0},
		{"candidate_min_engines", b.CandidateMinEngines != nil && *b.CandidateMinEngines == 0},
		{"candidate_ratio", b.CandidateRatio != nil && *b.CandidateRatio == 0},
		{"candidate_max_engines", b.CandidateMaxEngines != nil && *b.CandidateMaxEngines == 0},
		{"pressure_abs_threshold_tokens", b.PressureAbsThresholdTokens != nil && *b.PressureAbsThresholdTokens == 0},
		{"pressure_abs_threshold_ms", b.PressureAbsThresholdMs != nil && *b.PressureAbsThresholdMs == 0},
		{"pressure_rel_threshold", b.PressureRelThreshold != nil && *b.PressureRelThreshold == 0},
		{"min_load_choices", b.MinLoadChoices != nil && *b.MinLoadChoices == 0},
		{"recompute_factor", b.RecomputeFactor != nil && *b.RecomputeFactor == 0},
	} {
		if z.zero {
			return fail(z.name, state.ErrOutOfRange, "0: out of range (unset means the default)")
		}
	}
	if b.PressureAbsThresholdMs != nil && *b.PressureAbsThresholdMs > math.MaxInt64/uint64(time.Millisecond) {
		return fail("pressure_abs_threshold_ms", state.ErrOutOfRange, "%d: too large", *b.PressureAbsThresholdMs)
	}
	for _, t := range []struct {
		name, off  string
		set, isOff bool
	}{
		{"pressure_abs_threshold_tokens", "pressure_guard", b.PressureAbsThresholdTokens != nil, b.PressureGuard != nil && !*b.PressureGuard},
		{"pressure_abs_threshold_ms", "pressure_guard", b.PressureAbsThresholdMs != nil, b.PressureGuard != nil && !*b.PressureGuard},
		{"pressure_rel_threshold", "pressure_guard", b.PressureRelThreshold != nil, b.PressureGuard != nil && !*b.PressureGuard},
		{"cost_margin_tokens", "cost_comparison", b.CostMarginTokens != nil, b.CostComparison != nil && !*b.CostComparison},
		{"recompute_factor", "cost_comparison", b.RecomputeFactor != nil, b.CostComparison != nil && !*b.CostComparison},
	} {
		if t.set && t.isOff {
			return fail(t.name, state.ErrConflict, "%s tunes what %s false turns off", t.name, t.off)
		}
	}
	o := b.options()
	_, err := o.resolve()
	return asBlockError(b, err)
}

func buildCacheAware(b *cacheAwareBlock, env Env) (Policy, error) {
	o := b.options()
	var err error
	if b.PrefixSource == "remote" {
		o.Source, err = env.RemoteSource()
	} else {
		o.Source, err = env.LocalSource()
	}
	if err != nil {
		return nil, err
	}
	o.Logger = env.Logger
	if co, ok := env.Observer.(CacheObserver); ok {
		o.Observer = co
	}
	p, err := NewCacheAware(env.Config, o)
	return p, asBlockError(b, err)
}

// ReadsReportedLoad is the optional Policy method: true when the queue gate is on
// (CacheAwareOptions.EngineQueueLimit).
func (p *cacheAware) ReadsReportedLoad() bool { return p.queueCap > 0 }
