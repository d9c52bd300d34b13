package sim

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/state"
)

// byTenant returns tr's requests of each tenant, in arrival order, with Index cleared (it numbers
// a request within its whole trace).
func byTenant(tr *Trace) map[string][]Request {
	out := map[string][]Request{}
	for _, r := range tr.Requests {
		r.Index = 0
		out[r.Tenant] = append(out[r.Tenant], r)
	}
	return out
}

// TestTenantsOthersUnchanged: removing the heavy tenant or the critical one, changing their
// multiples or adding tenants leaves every other tenant's requests exactly as they were.
func TestTenantsOthersUnchanged(t *testing.T) {
	t.Parallel()
	base := Tenants{Tenants: 4, Rate: 3, Heavy: 10, Critical: 0.5, Duration: 20 * time.Second}
	full := byTenant(generate(t, base, 5))
	require.Len(t, full, 5)
	for _, tt := range []struct {
		w       Tenants
		removed []string
	}{
		{Tenants{Tenants: 4, Rate: 3, Heavy: 0, Critical: 0.5, Duration: 20 * time.Second}, []string{"tenant-0"}},
		{Tenants{Tenants: 4, Rate: 3, Heavy: 1, Critical: 0.5, Duration: 20 * time.Second}, nil},
		{Tenants{Tenants: 4, Rate: 3, Heavy: 10, Critical: 0, Duration: 20 * time.Second}, []string{CriticalTenant}},
		{Tenants{Tenants: 1, Rate: 3, Heavy: 0, Critical: 0.5, Duration: 20 * time.Second},
			[]string{"tenant-0", "tenant-1", "tenant-2", "tenant-3"}},
		{Tenants{Tenants: 6, Rate: 3, Heavy: 10, Critical: 0.5, Duration: 20 * time.Second}, nil},
	} {
		t.Run(tt.w.String(), func(t *testing.T) {
			t.Parallel()
			tr := generate(t, tt.w, 5)
			got := byTenant(tr)
			for name, reqs := range full {
				switch {
				case name == "tenant-0" && tt.w.Heavy != base.Heavy && tt.w.Heavy != 0:
					assert.NotEqual(t, reqs, got[name], "tenant 0 at another rate")
				case contains(tt.removed, name):
					assert.NotContains(t, got, name)
				default:
					assert.Equal(t, reqs, got[name], name)
				}
			}
			var listed []string
			for _, tn := range tr.Tenants {
				assert.Equal(t, 1.0, tn.Weight)
				listed = append(listed, tn.Name)
				assert.NotEmpty(t, got[tn.Name], "a listed tenant sends")
			}
			assert.Len(t, listed, len(got), "every tenant that sends is listed")
		})
	}
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// TestTenantsShape: names, bands, rates, lengths and prefixes of the tenants workload.
func TestTenantsShape(t *testing.T) {
	t.Parallel()
	w := Tenants{Tenants: 3, Rate: 20, Heavy: 10, Critical: 0.5, Duration: 30 * time.Second}
	tr := generate(t, w, 2)
	assert.Equal(t, []Tenant{{"tenant-0", 1}, {"tenant-1", 1}, {"tenant-2", 1}, {CriticalTenant, 1}}, tr.Tenants)
	got := byTenant(tr)
	rates := map[string]float64{"tenant-0": 200, "tenant-1": 20, "tenant-2": 20, CriticalTenant: 10}
	streams := map[uint64]string{} // system prompt stream → tenant
	for name, reqs := range got {
		want := rates[name] * w.Duration.Seconds()
		assert.InDelta(t, want, float64(len(reqs)), 4*math.Sqrt(want), "%s: a Poisson count of mean %.0f", name, want)
		prompts := map[uint64]bool{}
		for _, r := range reqs {
			assert.Equal(t, map[bool]int{true: CriticalPriority, false: 0}[name == CriticalTenant], r.Priority, name)
			assert.Empty(t, r.Session)
			assert.Less(t, r.Arrival, w.Duration)
			assert.InDelta(t, (ChatMessageMinTokens+ChatMessageMaxTokens)/2, r.OutputTokens, (ChatMessageMaxTokens-ChatMessageMinTokens)/2)
			user := r.Segments[len(r.Segments)-1]
			assert.InDelta(t, (ChatMessageMinTokens+ChatMessageMaxTokens)/2, user.Tokens, (ChatMessageMaxTokens-ChatMessageMinTokens)/2)
			require.LessOrEqual(t, len(r.Segments), 2)
			if len(r.Segments) == 2 {
				sys := r.Segments[0]
				assert.LessOrEqual(t, sys.Tokens, ChatSystemPromptMaxTokens)
				prompts[sys.Stream] = true
				if owner, ok := streams[sys.Stream]; ok {
					assert.Equal(t, name, owner, "no system prompt shared across tenants")
				}
				streams[sys.Stream] = name
			}
		}
		assert.LessOrEqual(t, len(prompts), TenantSystemPrompts, name)
		assert.GreaterOrEqual(t, len(prompts), TenantSystemPrompts-1, name) // one may be 0 tokens long
	}
}

func TestJainIndex(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		x    []float64
		want float64
	}{
		{[]float64{1, 1, 1, 1}, 1},
		{[]float64{3, 3}, 1},
		{[]float64{1, 0, 0, 0}, 0.25},
		{[]float64{1, 2, 3}, 6.0 / 7}, // 36 ÷ (3 × 14)
		{[]float64{1, 3}, 0.8},        // 16 ÷ (2 × 10)
		{[]float64{5}, 1},
		{nil, 0},
		{[]float64{0, 0}, 0},
	} {
		assert.Equal(t, tt.want, jainIndex(tt.x), "%v", tt.x)
	}
}

