package admission

import (
	"bytes"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"strings"

	"go.yaml.in/yaml/v3"

	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/state"
)

// Limit names, as they appear in configuration and in rejection reasons (docs/design.md
// §5).
const (
	LimitRunningRequests      = "max_running_requests"
	LimitWaitingRequests      = "max_waiting_requests"
	LimitKVTokens             = "max_kv_tokens"
	LimitPendingPrefillTokens = "max_pending_prefill_tokens"
	LimitInFlightRequests     = "max_inflight_requests"
)

// limitNames lists the fields in check order.
var limitNames = []string{LimitRunningRequests, LimitWaitingRequests, LimitKVTokens, LimitPendingPrefillTokens, LimitInFlightRequests}

// FieldError reports a Limits field that could not be decoded: an unknown name (Err wraps
// state.ErrUnknownField and lists the known names) or a value that is not a non-negative integer,
// or null, or input that is not an object of fields at all (Err wraps state.ErrBadValue and quotes
// the value; docs/design.md §5). It also matches state.ErrInvalidConfiguration with
// errors.Is. Its message names no Go type.
type FieldError struct {
	// Field is the offending field name as written in the input; empty when the input is not
	// an object at all.
	Field string
	// Err is the cause, wrapping state.ErrUnknownField or state.ErrBadValue.
	Err error
}

// Error implements error: `admission: limits field "max_kv_tokens": bad value "10": want a
// non-negative integer`, or `admission: limits: …` when Field is empty.
func (e *FieldError) Error() string {
	if e.Field == "" {
		return fmt.Sprintf("admission: limits: %v", e.Err)
	}
	return fmt.Sprintf("admission: limits field %q: %v", e.Field, e.Err)
}

// Unwrap returns the cause and state.ErrInvalidConfiguration.
func (e *FieldError) Unwrap() []error { return []error{e.Err, state.ErrInvalidConfiguration} }

// Limits is a set of optional per-engine caps (AdmissionLimits in SGLang's experimental router). A nil cap is not
// checked; Limits{} admits everything. A cap admits while the engine's metric is strictly below
// it, so a cap of 0 rejects every engine whose metric is known. Caps are absolute: they never
// default to capacities the engine reports.
//
// JSON and YAML use the snake_case names below; unknown fields are rejected with a *FieldError
// naming the field.
type Limits struct {
	// MaxRunningRequests caps the reported running requests.
	MaxRunningRequests *uint64 `json:"max_running_requests,omitempty" yaml:"max_running_requests,omitempty"`
	// MaxWaitingRequests caps the reported waiting requests. This is a hard rejection, unlike the
	// cache policy's soft engine_queue_limit.
	MaxWaitingRequests *uint64 `json:"max_waiting_requests,omitempty" yaml:"max_waiting_requests,omitempty"`
	// MaxKVTokens caps the reported KV tokens in use.
	MaxKVTokens *uint64 `json:"max_kv_tokens,omitempty" yaml:"max_kv_tokens,omitempty"`
	// MaxPendingPrefillTokens caps the reported waiting uncached prompt tokens.
	MaxPendingPrefillTokens *uint64 `json:"max_pending_prefill_tokens,omitempty" yaml:"max_pending_prefill_tokens,omitempty"`
	// MaxInFlightRequests caps the router-local in-flight requests (the legacy --max-in-flight).
	MaxInFlightRequests *uint64 `json:"max_inflight_requests,omitempty" yaml:"max_inflight_requests,omitempty"`
}

// Cap returns a pointer to v, for building Limits literals: Limits{MaxKVTokens: admission.Cap(1<<20)}.
func Cap(v uint64) *uint64 { return &v }

// Value is an engine-reported metric that may be unknown. The zero Value is unknown, which is
// different from a known 0.
type Value struct {
	// V is the metric, in the unit of the Metrics field holding it; meaningful only when Known.
	V uint64
	// Known reports whether the engine reported the metric in a fresh, complete report.
	Known bool
}

// Known returns a known Value.
func Known(v uint64) Value { return Value{V: v, Known: true} }

