package sim

import (
	"math"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
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

