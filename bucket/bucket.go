package bucket

import (
	"context"
	"fmt"
	"math"
	"sync"
	"time"

	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

// Spec is a bucket's identity and length constraints (docs/design.md §2; token ranges and
// rank belong to the bucket, not its groups).
type Spec struct {
	// ID identifies the bucket; required and unique within a Resolver.
	ID string
	// Rank orders buckets of equal input capacity: lower first.
	Rank int
	// MinInputTokens and MaxInputTokens bound the request's input length, inclusively, in tokens.
	// MaxInputTokens == 0 means no upper bound.
	MinInputTokens uint64
	MaxInputTokens uint64
	// MaxContextTokens is the bucket's context capacity in tokens: it must hold the expected peak
	// when known, else the input. 0 means unbounded.
	MaxContextTokens uint64
	// TTFTEstimate is the bucket's p95 time to first token at capacity; 0 means no estimate, which
	// never matches a TTFT target (docs/design.md §2).
	TTFTEstimate time.Duration
	// TPSEstimate is the bucket's p05 decode tokens per second at capacity; 0 means no estimate,
	// which never matches. Must be finite and non-negative.
	TPSEstimate float64
}

// inputCapacity returns min(MaxInputTokens, MaxContextTokens) with 0 (unbounded) read as
// math.MaxUint64: the primary ordering key (docs/design.md §2).
func (s *Spec) inputCapacity() uint64 {
	return min(unbounded(s.MaxInputTokens), unbounded(s.MaxContextTokens))
}

func unbounded(v uint64) uint64 {
	if v == 0 {
		return math.MaxUint64
	}
	return v
}

// Bucket is either plain (one plain group) or PD (a prefill and a decode group); a PD bucket
// always has both groups, so a partial PD bucket cannot be built (docs/design.md
// §3). Immutable and safe for concurrent use.
type Bucket struct {
	spec    Spec
	plain   GroupPicker
	prefill GroupPicker
	decode  GroupPicker
	// decodeGroup is decode as an *EngineGroup, which picks among the compatible engines only,
	// or nil when it is a host's own GroupPicker, whose pick is checked (detected once, at
	// construction).
	decodeGroup *EngineGroup
}

// NewPlainBucket returns a plain bucket. It returns an error wrapping
// policy.ErrInvalidConfiguration for an invalid Spec (empty ID, MinInputTokens above a bounded
// MaxInputTokens, negative or non-finite estimates), a nil group, or a group whose policy cannot
// serve the plain stage.
func NewPlainBucket(spec Spec, plain GroupPicker) (*Bucket, error) {
	if err := spec.validate(); err != nil {
		return nil, err
	}
	if err := checkGroup(spec.ID, "plain", plain, state.StagePlain); err != nil {
		return nil, err
	}
	return &Bucket{spec: spec, plain: plain}, nil
}

// NewPDBucket returns a PD bucket whose prefill and decode engines always come from these two
// groups. Errors as NewPlainBucket; both groups are required, and a policy that cannot serve its
// stage (CacheAware on decode) is rejected.
func NewPDBucket(spec Spec, prefill, decode GroupPicker) (*Bucket, error) {
	if err := spec.validate(); err != nil {
		return nil, err
	}
	if err := checkGroup(spec.ID, "prefill", prefill, state.StagePrefill); err != nil {
		return nil, err
	}
	if err := checkGroup(spec.ID, "decode", decode, state.StageDecode); err != nil {
		return nil, err
	}
	b := &Bucket{spec: spec, prefill: prefill, decode: decode}
	b.decodeGroup, _ = decode.(*EngineGroup)
	return b, nil
}

func (s *Spec) validate() error {
	if s.ID == "" {
		return fmt.Errorf("bucket: empty bucket ID: %w", policy.ErrInvalidConfiguration)
	}
	if s.MaxInputTokens != 0 && s.MinInputTokens > s.MaxInputTokens {
		return fmt.Errorf("bucket %q: input range [%d, %d] is inverted: %w",
			s.ID, s.MinInputTokens, s.MaxInputTokens, policy.ErrInvalidConfiguration)
	}
	if s.MaxContextTokens != 0 && s.MinInputTokens > s.MaxContextTokens {
		return fmt.Errorf("bucket %q: min input %d exceeds context capacity %d: %w",
			s.ID, s.MinInputTokens, s.MaxContextTokens, policy.ErrInvalidConfiguration)
	}
	if s.TTFTEstimate < 0 {
		return fmt.Errorf("bucket %q: TTFT estimate %v is negative: %w", s.ID, s.TTFTEstimate, policy.ErrInvalidConfiguration)
	}
	if s.TPSEstimate < 0 || math.IsNaN(s.TPSEstimate) || math.IsInf(s.TPSEstimate, 0) {
		return fmt.Errorf("bucket %q: TPS estimate %v must be finite and >= 0: %w", s.ID, s.TPSEstimate, policy.ErrInvalidConfiguration)
	}
	return nil
}

func checkGroup(id, role string, g GroupPicker, stage state.Stage) error {
	if g == nil {
		return fmt.Errorf("bucket %q: nil %s group: %w", id, role, policy.ErrInvalidConfiguration)
	}
	if ss, ok := g.(stageSupporter); ok && !ss.SupportsStage(stage) {
		return fmt.Errorf("bucket %q: the %s group's policy cannot serve stage %s: %w", id, role, stage, policy.ErrInvalidConfiguration)
	}
	return nil
}

// ID returns the bucket ID.
func (b *Bucket) ID() string { return b.spec.ID }

// Spec returns the bucket's constraints.
func (b *Bucket) Spec() Spec { return b.spec }

// IsPD reports whether the bucket picks a prefill + decode pair.
func (b *Bucket) IsPD() bool { return b.plain == nil }

// Selection is one bucket's complete choice: one plain engine, or a prefill and a decode engine
// from the same bucket. A Selection is returned only when every required pick succeeded.
type Selection struct {
	// Bucket is the bucket that supplied the engines.
	Bucket *Bucket
	// Plain is set for a plain bucket; Prefill and Decode for a PD bucket.
	Plain   policy.Pick
	Prefill policy.Pick
	Decode  policy.Pick
}

// IsPD reports whether the selection is a prefill + decode pair.
func (s *Selection) IsPD() bool { return s.Bucket != nil && s.Bucket.IsPD() }

// Engines returns the selected engines in dispatch order: the plain engine, or prefill then
// decode.
func (s *Selection) Engines() []state.Engine {
	if s.IsPD() {
		return []state.Engine{s.Prefill.Engine, s.Decode.Engine}
	}
	return []state.Engine{s.Plain.Engine}
}

// StageError is a failed pick, with the bucket and stage it happened in. Unwrap returns the
// policy's error, so errors.Is/As see the policy taxonomy through it.
type StageError struct {
	// Bucket is the ID of the bucket whose group failed.
	Bucket string
	// Stage is the stage of the failing group.
	Stage state.Stage
	// Err is the group's (usually the policy's) error.
	Err error
}

// Error implements error.
func (e *StageError) Error() string {
	return fmt.Sprintf("bucket %q: %s: %v", e.Bucket, e.Stage, e.Err)
}

// Unwrap returns the cause.
func (e *StageError) Unwrap() error { return e.Err }

var requestPool = sync.Pool{New: func() any { return new(policy.Request) }}

// pickEngines returns a complete selection from b: the plain group, or the prefill group and then the decode
// group, each with a stage-specific policy.Request carrying this bucket's ID. A failure of either
// PD stage returns a *StageError and no selection: a prefill pick is never kept for another bucket
// (docs/design.md §3). A request with negative token counts, or with TokenIDs whose
// length is not InputTokens, is an error wrapping policy.ErrInvalidSignal.
func (b *Bucket) pickEngines(ctx context.Context, registry state.Registry, req *Request) (Selection, error) {
	if req.InputTokens < 0 || (req.HasExpectedPeak && req.ExpectedPeakTokens < 0) {
		return Selection{}, fmt.Errorf("bucket %q: negative token count (input %d, peak %d): %w",
			b.spec.ID, req.InputTokens, req.ExpectedPeakTokens, policy.ErrInvalidSignal)
	}
	if req.TokenIDs != nil && int64(len(req.TokenIDs)) != req.InputTokens {
		return Selection{}, fmt.Errorf("bucket %q: input tokens %d but %d token IDs: %w",
			b.spec.ID, req.InputTokens, len(req.TokenIDs), policy.ErrInvalidSignal)
	}
	preq := requestPool.Get().(*policy.Request)
	defer func() {
		*preq = policy.Request{}
		requestPool.Put(preq)
	}()
	*preq = policy.Request{
		Model:              req.Model,
		BucketID:           b.spec.ID,
		InputTokens:        uint64(req.InputTokens),
		ExpectedPeakTokens: uint64(max(req.ExpectedPeakTokens, 0)),
		HasExpectedPeak:    req.HasExpectedPeak,
		TokenIDs:           req.TokenIDs,
		SessionKey:         req.SessionKey,
		RoutingKey:         req.RoutingKey,
		Memo:               req.Memo,
		Adapter:            req.Adapter,
	}
	sel := Selection{Bucket: b}
	var err error
	if b.plain != nil {
		preq.Stage = state.StagePlain
		if sel.Plain, err = b.plain.Pick(ctx, registry, preq); err != nil {
			return Selection{}, &StageError{Bucket: b.spec.ID, Stage: state.StagePlain, Err: err}
		}
		return sel, nil
	}
	preq.Stage = state.StagePrefill
	if sel.Prefill, err = b.prefill.Pick(ctx, registry, preq); err != nil {
		return Selection{}, &StageError{Bucket: b.spec.ID, Stage: state.StagePrefill, Err: err}
	}
	// The decode engine must be compatible with the prefill engine just picked (docs/design.md §3).
	label := state.PDCompatibilityOf(sel.Prefill.Engine)
	preq.Stage = state.StageDecode
	if b.decodeGroup != nil {
		sel.Decode, err = b.decodeGroup.pick(ctx, registry, preq, label, true)
	} else if sel.Decode, err = b.decode.Pick(ctx, registry, preq); err == nil && state.PDCompatibilityOf(sel.Decode.Engine) != label {
		err = fmt.Errorf("decode engine %q is not compatible with prefill engine %q: %w",
			sel.Decode.Engine.ID(), sel.Prefill.Engine.ID(), ErrNoCompatibleEngine)
	}
	if err != nil {
		return Selection{}, &StageError{Bucket: b.spec.ID, Stage: state.StageDecode, Err: err}
	}
	return sel, nil
}
