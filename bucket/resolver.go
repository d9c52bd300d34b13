package bucket

import (
	"cmp"
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/enginepick/enginepick/kvindex"
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

// SLOPreference says how a TTFT or TPS target orders buckets (docs/design.md
// §2). The zero value is SLODisabled. Preferences only reorder compatible buckets: they never
// relax length or capacity constraints.
type SLOPreference uint8

const (
	// SLODisabled ignores the target, valid or not.
	SLODisabled SLOPreference = iota
	// SLOBestEffort puts buckets that do NOT meet the target first, keeping the buckets that can
	// meet it free for requests that need them (legacy `best_effort`).
	SLOBestEffort
	// SLOFirst puts buckets that meet the target first.
	SLOFirst
)

// String returns "disabled", "best_effort" or "slo_first".
func (p SLOPreference) String() string {
	switch p {
	case SLODisabled:
		return "disabled"
	case SLOBestEffort:
		return "best_effort"
	case SLOFirst:
		return "slo_first"
	}
	return fmt.Sprintf("slo_preference(%d)", uint8(p))
}

// Signals are the request facts bucket resolution reads (docs/design.md §2). Token counts
// are signed so that a host's negative value is caught as an invalid signal instead of wrapping.
type Signals struct {
	// InputTokens is the prompt length in tokens; negative is invalid.
	InputTokens int64
	// ExpectedPeakTokens is input plus the output budget, in tokens, when HasExpectedPeak. It must
	// be at least InputTokens. Use ExpectedPeak to add an output budget without overflow.
	ExpectedPeakTokens int64
	HasExpectedPeak    bool
	// TTFTTarget is the request's time-to-first-token target when HasTTFTTarget; it must be > 0
	// when the TTFT preference is enabled.
	TTFTTarget    time.Duration
	HasTTFTTarget bool
	// TPSTarget is the request's decode tokens-per-second target when HasTPSTarget; it must be
	// finite and > 0 when the TPS preference is enabled.
	TPSTarget    float64
	HasTPSTarget bool
}

// ExpectedPeak returns input + maxOutput tokens, or an error wrapping policy.ErrInvalidSignal when
// either is negative or the sum overflows int64 (docs/design.md §2).
func ExpectedPeak(input, maxOutput int64) (int64, error) {
	if input < 0 || maxOutput < 0 {
		return 0, fmt.Errorf("bucket: expected peak: negative tokens (input %d, output %d): %w", input, maxOutput, policy.ErrInvalidSignal)
	}
	if input > math.MaxInt64-maxOutput {
		return 0, fmt.Errorf("bucket: expected peak: %d + %d overflows: %w", input, maxOutput, policy.ErrInvalidSignal)
	}
	return input + maxOutput, nil
}

// Request is everything one selection needs: the resolution Signals plus the facts passed through
// to every group's policy.
type Request struct {
	Signals
	// Model is the requested model.
	Model state.ModelID
	// TokenIDs is the tokenized prompt (nil when not tokenized); shared, not modified.
	TokenIDs []uint32
	// SessionKey and RoutingKey are the session and sticky-routing keys; empty means none.
	SessionKey string
	RoutingKey string
	// Memo memoizes prefix lookups across every bucket and stage of this request; create one per
	// request with new(kvindex.Memo). Nil means no memo: each cache-aware pick looks up its source
	// itself (enginepick.Router.Select supplies one).
	Memo *kvindex.Memo
	// Priority and Flow place the request in a Router's flow control (docs/design.md §17): its
	// priority band (higher first) and its fairness key (a tenant, an API key; empty is one flow
	// like any other). Without flow control they are ignored.
	Priority int
	Flow     string
	// Adapter is the LoRA adapter the request asks for, by the name the engines know it by
	// (vLLM lora_name); empty means the base model. Model is then the adapter's base model,
	// whose buckets serve it; every group's policy receives it (policy.Request.Adapter,
	// docs/design.md §18). Select does not check it against the configuration's adapters: one no
	// engine reports is routed as an adapter that must be loaded.
	Adapter string
}

// ResolverOptions configures SLO ordering. The zero value disables both preferences.
type ResolverOptions struct {
	TTFTPreference SLOPreference
	TPSPreference  SLOPreference
}

// Resolver holds one model's buckets and returns, for a request, every length-compatible bucket in
// preference order (docs/design.md §2). It inspects no engines, load or policies.
// Immutable and safe for concurrent use.
type Resolver struct {
	buckets []*Bucket // sorted by (input capacity, rank, ID)
	opts    ResolverOptions
}

// NewResolver validates the buckets and returns a resolver over them. A nil bucket, a duplicate
// ID, or an unknown SLO preference is an error wrapping policy.ErrInvalidConfiguration. An empty
// list is valid: every request then resolves to no bucket.
func NewResolver(buckets []*Bucket, opts ResolverOptions) (*Resolver, error) {
	if opts.TTFTPreference > SLOFirst || opts.TPSPreference > SLOFirst {
		return nil, fmt.Errorf("bucket: resolver: SLO preferences %v/%v: %w", opts.TTFTPreference, opts.TPSPreference, policy.ErrInvalidConfiguration)
	}
	seen := make(map[string]bool, len(buckets))
	sorted := make([]*Bucket, 0, len(buckets))
	for i, b := range buckets {
		if b == nil {
			return nil, fmt.Errorf("bucket: resolver: bucket %d is nil: %w", i, policy.ErrInvalidConfiguration)
		}
		if seen[b.spec.ID] {
			return nil, fmt.Errorf("bucket: resolver: duplicate bucket ID %q: %w", b.spec.ID, policy.ErrInvalidConfiguration)
		}
		seen[b.spec.ID] = true
		sorted = append(sorted, b)
	}
	slices.SortFunc(sorted, func(a, b *Bucket) int {
		return cmp.Or(
			cmp.Compare(a.spec.inputCapacity(), b.spec.inputCapacity()),
			cmp.Compare(a.spec.Rank, b.spec.Rank),
			cmp.Compare(a.spec.ID, b.spec.ID))
	})
	return &Resolver{buckets: sorted, opts: opts}, nil
}

// Buckets returns every bucket in (input capacity, rank, ID) order. The slice is shared; do not
// modify it.
func (r *Resolver) Buckets() []*Bucket { return r.buckets }

// Resolve returns every compatible bucket in order (possibly none), or an error wrapping
// policy.ErrInvalidSignal.
//
// Rules (docs/design.md §2): a negative input or peak, a
// known peak below the input, or, for an enabled preference, a TTFT target <= 0 or a TPS target
// that is not finite and > 0 is an invalid signal. A bucket is compatible when
// MinInputTokens <= input <= MaxInputTokens and its context capacity holds the peak when known,
// else the input. Order: SLO penalty (SLOFirst adds 1 for a bucket that misses a supplied target,
// SLOBestEffort adds 1 for one that meets it), then input capacity (unbounded last), rank, ID.
func (r *Resolver) Resolve(s Signals) ([]*Bucket, error) {
	return r.resolveInto(nil, s)
}

// resolveInto is Resolve appending to dst; with a dst of sufficient capacity it allocates nothing.
func (r *Resolver) resolveInto(dst []*Bucket, s Signals) ([]*Bucket, error) {
	if s.InputTokens < 0 {
		return dst, fmt.Errorf("bucket: resolve: input tokens %d: %w", s.InputTokens, policy.ErrInvalidSignal)
	}
	need := uint64(s.InputTokens)
	if s.HasExpectedPeak {
		if s.ExpectedPeakTokens < s.InputTokens {
			return dst, fmt.Errorf("bucket: resolve: expected peak %d below input %d: %w", s.ExpectedPeakTokens, s.InputTokens, policy.ErrInvalidSignal)
		}
		need = uint64(s.ExpectedPeakTokens)
	}
	ttft := r.opts.TTFTPreference != SLODisabled && s.HasTTFTTarget
	if ttft && s.TTFTTarget <= 0 {
		return dst, fmt.Errorf("bucket: resolve: TTFT target %v must be > 0: %w", s.TTFTTarget, policy.ErrInvalidSignal)
	}
	tps := r.opts.TPSPreference != SLODisabled && s.HasTPSTarget
	if tps && !(s.TPSTarget > 0 && !math.IsInf(s.TPSTarget, 1)) {
		return dst, fmt.Errorf("bucket: resolve: TPS target %v must be finite and > 0: %w", s.TPSTarget, policy.ErrInvalidSignal)
	}
	input := uint64(s.InputTokens)
	maxPenalty := 0
	if ttft {
		maxPenalty++
	}
	if tps {
		maxPenalty++
	}
	// One pass per penalty level keeps the (capacity, rank, ID) order inside each level without
	// sorting or allocating.
	for level := 0; level <= maxPenalty; level++ {
		for _, b := range r.buckets {
			sp := &b.spec
			if input < sp.MinInputTokens || input > unbounded(sp.MaxInputTokens) || need > unbounded(sp.MaxContextTokens) {
				continue
			}
			if r.penalty(sp, s, ttft, tps) == level {
				dst = append(dst, b)
			}
		}
	}
	return dst, nil
}

func (r *Resolver) penalty(sp *Spec, s Signals, ttft, tps bool) int {
	p := 0
	if ttft {
		meets := sp.TTFTEstimate > 0 && sp.TTFTEstimate <= s.TTFTTarget
		p += slotPenalty(r.opts.TTFTPreference, meets)
	}
	if tps {
		meets := sp.TPSEstimate > 0 && sp.TPSEstimate >= s.TPSTarget
		p += slotPenalty(r.opts.TPSPreference, meets)
	}
	return p
}

func slotPenalty(p SLOPreference, meets bool) int {
	if (p == SLOFirst && !meets) || (p == SLOBestEffort && meets) {
		return 1
	}
	return 0
}
