package admission_test

import (
	"encoding/json"
	"errors"
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.yaml.in/yaml/v3"

	"github.com/enginepick/enginepick/admission"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/state"
)

func TestLimitsJSONRoundTrip(t *testing.T) {
	t.Parallel()
	in := `{"max_running_requests":64,"max_kv_tokens":1048576,"max_inflight_requests":64}`
	var l admission.Limits
	require.NoError(t, json.Unmarshal([]byte(in), &l))
	assert.Equal(t, admission.Limits{
		MaxRunningRequests:  admission.Cap(64),
		MaxKVTokens:         admission.Cap(1048576),
		MaxInFlightRequests: admission.Cap(64),
	}, l)
	out, err := json.Marshal(l)
	require.NoError(t, err)
	assert.JSONEq(t, in, string(out))

	var empty admission.Limits
	require.NoError(t, json.Unmarshal([]byte(`{}`), &empty))
	assert.True(t, empty.IsZero(), "{} is the default that admits everything")
	out, err = json.Marshal(admission.Limits{})
	require.NoError(t, err)
	assert.Equal(t, `{}`, string(out))
}

func TestLimitsRejectUnknownFieldsNamingThem(t *testing.T) {
	t.Parallel()
	before := admission.Limits{MaxWaitingRequests: admission.Cap(3)}
	l := before
	err := json.Unmarshal([]byte(`{"max_running_requests":1,"max_in_flight":64}`), &l)
	var fe *admission.FieldError
	require.ErrorAs(t, err, &fe)
	assert.Equal(t, "max_in_flight", fe.Field)
	assert.ErrorIs(t, err, state.ErrUnknownField)
	assert.ErrorIs(t, err, state.ErrInvalidConfiguration)
	assert.Equal(t, before, l, "a failed decode leaves the receiver unchanged")

	for name, in := range map[string]string{
		"negative": `{"max_kv_tokens":-1}`,
		"fraction": `{"max_kv_tokens":1.5}`,
		"string":   `{"max_kv_tokens":"10"}`,
		"array":    `[1]`,
	} {
		err := json.Unmarshal([]byte(in), &l)
		assert.ErrorIs(t, err, state.ErrInvalidConfiguration, name)
		assert.True(t, errors.As(err, &fe), name)
	}
	assert.Equal(t, before, l)
}

func TestLimitsYAMLIsStrictToo(t *testing.T) {
	t.Parallel()
	var l admission.Limits
	require.NoError(t, yaml.Unmarshal([]byte("max_running_requests: 64\nmax_pending_prefill_tokens: 8192\n"), &l))
	assert.Equal(t, admission.Limits{MaxRunningRequests: admission.Cap(64), MaxPendingPrefillTokens: admission.Cap(8192)}, l)

	err := yaml.Unmarshal([]byte("max_running_requests: 64\nmax_inflight: 3\n"), &l)
	var fe *admission.FieldError
	require.ErrorAs(t, err, &fe)
	assert.Equal(t, "max_inflight", fe.Field)
	assert.ErrorIs(t, err, state.ErrUnknownField)

	err = yaml.Unmarshal([]byte("max_kv_tokens: -5\n"), &l)
	require.ErrorAs(t, err, &fe)
	assert.Equal(t, "max_kv_tokens", fe.Field)
	assert.ErrorIs(t, yaml.Unmarshal([]byte("- 1\n"), &l), state.ErrInvalidConfiguration)
}