func TestFairShares(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		demand, weight []float64
		capacity       float64
		want           []float64
	}{
		{[]float64{10, 20, 30}, []float64{1, 1, 1}, 60, []float64{10, 20, 30}},
		{[]float64{10, 20, 30}, []float64{1, 1, 1}, 100, []float64{10, 20, 30}},
		{[]float64{10, 20, 30}, []float64{1, 1, 1}, 30, []float64{10, 10, 10}},
		{[]float64{30, 20, 10}, []float64{1, 1, 1}, 45, []float64{17.5, 17.5, 10}},
		{[]float64{100, 100}, []float64{1, 3}, 40, []float64{10, 30}},
		{[]float64{5, 100}, []float64{3, 1}, 40, []float64{5, 35}},
		{[]float64{0, 100, 100}, []float64{1, 1, 1}, 50, []float64{0, 25, 25}},
		{[]float64{100, 30, 10, 10}, []float64{1, 1, 1, 1}, 80, []float64{30, 30, 10, 10}},
		{[]float64{7}, []float64{2}, 0, []float64{0}},
	} {
		assert.Equal(t, tt.want, fairShares(tt.demand, tt.weight, tt.capacity), "%v %v %v", tt.demand, tt.weight, tt.capacity)
	}
}

// TestTenantAccounting replays the tenants workload below and above the fleet's capacity: the
// tenants' figures add up to their bands' and the bands' to the policy's, the fair shares to the
// band's service, and the second table has a row per band and tenant.
func TestTenantAccounting(t *testing.T) {
	t.Parallel()
	for _, rate := range []float64{5, 60} {
		t.Run(fmt.Sprint("rate=", rate), func(t *testing.T) {
			t.Parallel()
			tr := generate(t, Tenants{Tenants: 3, Rate: rate, Heavy: 10, Critical: 0.5, Duration: 4 * time.Second}, 1)
			rep, err := Replay(context.Background(), Config{Trace: tr, Fleet: Fleet{Plain: 4}, Parallelism: 1,
				Model: EngineModel{BlockTokens: WorkloadBlockTokens}, Policies: []string{NameRoundRobin, NameCacheAware}})
			require.NoError(t, err)
			for _, res := range rep.Results {
				require.Len(t, res.Tenants, 4)
				require.Len(t, res.Bands, 2)
				assert.Equal(t, CriticalTenant, res.Tenants[0].Tenant, "the critical band first")
				assert.Equal(t, []int{CriticalPriority, 0}, []int{res.Bands[0].Priority, res.Bands[1].Priority})
				var requests, completed, bandRequests int
				var tps float64
				for _, x := range res.Tenants {
					requests += x.Requests
					completed += x.Completed
					tps += x.OutputTokensPerSecond
					assert.Len(t, x.TTFTSamples, x.Completed)
					assert.Greater(t, x.Service, int64(0), x.Tenant)
					assert.LessOrEqual(t, x.Service, x.Demand, x.Tenant)
					assert.Equal(t, float64(x.Service), x.ServicePerWeight)
					assert.InEpsilon(t, float64(x.OutputTokens)/res.Makespan, x.OutputTokensPerSecond, 1e-12)
				}
				assert.Equal(t, rep.Requests, requests)
				assert.Equal(t, res.Completed, completed)
				assert.InEpsilon(t, res.OutputTokensPerSecond, tps, 1e-12)
				t0 := 0
				for _, b := range res.Bands {
					bandRequests += b.Requests
					var n, done int
					var demand, service int64
					var fair float64
					for ; t0 < len(res.Tenants) && res.Tenants[t0].Priority == b.Priority; t0++ {
						x := res.Tenants[t0]
						n++
						done += x.Completed
						demand += x.Demand
						service += x.Service
						fair += x.FairShare
					}
					assert.Equal(t, []any{b.Tenants, b.Completed, b.Demand, b.Service}, []any{n, done, demand, service})
					assert.InEpsilon(t, float64(service), fair, 1e-12, "the fair shares divide the band's service")
					assert.Len(t, b.TTFTSamples, b.Completed)
					assert.True(t, b.FairnessDefined())
					assert.Greater(t, b.Fairness, 0.0)
					assert.LessOrEqual(t, b.Fairness, 1.0)
				}
				assert.Equal(t, rep.Requests, bandRequests)
				assert.Equal(t, 1.0, res.Bands[0].Fairness, "one tenant in the critical band")
			}

			var table bytes.Buffer
			require.NoError(t, rep.WriteTable(&table))
			_, second, ok := strings.Cut(table.String(), "\n\nper priority band and tenant")
			require.True(t, ok, table.String())
			lines := strings.Split(strings.TrimSpace(second), "\n")
			require.Len(t, lines, 2+2*(2+4), second) // heading, columns, per policy 2 bands + 4 tenants
			assert.Equal(t, []string{"cache_aware", "1", "(all)"}, strings.Fields(lines[8])[:3])
			assert.Equal(t, []string{"cache_aware", "0", "tenant-2", "1"}, strings.Fields(lines[13])[:4])
			for _, l := range lines {
				assert.Equal(t, strings.TrimRight(l, " "), l, "no trailing spaces")
			}

			var js bytes.Buffer
			require.NoError(t, rep.WriteJSON(&js))
			var back Report
			require.NoError(t, json.Unmarshal(js.Bytes(), &back))
			assert.Equal(t, rep.Results[0].Bands[1].Fairness, back.Results[0].Bands[1].Fairness)
			assert.Equal(t, rep.Results[0].Tenants[2].Service, back.Results[0].Tenants[2].Service)
		})
	}
}

