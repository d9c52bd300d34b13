package sim

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/admission"
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

// TestReplayCancelMidRun cancels a long replay from its first progress report: Replay returns
// context.Canceled at once, without simulating the rest of the trace.
func TestReplayCancelMidRun(t *testing.T) {
	tr, err := MooncakeConversation()
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var last atomic.Int64
	var total int
	rep, err := Replay(ctx, Config{Trace: tr, Fleet: Fleet{Plain: 4}, Parallelism: 1,
		Policies: []string{NameRoundRobin, NameCacheAware},
		Progress: func(done, all int) {
			last.Store(int64(done))
			total = all
			cancel()
		}})
	assert.Nil(t, rep)
	assert.ErrorIs(t, err, context.Canceled)
	assert.Equal(t, 2*len(tr.Requests), total)
	// The loop checks ctx every 4,096 events; a few thousand requests at most finish after the
	// cancellation, far from the 24,062 of the whole replay.
	assert.Less(t, last.Load(), int64(len(tr.Requests)/2), "requests done when Replay returned")
}

// allRejected replays 300 requests with a cap that admission can never satisfy.
func allRejected(t *testing.T) *Report {
	t.Helper()
	tr, err := MooncakeConversation()
	require.NoError(t, err)
	rep, err := Replay(context.Background(), Config{Trace: tr, Fleet: Fleet{Plain: 2}, Limit: 300,
		Policies: []string{NameRoundRobin, NameCacheAware}, Speed: 4,
		Admission: admission.Limits{MaxWaitingRequests: admission.Cap(0)}})
	require.NoError(t, err)
	return rep
}

// TestUndefinedFiguresAreNotZero: a policy whose requests were all rejected has no latency, hit
// rate, throughput, imbalance or utilization. The table prints n/a, JSON null.
func TestUndefinedFiguresAreNotZero(t *testing.T) {
	rep := allRejected(t)
	r := rep.Results[0]
	require.Equal(t, 300, r.Rejected)
	assert.False(t, r.Defined())
	assert.False(t, r.HitRateDefined())

	var table bytes.Buffer
	require.NoError(t, rep.WriteTable(&table))
	lines := strings.Split(strings.TrimSpace(table.String()), "\n")
	assert.Equal(t, []string{"round_robin", "n/a", "n/a", "n/a", "n/a", "n/a", "n/a", "n/a", "n/a", "n/a", "n/a", "300", "0"},
		strings.Fields(lines[len(lines)-2]), "table row:\n%s", table.String())
	assert.NotContains(t, table.String(), "0.00 s")

	var js bytes.Buffer
	require.NoError(t, rep.WriteJSON(&js))
	var raw struct {
		Results []map[string]json.RawMessage `json:"results"`
	}
	require.NoError(t, json.Unmarshal(js.Bytes(), &raw))
	for _, key := range []string{"hit_rate", "ttft", "e2e", "output_tokens_per_s", "requests_per_s", "imbalance",
		"prefill_utilization", "busy_utilization"} {
		assert.Equal(t, "null", string(raw.Results[0][key]), key)
	}
	assert.Equal(t, "300", string(raw.Results[0]["rejected"]))
	var back Report
	require.NoError(t, json.Unmarshal(js.Bytes(), &back), "null decodes to the Go zero value")
	assert.Zero(t, back.Results[0].TTFT)

	// A run that completes requests keeps its figures.
	tr, err := MooncakeConversation()
	require.NoError(t, err)
	ok, err := Replay(context.Background(), Config{Trace: tr, Fleet: Fleet{Plain: 4}, Limit: 100,
		Policies: []string{NameRoundRobin}})
	require.NoError(t, err)
	js.Reset()
	require.NoError(t, ok.WriteJSON(&js))
	require.NoError(t, json.Unmarshal(js.Bytes(), &raw))
	var lat Latency
	require.NoError(t, json.Unmarshal(raw.Results[0]["ttft"], &lat))
	assert.Equal(t, ok.Results[0].TTFT, lat)
	assert.Positive(t, lat.P99)
	assert.NotContains(t, js.String(), "null")
}

