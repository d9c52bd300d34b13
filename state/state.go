package state

import (
	"errors"
	"fmt"
)

// ModelID names the model an engine serves, as the host's registry spells it (for example
// "meta-llama/Llama-3.1-8B-Instruct"). The empty ModelID is a valid, distinct model name.
type ModelID string

// EngineID is an engine's stable, unique identity, usually its base URL ("http://10.0.0.7:30000").
// IDs are compared byte for byte: "http://b/" and "http://b" are different engines
// (docs/design.md §4).
type EngineID string

// Stage is the role an engine plays for a request: Plain (one engine runs prefill and decode),
// Prefill or Decode (a prefill/decode-disaggregated, "PD", pair). The zero value is StagePlain.
type Stage uint8

// The three stages. A PD bucket picks one StagePrefill and one StageDecode engine; a plain bucket
// picks one StagePlain engine (docs/design.md §3).
const (
	StagePlain Stage = iota
	StagePrefill
	StageDecode
)

// Sentinel errors shared across packages. They live here, in the lowest package, so that every
// layer (kvindex, loadmon, admission, policy, bucket) wraps the same values and a host's
// errors.Is check works wherever the error was raised. Package policy re-exports them under the
// names the design uses (policy.ErrInvalidSignal, policy.ErrInvalidConfiguration).
var (
	// ErrInvalidSignal reports a request fact that cannot be routed: negative or overflowing token
	// counts, an expected peak below the input length, a malformed SLO target, a query a prefix
	// index rejected. The request fails (HTTP 500 in the bucket loop); it is never retried on
	// another bucket.
	ErrInvalidSignal = errors.New("invalid signal")

	// ErrInvalidConfiguration reports configuration that cannot work: an empty or duplicate ID, an
	// inverted range, a nil dependency, a policy attached to a stage it cannot serve. Constructors
	// return it wrapped with the field and value; the bucket loop stops on it.
	ErrInvalidConfiguration = errors.New("invalid configuration")
)

var stageNames = [...]string{StagePlain: "plain", StagePrefill: "prefill", StageDecode: "decode"}

// String returns "plain", "prefill" or "decode", or "stage(N)" for a value outside the three.
func (s Stage) String() string {
	if int(s) < len(stageNames) {
		return stageNames[s]
	}
	return fmt.Sprintf("stage(%d)", uint8(s))
}

// Valid reports whether s is one of the three defined stages.
func (s Stage) Valid() bool { return int(s) < len(stageNames) }

// ParseStage parses "plain", "prefill" or "decode" (exact, lower case). Any other text returns an
// error wrapping ErrInvalidConfiguration that names the text.
func ParseStage(text string) (Stage, error) {
	for i, name := range stageNames {
		if text == name {
			return Stage(i), nil
		}
	}
	return 0, fmt.Errorf("state: stage %q: want plain, prefill or decode: %w", text, ErrInvalidConfiguration)
}

// MarshalText implements encoding.TextMarshaler with the names ParseStage accepts. An invalid
// stage is an error wrapping ErrInvalidConfiguration.
func (s Stage) MarshalText() ([]byte, error) {
	if !s.Valid() {
		return nil, fmt.Errorf("state: stage %d: %w", uint8(s), ErrInvalidConfiguration)
	}
	return []byte(s.String()), nil
}

// UnmarshalText implements encoding.TextUnmarshaler through ParseStage. On error s is unchanged.
func (s *Stage) UnmarshalText(text []byte) error {
	v, err := ParseStage(string(text))
	if err != nil {
		return err
	}
	*s = v
	return nil
}

// Engine is one inference server (a vLLM or SGLang worker) as the host's registry sees it. The
// host implements it; enginepick only reads it.
//
// Implementations must be safe for concurrent use. Identity matters: a pick is valid only if it is
// one of the exact Engine values handed to the policy (interface equality), so a registry that
// rebuilds its Engine values makes in-progress picks of the old values invalid
// (docs/design.md §4). Implement Engine with a pointer type.
type Engine interface {
	// ID returns the engine's stable, unique identity; it never changes for one value.
	ID() EngineID
	// Model returns the model the engine serves.
	Model() ModelID
	// Stage returns the engine's role. The registry is authoritative for it.
	Stage() Stage
	// Healthy reports whether the host's health checks and circuit breaker allow traffic now.
	Healthy() bool
}

// Registry lists the live engines of a model. The host implements it; its answer is
// authoritative for role and health.
//
// Engines returns every live engine of the model, healthy or not, in any order; an unknown model
// returns nil. The caller must not modify the returned slice: an implementation may return a
// shared, immutable slice to keep the pick path free of allocations. Implementations must be safe
// for concurrent use.
type Registry interface {
	Engines(model ModelID) []Engine
}

// VersionedRegistry is an optional Registry capability. EnginesVersion returns a number that
// changes whenever Engines(model) would return a different set, order or identity of Engine values
// (health changes need not change it). Engine groups detect it and cache their filtered, ID-sorted
// candidates per version, re-checking only health on each pick. A registry that cannot promise
// this must not implement it.
type VersionedRegistry interface {
	Registry
	EnginesVersion(model ModelID) uint64
}

// PDCompatible is an optional Engine capability: a compatibility label the host sets, for
// example the KV-transfer backend and transfer group an engine belongs to ("mooncake/rack-3"). In a
// PD bucket the decode engine is picked only among decode engines whose label equals the chosen
// prefill engine's (docs/design.md §3). An engine without the capability, or whose label is "", is
// unlabelled: unlabelled engines are compatible with each other and with no labelled engine, so a
// fleet that labels nothing pairs as if there were no rule. The label must not change for one
// Engine value, and PDCompatibility must be safe for concurrent use.
type PDCompatible interface {
	PDCompatibility() string
}

// PDCompatibilityOf returns e's PD compatibility label: PDCompatibility() when e implements
// PDCompatible, else "" (unlabelled).
func PDCompatibilityOf(e Engine) string {
	if c, ok := e.(PDCompatible); ok {
		return c.PDCompatibility()
	}
	return ""
}
