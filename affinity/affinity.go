package affinity

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/enginepick/enginepick/state"
)

// Defaults of the stores (docs/design.md §12): the session and sticky idle timeout and eviction
// interval of sgl-project/sglang `experimental/sgl-router/src/config/types.rs`.
const (
	// DefaultIdleTimeout is how long a binding lives without a hit: 600 s.
	DefaultIdleTimeout = 600 * time.Second
	// defaultSweepInterval is how often MemoryStore.Run sweeps expired bindings: 60 s.
	defaultSweepInterval = 60 * time.Second
)

// MaxKeyBytes is the documented limit, in bytes, of every string field of a Scope (Namespace,
// Model, BucketID, Key): 4 KiB. A longer field is rejected with ErrInvalidKey, so that a client
// header cannot make a store hold or hash unbounded keys.
const MaxKeyBytes = 4096

var (
	// ErrInvalidKey reports a Scope a store refuses: an empty Key, a field longer than
	// MaxKeyBytes, or an invalid Stage. It wraps state.ErrInvalidSignal: a policy returns it and
	// routing stops; no binding is read or written.
	ErrInvalidKey = fmt.Errorf("affinity: invalid scope: %w", state.ErrInvalidSignal)

	// ErrInvalidEngine reports an empty engine ID passed to Bind or Replace. It wraps
	// state.ErrInvalidSignal.
	ErrInvalidEngine = fmt.Errorf("affinity: empty engine ID: %w", state.ErrInvalidSignal)

	// ErrUnavailable is matched (errors.Is) by every *UnavailableError: the store's backend could
	// not answer (Redis unreachable, timed out, failing over). The binding is unknown, not
	// absent; a host can route around it, for example by selecting again without the key.
	ErrUnavailable = errors.New("affinity: store unavailable")
)

// UnavailableError reports a backend failure of one store operation. errors.Is matches
// ErrUnavailable and the cause (for example context.DeadlineExceeded).
type UnavailableError struct {
	// Op is the operation: "lookup", "bind", "replace" or "invalidate".
	Op string
	// Err is the backend's error.
	Err error
}

// Error implements error.
func (e *UnavailableError) Error() string {
	return fmt.Sprintf("affinity: store unavailable: %s: %v", e.Op, e.Err)
}

// Unwrap returns ErrUnavailable and the cause.
func (e *UnavailableError) Unwrap() []error { return []error{ErrUnavailable, e.Err} }

// Scope identifies one binding. Bindings of different scopes never share state: two scopes are
// the same binding only when every field is equal, byte for byte, whatever separators or NUL
// bytes the strings contain (no delimiter aliasing; see AppendEncoded).
type Scope struct {
	// Namespace separates independent users of one store: policy.NewSessionAware uses "session",
	// policy.NewSticky "sticky". May be empty.
	Namespace string
	// Model, BucketID and Stage are the pick's model, bucket and stage: a session bound for
	// prefill says nothing about decode, and one bucket's binding nothing about another's.
	Model    state.ModelID
	BucketID string
	Stage    state.Stage
	// Key is the session or routing key. Must not be empty.
	Key string
}

// Validate returns nil or an error wrapping ErrInvalidKey that names the field: an empty Key, a
// field longer than MaxKeyBytes, or an invalid Stage.
func (s *Scope) Validate() error {
	switch {
	case s.Key == "":
		return fmt.Errorf("%w: empty key", ErrInvalidKey)
	case len(s.Key) > MaxKeyBytes:
		return fmt.Errorf("%w: key of %d bytes, limit %d", ErrInvalidKey, len(s.Key), MaxKeyBytes)
	case len(s.Namespace) > MaxKeyBytes:
		return fmt.Errorf("%w: namespace of %d bytes, limit %d", ErrInvalidKey, len(s.Namespace), MaxKeyBytes)
	case len(s.Model) > MaxKeyBytes:
		return fmt.Errorf("%w: model of %d bytes, limit %d", ErrInvalidKey, len(s.Model), MaxKeyBytes)
	case len(s.BucketID) > MaxKeyBytes:
		return fmt.Errorf("%w: bucket ID of %d bytes, limit %d", ErrInvalidKey, len(s.BucketID), MaxKeyBytes)
	case !s.Stage.Valid():
		return fmt.Errorf("%w: %v", ErrInvalidKey, s.Stage)
	}
	return nil
}

// AppendEncoded appends the scope's canonical byte encoding to dst: each string field as its
// decimal length, ':' and its bytes, in the order Namespace, Model, BucketID, Key, with the
// stage's digit between BucketID and Key. The encoding is prefix-free field by field, so two
// scopes have equal encodings exactly when they are equal (the length-prefix scheme of
// sgl-project/sglang `experimental/sgl-router/src/policies_reorg/session_aware.rs`, extended to
// every field). Remote stores use it as the key name.
func (s *Scope) AppendEncoded(dst []byte) []byte {
	field := func(dst []byte, v string) []byte {
		dst = strconv.AppendInt(dst, int64(len(v)), 10)
		dst = append(dst, ':')
		return append(dst, v...)
	}
	dst = field(dst, s.Namespace)
	dst = field(dst, string(s.Model))
	dst = field(dst, s.BucketID)
	dst = append(dst, '0'+byte(s.Stage))
	return field(dst, s.Key)
}

// Store holds affinity bindings: scope → engine ID. Implementations are safe for concurrent use
// and, across router replicas that share one backend, linearizable per scope: every operation on
// one scope sees the effect of those that completed before it.
//
// A binding is live from its last bind or hit until it has been idle for the store's idle
// timeout: live while now < last use + idle, expired from that instant on (docs/design.md §12).
// An expired binding behaves as absent. A clock that goes backwards never shortens a binding:
// a refresh keeps the later of the current and the new expiry.
//
// Errors: every method returns an error wrapping ErrInvalidKey for a scope Validate rejects,
// before touching the backend, and an *UnavailableError (errors.Is ErrUnavailable) when the
// backend fails; Bind and Replace return ErrInvalidEngine for an empty engine ID.
type Store interface {
	// Lookup returns the engine the scope is bound to and refreshes the binding's idle time.
	// ok is false when the scope has no live binding.
	Lookup(ctx context.Context, scope Scope) (engine state.EngineID, ok bool, err error)

	// Bind is the first bind: if the scope has a live binding, it is refreshed and its engine
	// returned unchanged (racing first binds converge on one engine); otherwise the scope is
	// bound to engine, which is returned.
	Bind(ctx context.Context, scope Scope, engine state.EngineID) (state.EngineID, error)

	// Replace binds the scope to engine only if its live binding is expected, or if it has no
	// live binding; otherwise the current binding wins, is refreshed and its engine returned.
	// The result is the scope's engine after the call.
	Replace(ctx context.Context, scope Scope, expected, engine state.EngineID) (state.EngineID, error)

	// InvalidateEngine removes every binding to engine, in every scope, and returns how many
	// of them were live. Call it when the engine leaves the registry. It does not scan the
	// bindings of other engines.
	InvalidateEngine(ctx context.Context, engine state.EngineID) (int, error)
}