// Metrics is what admission sees of one engine: reported values from the pick's load snapshot
// (unknown without a fresh, complete report; KV and pending-prefill also need the native
// extension) and the live router-local in-flight count, which is always known.
type Metrics struct {
	// RunningRequests and WaitingRequests are the reported running and waiting requests.
	RunningRequests Value
	WaitingRequests Value
	// KVTokens is the reported KV cache in use, in tokens (native reports only).
	KVTokens Value
	// PendingPrefillTokens is the reported waiting uncached prompt tokens (native reports only).
	PendingPrefillTokens Value
	// InFlightRequests is this router's in-flight requests to the engine; always known.
	InFlightRequests uint64
}

// Observe builds Metrics from an observation (docs/design.md §5: running and waiting from
// the fresh basic sample, KV and pending prefill from the fresh native sample, in-flight from the
// live counter).
func Observe(o loadmon.Observation) Metrics {
	m := Metrics{InFlightRequests: o.InFlight}
	if l := o.Load; l != nil {
		m.RunningRequests = Known(l.RunningRequests)
		m.WaitingRequests = Known(l.WaitingRequests)
		if l.Native {
			m.KVTokens = Known(l.UsedKVTokens)
			m.PendingPrefillTokens = Known(l.WaitingUncachedTokens)
		}
	}
	return m
}

// Verdict is the outcome of one check. When Admit is false, Limit names the first failing cap in
// check order, Observed is the engine's metric and Cap the configured cap. When Admit is true,
// InFlightCap names the in-flight cap the engine was admitted under, if any.
type Verdict struct {
	// Admit reports whether the engine may take the request.
	Admit bool
	// Limit names the first failing cap (a Limit… constant); empty when admitted.
	Limit string
	// Observed is the engine's metric and Cap the configured cap of Limit; zero when admitted.
	Observed uint64
	Cap      uint64
	// InFlightCap is the in-flight cap the admitted engine is held to, valid when HasInFlightCap
	// (false: no in-flight cap). The check read an in-flight count that concurrent dispatches
	// may have raised since, so a configured cap is a promise only if the dispatch is counted
	// atomically under it: the caller acquires the engine's in-flight guard with
	// loadmon.InFlight.TryAcquire and this cap, and treats a failed acquire as a
	// rejection (docs/design.md §5). policy.Pick carries it to the caller.
	InFlightCap    uint64
	HasInFlightCap bool
}

// Checker decides whether one engine may take a request, given its metrics. Policies call it
// explicitly, once per engine they are about to return (docs/design.md §5). A returned
// error means the check itself could not be made; policies return it to the bucket loop, which
// stops. Implementations must be safe for concurrent use and must not block.
//
// Metrics.InFlightRequests is a live read that concurrent selections may overtake: a checker
// that caps it holds the cap only by returning it in an admitting Verdict's InFlightCap, which
// the Router enforces atomically when it counts the dispatch. A checker that rejects on the
// in-flight count without setting InFlightCap checks a snapshot, as for every other metric.
type Checker interface {
	Check(engine state.Engine, m Metrics) (Verdict, error)
}

var _ Checker = Limits{}

// Check implements Checker. Caps are checked in the order running, waiting, KV tokens, pending
// prefill tokens, in-flight; the first cap the metric has reached rejects and names itself. An
// unknown reported metric passes its cap (fails open). An admitting verdict carries
// MaxInFlightRequests as its InFlightCap. Check never returns an error.
func (l Limits) Check(_ state.Engine, m Metrics) (Verdict, error) {
	// One test per cap, in check order, rather than a loop over a table of them: every pick runs
	// this for each holder it evaluates, and the table cost more than the tests.
	switch {
	case reached(l.MaxRunningRequests, m.RunningRequests):
		return rejected(LimitRunningRequests, l.MaxRunningRequests, m.RunningRequests), nil
	case reached(l.MaxWaitingRequests, m.WaitingRequests):
		return rejected(LimitWaitingRequests, l.MaxWaitingRequests, m.WaitingRequests), nil
	case reached(l.MaxKVTokens, m.KVTokens):
		return rejected(LimitKVTokens, l.MaxKVTokens, m.KVTokens), nil
	case reached(l.MaxPendingPrefillTokens, m.PendingPrefillTokens):
		return rejected(LimitPendingPrefillTokens, l.MaxPendingPrefillTokens, m.PendingPrefillTokens), nil
	case reached(l.MaxInFlightRequests, Known(m.InFlightRequests)):
		return rejected(LimitInFlightRequests, l.MaxInFlightRequests, Known(m.InFlightRequests)), nil
	}
	if l.MaxInFlightRequests != nil {
		return Verdict{Admit: true, InFlightCap: *l.MaxInFlightRequests, HasInFlightCap: true}, nil
	}
	return Verdict{Admit: true}, nil
}

