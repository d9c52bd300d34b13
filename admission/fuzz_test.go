package admission_test

import (
	"encoding/json"
	"errors"
	"testing"

	"go.yaml.in/yaml/v3"

	"github.com/enginepick/enginepick/admission"
	"github.com/enginepick/enginepick/state"
)

// FuzzLimitsJSON checks that decoding never panics, that every failure is a typed error leaving
// the receiver unchanged, and that every success round-trips.
func FuzzLimitsJSON(f *testing.F) {
	f.Add(`{}`)                                            // the default
	f.Add(`{"max_running_requests":64,"max_kv_tokens":1}`) // a typical configuration
	f.Add(`{"max_in_flight":64}`)                          // the legacy name: unknown
	f.Add(`{"max_kv_tokens":-1}`)                          // negative
	f.Add(`{"max_kv_tokens":18446744073709551616}`)        // overflows uint64
	f.Add(`null`)
	f.Add(`{"max_kv_tokens":1,"max_kv_tokens":2}`) // duplicate key: last wins
	f.Fuzz(func(t *testing.T, in string) {
		sentinel := admission.Limits{MaxWaitingRequests: admission.Cap(7)}
		l := sentinel
		err := json.Unmarshal([]byte(in), &l)
		if err != nil {
			var fe *admission.FieldError
			var se *json.SyntaxError
			if !errors.As(err, &fe) && !errors.As(err, &se) {
				t.Fatalf("Unmarshal(%q) = %v: want *FieldError or a JSON syntax error", in, err)
			}
			if fe != nil && !errors.Is(err, state.ErrInvalidConfiguration) {
				t.Fatalf("Unmarshal(%q) = %v: does not wrap ErrInvalidConfiguration", in, err)
			}
			if l != sentinel {
				t.Fatalf("Unmarshal(%q) failed but changed the receiver to %+v", in, l)
			}
			return
		}
		out, err := json.Marshal(l)
		if err != nil {
			t.Fatal(err)
		}
		var back admission.Limits
		if err := json.Unmarshal(out, &back); err != nil {
			t.Fatalf("round trip of %s: %v", out, err)
		}
		if !equalLimits(l, back) {
			t.Fatalf("round trip of %q: %+v != %+v", in, l, back)
		}
	})
}

// FuzzLimitsYAML checks the YAML decoder the same way.
func FuzzLimitsYAML(f *testing.F) {
	f.Add("max_running_requests: 64\n")
	f.Add("max_inflight: 3\n")
	f.Add("max_kv_tokens: -5\n")
	f.Add("- 1\n")
	f.Add("max_kv_tokens: [1]\n")
	f.Fuzz(func(t *testing.T, in string) {
		var l admission.Limits
		err := yaml.Unmarshal([]byte(in), &l)
		if err == nil {
			out, merr := yaml.Marshal(l)
			if merr != nil {
				t.Fatal(merr)
			}
			var back admission.Limits
			if err := yaml.Unmarshal(out, &back); err != nil || !equalLimits(l, back) {
				t.Fatalf("round trip of %q: %+v != %+v (%v)", in, l, back, err)
			}
		}
	})
}

func equalLimits(a, b admission.Limits) bool {
	eq := func(x, y *uint64) bool { return (x == nil) == (y == nil) && (x == nil || *x == *y) }
	return eq(a.MaxRunningRequests, b.MaxRunningRequests) && eq(a.MaxWaitingRequests, b.MaxWaitingRequests) &&
		eq(a.MaxKVTokens, b.MaxKVTokens) && eq(a.MaxPendingPrefillTokens, b.MaxPendingPrefillTokens) &&
		eq(a.MaxInFlightRequests, b.MaxInFlightRequests)
}
