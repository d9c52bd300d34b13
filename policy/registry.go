package policy

import (
	"fmt"
	"slices"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/enginepick/enginepick/affinity"
	"github.com/enginepick/enginepick/kvindex"
	"github.com/enginepick/enginepick/state"
)

// Builder builds one type of policy from its configuration block, as grpc-go's balancer.Builder
// builds a balancer from its service-config entry (docs/design.md §14.2). A policy attachment in
// the configuration names the type and may carry a block named after it:
//
//	policy:
//	  type: cache_aware
//	  admission: {max_waiting_requests: 16}   # shared by every type
//	  cache_aware: {min_matched_tokens: 512}  # the type's own block
//
// Make one with NewBuilder and add it with Register. Implementations are safe for concurrent use.
type Builder interface {
	// Name is the type's configuration name: non-empty, unique among registered builders.
	Name() string
	// NewOptions returns a pointer to a new, zero options struct, which the configuration decodes
	// the type's block into strictly: fields by their `json` tag, unknown fields rejected. An
	// absent block leaves it zero. If it has a method Validate() error, the configuration calls it
	// once, when the document is validated, and reports an *OptionError with the field's path.
	NewOptions() any
	// Build builds the policy of one engine group from the decoded (and validated) options that
	// NewOptions returned, and the shared state in env. Nil opts means the attachment has no block:
	// the type's defaults. Errors: an *OptionError names the offending field; any other error is
	// reported at the policy attachment.
	Build(opts any, env Env) (Policy, error)
}

// Env is the state a Builder builds a policy from: the handles every policy of one Router shares,
// and the group's admission limits. Each lazily built handle (a prefix source, the affinity store)
// is built once, on its first call, and shared by every policy that asks for it; a policy that
// does not ask leaves it unbuilt.
type Env struct {
	// Config holds the load table, the in-flight counters, the group's admission checker (the
	// attachment's admission limits) and the random source.
	Config Config
	// Stage is the stage of the group the policy serves.
	Stage state.Stage
	// Logger is the Router's logger with warnings rate-limited; never nil.
	Logger *zap.Logger
	// Now is the Router's clock; never nil.
	Now func() time.Time
	// Observer is the Router's observer, nil for none. A policy reports to the optional interfaces
	// it knows (CacheObserver) and ignores the rest.
	Observer any
	// LocalSource returns the prefix source over the Router's shared KV-block index, building the
	// index on the first call.
	LocalSource func() (kvindex.Source, error)
	// RemoteSource returns the prefix source over the host's remote indexer; an error wrapping
	// state.ErrMissingField when the host passed none.
	RemoteSource func() (kvindex.Source, error)
	// AffinityStore returns the affinity store every session and sticky binding shares; an error
	// wrapping state.ErrMissingField when the configuration needs a host store that was not
	// passed.
	AffinityStore func() (affinity.Store, error)
}

// NewBuilder returns a Builder of the policy type name whose block decodes into an O (a struct
// type; struct{} for a type without options) and which build turns into a policy. build must be
// non-nil; it gets a pointer to a zero O when the attachment has no block. The Builder's Build
// returns an error wrapping ErrInvalidConfiguration for options of another type than *O. An empty
// name is refused by Register, not here.
func NewBuilder[O any](name string, build func(opts *O, env Env) (Policy, error)) Builder {
	return &builder[O]{name: name, build: build}
}

type builder[O any] struct {
	name   string
	build  func(*O, Env) (Policy, error)
	stages func(state.Stage) bool // nil: every stage
}

var (
	_ Builder        = (*builder[struct{}])(nil)
	_ stageSupporter = (*builder[struct{}])(nil)
)

func (b *builder[O]) Name() string    { return b.name }
func (b *builder[O]) NewOptions() any { return new(O) }

func (b *builder[O]) Build(opts any, env Env) (Policy, error) {
	if opts == nil {
		opts = new(O)
	}
	o, ok := opts.(*O)
	if !ok {
		return nil, fmt.Errorf("policy: %s: options of type %T, want %T: %w", b.name, opts, o, ErrInvalidConfiguration)
	}
	return b.build(o, env)
}

// SupportsStage is the optional Builder method (Policy), for the stage check the configuration
// makes before building.
func (b *builder[O]) SupportsStage(s state.Stage) bool { return b.stages == nil || b.stages(s) }

// registry holds the builders Register added, after the built-in ones.
var registry = struct {
	sync.RWMutex
	m map[string]Builder
}{m: builtins()}

// Register adds a policy type, which configurations parsed afterwards can name. It is safe for
// concurrent use; call it before parsing the configurations that use the type (in main, say).
// Errors wrap state.ErrDuplicate for a name already registered (the built-in names among them)
// and ErrInvalidConfiguration for a nil builder or an empty name.
func Register(b Builder) error {
	if b == nil || b.Name() == "" {
		return fmt.Errorf("policy: Register: nil builder or empty name: %w", ErrInvalidConfiguration)
	}
	registry.Lock()
	defer registry.Unlock()
	if _, dup := registry.m[b.Name()]; dup {
		return fmt.Errorf("policy: Register: policy type %q: %w: %w", b.Name(), state.ErrDuplicate, ErrInvalidConfiguration)
	}
	registry.m[b.Name()] = b
	return nil
}

// Lookup returns the builder of a policy type (a built-in one or one Register added), or nil and
// false when none is registered under name. Safe for concurrent use.
func Lookup(name string) (Builder, bool) {
	registry.RLock()
	defer registry.RUnlock()
	b, ok := registry.m[name]
	return b, ok
}

// Names returns the registered policy types, built-in ones included, sorted, in a new slice the
// caller owns. Safe for concurrent use.
func Names() []string {
	registry.RLock()
	defer registry.RUnlock()
	names := make([]string, 0, len(registry.m))
	for n := range registry.m {
		names = append(names, n)
	}
	slices.Sort(names)
	return names
}

// OptionError reports one invalid option of a policy. It matches its cause (one of state's
// ErrOutOfRange, ErrConflict, ErrBadValue, ErrMissingField …) and ErrInvalidConfiguration with
// errors.Is; the configuration reports it at the field's path.
type OptionError struct {
	// Policy is the policy's type name.
	Policy string
	// Field names the option: its key in the policy's configuration block when the error comes
	// from the configuration, else its Go field.
	Field string
	// Msg says what is wrong with the value ("1.5: must be in (0, 1]").
	Msg string
	// Cause is the cause sentinel.
	Cause error
}

// Error implements error: `policy: cache_aware: min_match_ratio: 1.5: must be in (0, 1]`.
func (e *OptionError) Error() string {
	return fmt.Sprintf("policy: %s: %s: %s", e.Policy, e.Field, e.Msg)
}

// Unwrap returns the cause and ErrInvalidConfiguration.
func (e *OptionError) Unwrap() []error { return []error{e.Cause, ErrInvalidConfiguration} }

// optionErr builds an *OptionError.
func optionErr(policy, field string, cause error, format string, args ...any) *OptionError {
	return &OptionError{Policy: policy, Field: field, Msg: fmt.Sprintf(format, args...), Cause: cause}
}