// reached reports whether a known metric v is at or over a set cap (nil: no cap).
func reached(cap *uint64, v Value) bool { return cap != nil && v.Known && v.V >= *cap }

// rejected is the verdict of the cap name that v reached.
func rejected(name string, cap *uint64, v Value) Verdict {
	return Verdict{Limit: name, Observed: v.V, Cap: *cap}
}

// IsZero reports whether no cap is set (Limits{} admits everything).
func (l Limits) IsZero() bool { return l == Limits{} }

// limitsFields is Limits without methods, so decoding does not recurse.
type limitsFields Limits

// UnmarshalJSON decodes Limits strictly: an unknown field is a *FieldError wrapping
// state.ErrUnknownField; a negative, fractional or non-numeric value is a *FieldError too. On error the
// receiver is unchanged.
func (l *Limits) UnmarshalJSON(data []byte) error {
	var raw map[string]json.RawMessage
	if err := json.Unmarshal(data, &raw); err != nil {
		return &FieldError{Err: fmt.Errorf("%w %.32s: want a JSON object with fields %s",
			state.ErrBadValue, bytes.TrimSpace(data), strings.Join(limitNames, ", "))}
	}
	keys := slices.Sorted(maps.Keys(raw))
	if err := checkFields(keys); err != nil {
		return err
	}
	for _, k := range keys {
		var v uint64
		if v := raw[k]; string(v) == "null" {
			continue // a nil cap
		}
		if err := json.Unmarshal(raw[k], &v); err != nil {
			return badValue(k, string(raw[k]))
		}
	}
	var out limitsFields
	dec := json.NewDecoder(bytes.NewReader(data))
	if err := dec.Decode(&out); err != nil {
		return &FieldError{Err: fmt.Errorf("%w: %v", state.ErrBadValue, err)} // unreachable: every field was checked
	}
	*l = Limits(out)
	return nil
}

// badValue reports a field whose value is not a non-negative integer, quoting at most 32 bytes of
// the value as written.
func badValue(field, value string) error {
	return &FieldError{Field: field, Err: fmt.Errorf("%w %.32s: want a non-negative integer", state.ErrBadValue, value)}
}

// UnmarshalYAML decodes Limits strictly, with the same rules as UnmarshalJSON.
func (l *Limits) UnmarshalYAML(node *yaml.Node) error {
	if node.Kind != yaml.MappingNode {
		return &FieldError{Err: fmt.Errorf("%w at line %d: want a mapping with fields %s", state.ErrBadValue, node.Line, strings.Join(limitNames, ", "))}
	}
	keys := make([]string, 0, len(node.Content)/2)
	for i := 0; i+1 < len(node.Content); i += 2 {
		keys = append(keys, node.Content[i].Value)
	}
	if err := checkFields(keys); err != nil {
		return err
	}
	var out limitsFields
	for i := 0; i+1 < len(node.Content); i += 2 {
		var v uint64
		if err := node.Content[i+1].Decode(&v); err != nil {
			return badValue(node.Content[i].Value, node.Content[i+1].Value)
		}
	}
	if err := node.Decode(&out); err != nil {
		return &FieldError{Err: err}
	}
	*l = Limits(out)
	return nil
}

func checkFields(keys []string) error {
	slices.Sort(keys)
	for _, k := range keys {
		if !slices.Contains(limitNames, k) {
			return &FieldError{Field: k, Err: fmt.Errorf("%w: want one of %s", state.ErrUnknownField, strings.Join(limitNames, ", "))}
		}
	}
	return nil
}