// each limit: just below the cap admits, at the cap rejects naming the field, unknown fails open.
func TestEachLimitCapsItsMetricAndFailsOpenWhenUnknown(t *testing.T) {
	t.Parallel()
	const capV = 100
	tests := []struct {
		limit string
		lim   admission.Limits
		set   func(m *admission.Metrics, v uint64)
		unset func(m *admission.Metrics)
		admit admission.Verdict // below the cap: only the in-flight cap is carried to the acquire
	}{
		{admission.LimitRunningRequests, admission.Limits{MaxRunningRequests: admission.Cap(capV)},
			func(m *admission.Metrics, v uint64) { m.RunningRequests = admission.Known(v) },
			func(m *admission.Metrics) { m.RunningRequests = admission.Value{} }, admission.Verdict{Admit: true}},
		{admission.LimitWaitingRequests, admission.Limits{MaxWaitingRequests: admission.Cap(capV)},
			func(m *admission.Metrics, v uint64) { m.WaitingRequests = admission.Known(v) },
			func(m *admission.Metrics) { m.WaitingRequests = admission.Value{} }, admission.Verdict{Admit: true}},
		{admission.LimitKVTokens, admission.Limits{MaxKVTokens: admission.Cap(capV)},
			func(m *admission.Metrics, v uint64) { m.KVTokens = admission.Known(v) },
			func(m *admission.Metrics) { m.KVTokens = admission.Value{} }, admission.Verdict{Admit: true}},
		{admission.LimitPendingPrefillTokens, admission.Limits{MaxPendingPrefillTokens: admission.Cap(capV)},
			func(m *admission.Metrics, v uint64) { m.PendingPrefillTokens = admission.Known(v) },
			func(m *admission.Metrics) { m.PendingPrefillTokens = admission.Value{} }, admission.Verdict{Admit: true}},
		{admission.LimitInFlightRequests, admission.Limits{MaxInFlightRequests: admission.Cap(capV)},
			func(m *admission.Metrics, v uint64) { m.InFlightRequests = v }, nil,
			admission.Verdict{Admit: true, InFlightCap: capV, HasInFlightCap: true}},
	}
	for _, tt := range tests {
		t.Run(tt.limit, func(t *testing.T) {
			t.Parallel()
			var m admission.Metrics
			tt.set(&m, capV-1)
			v, err := tt.lim.Check(nil, m)
			require.NoError(t, err)
			assert.Equal(t, tt.admit, v, "metric %d below cap %d admits", capV-1, capV)

			tt.set(&m, capV)
			v, err = tt.lim.Check(nil, m)
			require.NoError(t, err)
			assert.Equal(t, admission.Verdict{Limit: tt.limit, Observed: capV, Cap: capV}, v, "metric at cap rejects")

			if tt.unset != nil {
				tt.unset(&m)
				v, _ = tt.lim.Check(nil, m)
				assert.True(t, v.Admit, "an unknown metric fails open")
			}
		})
	}
}

func TestCheckOrderNamesTheFirstFailingLimit(t *testing.T) {
	t.Parallel()
	all := admission.Limits{
		MaxRunningRequests: admission.Cap(1), MaxWaitingRequests: admission.Cap(1), MaxKVTokens: admission.Cap(1),
		MaxPendingPrefillTokens: admission.Cap(1), MaxInFlightRequests: admission.Cap(1),
	}
	m := admission.Metrics{
		RunningRequests: admission.Known(1), WaitingRequests: admission.Known(1), KVTokens: admission.Known(1),
		PendingPrefillTokens: admission.Known(1), InFlightRequests: 1,
	}
	order := []string{admission.LimitRunningRequests, admission.LimitWaitingRequests, admission.LimitKVTokens,
		admission.LimitPendingPrefillTokens, admission.LimitInFlightRequests}
	for i, want := range order {
		v, _ := all.Check(nil, m)
		assert.Equal(t, want, v.Limit, "step %d", i)
		switch want { // clear this metric so the next one fails first
		case admission.LimitRunningRequests:
			m.RunningRequests = admission.Value{}
		case admission.LimitWaitingRequests:
			m.WaitingRequests = admission.Value{}
		case admission.LimitKVTokens:
			m.KVTokens = admission.Value{}
		case admission.LimitPendingPrefillTokens:
			m.PendingPrefillTokens = admission.Value{}
		case admission.LimitInFlightRequests:
			m.InFlightRequests = 0
		}
	}
	v, _ := all.Check(nil, m)
	assert.True(t, v.Admit)
	v, _ = admission.Limits{}.Check(nil, admission.Metrics{InFlightRequests: 1 << 60, RunningRequests: admission.Known(1 << 60)})
	assert.True(t, v.Admit, "Limits{} admits everything")
}