// TestTenantServiceAtLastArrival: service counts what was served when the last request arrives,
// to the token, in the middle of a decode run.
func TestTenantServiceAtLastArrival(t *testing.T) {
	t.Parallel()
	first := Request{InputTokens: 100, OutputTokens: 1000, Tenant: "a"}
	cfg := Config{Fleet: Fleet{Plain: 1}, Policies: []string{NameRoundRobin}}
	cfg.Trace = &Trace{Requests: []Request{first}}
	alone, err := Replay(context.Background(), cfg)
	require.NoError(t, err)
	ttft := alone.Results[0].TTFT.P50

	// Alone in its batch, the request's decode run starts at its first token with 101 tokens of
	// KV; step i (from 0) reads 101 + i tokens. The last request arrives halfway through step
	// k + 1, when k steps have produced their tokens.
	m := DefaultEngineModel()
	base, c := m.DecodeStepBase.Seconds(), m.kvTokenSeconds()
	for _, k := range []int{0, 1, 37, 500} {
		at := ttft + float64(k)*(base+c*101) + c*float64(k*(k-1))/2 + (base+c*float64(101+k))/2
		last := Request{Index: 1, Arrival: secondsToDuration(at), InputTokens: 50, OutputTokens: 20, Tenant: "b"}
		cfg.Trace = &Trace{Requests: []Request{first, last}, Tenants: []Tenant{{"b", 2}}}
		rep, err := Replay(context.Background(), cfg)
		require.NoError(t, err)
		res := rep.Results[0]
		require.Len(t, res.Tenants, 2)
		b, a := res.Tenants[0], res.Tenants[1]
		assert.Equal(t, []any{"b", 2.0, int64(70), int64(0)}, []any{b.Tenant, b.Weight, b.Demand, b.Service}, "listed first")
		assert.Equal(t, []any{"a", 1.0, int64(1100), int64(100 + 1 + k)}, []any{a.Tenant, a.Weight, a.Demand, a.Service}, "k=%d", k)
	}
}

// TestTenantsRejected: Trace.Tenants must name each tenant once with a finite positive weight.
func TestTenantsRejected(t *testing.T) {
	t.Parallel()
	reqs := []Request{{InputTokens: 10, OutputTokens: 2, Tenant: "a"}}
	for _, tenants := range [][]Tenant{
		{{"a", 1}, {"a", 2}},
		{{"", 1}},
		{{"a", 0}},
		{{"a", -1}},
		{{"a", math.Inf(1)}},
		{{"a", math.NaN()}},
	} {
		rep, err := Replay(context.Background(), Config{Trace: &Trace{Requests: reqs, Tenants: tenants}, Fleet: Fleet{Plain: 1}})
		assert.Nil(t, rep)
		assert.ErrorIs(t, err, state.ErrInvalidConfiguration, "%+v", tenants)
	}
}

// TestNoTenantsNoTable: a trace whose requests name no tenant has no tenant figures, in Go, in
// JSON or in the table.
func TestNoTenantsNoTable(t *testing.T) {
	t.Parallel()
	tr := generate(t, Chats{Conversations: 20, Turns: 2}, 1)
	rep, err := Replay(context.Background(), Config{Trace: tr, Fleet: Fleet{Plain: 2}, Policies: []string{NameRoundRobin}})
	require.NoError(t, err)
	assert.Nil(t, rep.Results[0].Tenants)
	assert.Nil(t, rep.Results[0].Bands)
	var js, table bytes.Buffer
	require.NoError(t, rep.WriteJSON(&js))
	require.NoError(t, rep.WriteTable(&table))
	assert.NotContains(t, js.String(), `"tenants"`)
	assert.NotContains(t, js.String(), `"bands"`)
	assert.NotContains(t, table.String(), "tenant")
}