// TestOverload: 2 engines at 4× on the first 300 requests cannot keep up (TTFT p99 above 100 s)
// and are flagged; 16 engines on the same prefix keep up and are not.
func TestOverload(t *testing.T) {
	tr, err := MooncakeConversation()
	require.NoError(t, err)
	replay := func(engines int) *Report {
		rep, err := Replay(context.Background(), Config{Trace: tr, Fleet: Fleet{Plain: engines}, Limit: 300, Speed: 4,
			Policies: []string{NameRoundRobin, NameCacheAware}})
		require.NoError(t, err)
		return rep
	}
	over := replay(2)
	for _, r := range over.Results {
		o := r.Overload
		assert.True(t, o.Overloaded, "%s on 2 engines: %+v", r.Policy, o)
		assert.GreaterOrEqual(t, o.EndBacklog, OverloadGrowth*o.MeanBacklog, r.Policy)
		assert.Greater(t, r.TTFT.P99, 100.0, r.Policy)
	}
	warnings := over.Warnings()
	require.Len(t, warnings, 2)
	assert.True(t, strings.HasPrefix(warnings[0], "warning: round_robin: overloaded: "), warnings[0])
	assert.True(t, strings.HasPrefix(warnings[1], "warning: cache_aware: overloaded: "), warnings[1])
	var table bytes.Buffer
	require.NoError(t, over.WriteTable(&table))
	assert.True(t, strings.HasSuffix(table.String(), warnings[0]+"\n"+warnings[1]+"\n"), table.String())
	var js bytes.Buffer
	require.NoError(t, over.WriteJSON(&js))
	assert.Contains(t, js.String(), `"overloaded": true`)

	normal := replay(16)
	for _, r := range normal.Results {
		assert.False(t, r.Overload.Overloaded, "%s on 16 engines: %+v", r.Policy, r.Overload)
		assert.Less(t, r.TTFT.P99, 10.0, r.Policy)
	}
	assert.Empty(t, normal.Warnings())
	table.Reset()
	require.NoError(t, normal.WriteTable(&table))
	assert.NotContains(t, table.String(), "warning")
}

// TestOverloadCriterion checks the thresholds of run.overload exactly.
func TestOverloadCriterion(t *testing.T) {
	r := &run{front: make([]*engine, 2)} // 2 engines: the end backlog must reach 8
	window := func(mean float64, n int64) backlogWindow {
		return backlogWindow{sum: int64(mean * float64(n)), n: n}
	}
	tests := []struct {
		name      string
		all, end  backlogWindow
		overloads bool
	}{
		{"growing, large", window(8, 100), window(10, 10), true},
		{"exactly 1.25× and 4 per engine", window(6.4, 100), window(8, 10), true},
		{"growing, below 4 per engine", window(4, 100), window(7, 10), false},
		{"large, not growing enough", window(9, 100), window(11, 10), false},
		{"large, shrinking", window(20, 100), window(10, 10), false},
		{"no sample at the end", window(20, 5), backlogWindow{}, false},
	}
	for _, tt := range tests {
		r.backlogAll, r.backlogEnd = tt.all, tt.end
		o := r.overload()
		assert.Equal(t, tt.overloads, o.Overloaded, "%s: %+v", tt.name, o)
	}
}

// TestErrorsCarryOnePrefix: sim wraps its own errors with the "sim: " prefix once.
func TestErrorsCarryOnePrefix(t *testing.T) {
	path := filepath.Join(t.TempDir(), "unsorted.jsonl")
	require.NoError(t, os.WriteFile(path, []byte(
		`{"timestamp": 10, "input_length": 1, "output_length": 1, "hash_ids": [1]}`+"\n"+
			`{"timestamp": 5, "input_length": 1, "output_length": 1, "hash_ids": [2]}`+"\n"), 0o600))
	_, err := ReadTraceFile(path)
	require.ErrorIs(t, err, ErrUnsorted)
	var te *TraceError
	require.ErrorAs(t, err, &te)
	assert.Equal(t, "sim: read trace "+path+": trace line 2: timestamp: timestamp decreases: 5 ms after 10 ms", err.Error())

	factories := DefaultPolicies()
	factories["nil"] = func(PolicyEnv, state.Stage) (policy.Policy, error) { return nil, nil }
	_, err = Replay(context.Background(), Config{Trace: &Trace{Requests: []Request{{InputTokens: 10, OutputTokens: 1}}},
		Fleet: Fleet{Plain: 1}, Factories: factories, Policies: []string{"nil"}})
	require.ErrorIs(t, err, state.ErrInvalidConfiguration)
	assert.Equal(t, "sim: policy nil: policy factory returned a nil policy for stage plain: invalid configuration", err.Error())
}