func TestObserveTakesReportedAndLiveValues(t *testing.T) {
	t.Parallel()
	tab := loadmon.NewTable()
	f := loadmon.NewInFlight(nil)
	require.NoError(t, tab.Report(loadmon.Report{Engine: "basic", RunningRequests: 2, WaitingRequests: 3, UsedKVTokens: 40, KVCapacityTokens: 100}))
	require.NoError(t, tab.Report(loadmon.Report{Engine: "native", RunningRequests: 2, WaitingRequests: 3, UsedKVTokens: 40, KVCapacityTokens: 100,
		Native: &loadmon.NativeLoad{WaitingUncachedTokens: 500, MaxRunningRequests: 8}}))
	f.Acquire("basic", -1, 0)
	f.Acquire("none", -1, 0)
	snap := tab.Snapshot()

	assert.Equal(t, admission.Metrics{RunningRequests: admission.Known(2), WaitingRequests: admission.Known(3), InFlightRequests: 1},
		admission.Observe(loadmon.Observe(snap, f, "basic")), "basic reports give running and waiting, no KV or pending")
	assert.Equal(t, admission.Metrics{RunningRequests: admission.Known(2), WaitingRequests: admission.Known(3),
		KVTokens: admission.Known(40), PendingPrefillTokens: admission.Known(500)},
		admission.Observe(loadmon.Observe(snap, f, "native")))
	assert.Equal(t, admission.Metrics{InFlightRequests: 1}, admission.Observe(loadmon.Observe(snap, f, "none")),
		"no report: only in-flight is known")
}

func ExampleLimits() {
	var l admission.Limits
	_ = json.Unmarshal([]byte(`{"max_waiting_requests": 4}`), &l)
	for _, waiting := range []uint64{3, 4} {
		v, _ := l.Check(nil, admission.Metrics{WaitingRequests: admission.Known(waiting)})
		fmt.Printf("waiting=%d admit=%v limit=%q\n", waiting, v.Admit, v.Limit)
	}
	v, _ := l.Check(nil, admission.Metrics{})
	fmt.Printf("unknown admit=%v\n", v.Admit)
	// Output:
	// waiting=3 admit=true limit=""
	// waiting=4 admit=false limit="max_waiting_requests"
	// unknown admit=true
}

// TestLimitsErrorMessagesNameFieldAndRule pins what a user reads: the bad field and what is
// allowed (the field names, or a non-negative integer), never a Go type name such as uint64,
// limitsFields or json.RawMessage.
func TestLimitsErrorMessagesNameFieldAndRule(t *testing.T) {
	t.Parallel()
	const fields = "max_running_requests, max_waiting_requests, max_kv_tokens, max_pending_prefill_tokens, max_inflight_requests"
	cases := []struct {
		in, want string
		sentinel error
	}{
		{`{"max_waitin": 4}`, `admission: limits field "max_waitin": unknown field: want one of ` + fields, state.ErrUnknownField},
		{`{"max_kv_tokens": "10"}`, `admission: limits field "max_kv_tokens": bad value "10": want a non-negative integer`, state.ErrBadValue},
		{`{"max_kv_tokens": -1}`, `admission: limits field "max_kv_tokens": bad value -1: want a non-negative integer`, state.ErrBadValue},
		{`{"max_kv_tokens": 1.5}`, `admission: limits field "max_kv_tokens": bad value 1.5: want a non-negative integer`, state.ErrBadValue},
		{`{"max_running_requests": 1, "max_kv_tokens": [2]}`, `admission: limits field "max_kv_tokens": bad value [2]: want a non-negative integer`, state.ErrBadValue},
		{`[1]`, `admission: limits: bad value [1]: want a JSON object with fields ` + fields, state.ErrBadValue},
		{`7`, `admission: limits: bad value 7: want a JSON object with fields ` + fields, state.ErrBadValue},
	}
	for _, tc := range cases {
		var l admission.Limits
		err := json.Unmarshal([]byte(tc.in), &l)
		require.Error(t, err, tc.in)
		assert.Equal(t, tc.want, err.Error(), tc.in)
		assert.ErrorIs(t, err, tc.sentinel, tc.in)
		assert.ErrorIs(t, err, state.ErrInvalidConfiguration, tc.in)
	}
	var l admission.Limits
	require.NoError(t, json.Unmarshal([]byte(`{"max_kv_tokens": null}`), &l), "null is a nil cap")
	assert.True(t, l.IsZero())

	err := yaml.Unmarshal([]byte("max_kv_tokens: ten\n"), &l)
	require.Error(t, err)
	assert.Equal(t, `admission: limits field "max_kv_tokens": bad value ten: want a non-negative integer`, err.Error())
	err = yaml.Unmarshal([]byte("- 1\n"), &l)
	require.Error(t, err)
	assert.Equal(t, "admission: limits: bad value at line 1: want a mapping with fields "+fields, err.Error())
}
