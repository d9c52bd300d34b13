package sim

import (
	"cmp"
	"fmt"
	"math"
	"math/rand/v2"
	"strconv"
	"time"
)

// WorkloadTenants names Tenants.
const WorkloadTenants = "tenants"

// Shape of the tenants workload.
const (
	// TenantSystemPrompts is the number of system prompts each tenant has; a request opens with
	// one of its tenant's, chosen uniformly.
	TenantSystemPrompts = 8
	// CriticalTenant is the name of the tenant of the critical band (Tenants.Critical).
	CriticalTenant = "critical"
	// CriticalPriority is the critical tenant's Request.Priority; the other tenants' is 0.
	CriticalPriority = 1
	// MaxTenants bounds Tenants.Tenants.
	MaxTenants = 1000
)

// Defaults of Tenants. ParseWorkload also defaults heavy and critical; in the struct their zero
// value means none (see Tenants).
const (
	// DefaultTenantCount is Tenants.Tenants' default.
	DefaultTenantCount = 4
	// DefaultTenantRate is Tenants.Rate's default, in requests per second of each tenant.
	DefaultTenantRate = 25.0
	// DefaultTenantHeavy is the heavy tenant's multiple ParseWorkload defaults to: tenant 0 sends
	// 10 × the others' rate.
	DefaultTenantHeavy = 10.0
	// DefaultTenantCritical is the critical tenant's multiple ParseWorkload defaults to: with the
	// other defaults, 0.7 ÷ 13.7 = 5.1 % of the requests.
	DefaultTenantCritical = 0.7
	// DefaultTenantDuration is Tenants.Duration's default.
	DefaultTenantDuration = 60 * time.Second
)

// Tenants is a workload of tenants sharing the fleet, each with its own Poisson arrival process:
// Tenants tenants of the default band (priority 0) named "tenant-0" … "tenant-<n−1>", each
// sending Rate requests per second except tenant 0, the heavy tenant, which sends Heavy × Rate,
// and the critical tenant (CriticalTenant, priority CriticalPriority), which sends Critical × Rate.
// Every tenant has weight 1 (Trace.Tenants). Arrivals span [0, Duration).
//
// A request has the shape of a chat's first turn (see Chats): one of its tenant's
// TenantSystemPrompts system prompts, each of uniform length in [0, ChatSystemPromptMaxTokens],
// followed by a new user message, and a reply as output; messages and replies are uniform in
// [ChatMessageMinTokens, ChatMessageMaxTokens] tokens. So a tenant's requests share its system
// prompts, token for token, and no tenant shares a prefix with another.
//
// Each tenant draws its system prompts, arrivals and lengths from its own random source, seeded
// by the workload seed and the tenant alone: changing Heavy or Critical, or removing tenant 0
// (Heavy 0) or the critical tenant (Critical 0), leaves every other tenant's requests exactly as
// they were, which gives a baseline with the same arrivals. Adding tenants adds requests and
// changes none either.
//
// Request.Tenant and Priority are set, Session is "". Unlike the other workloads, the zero value
// of Heavy and Critical means none rather than a default; every other zero field means its
// default.
type Tenants struct {
	// Tenants is the number of tenants of the default band. 0 means DefaultTenantCount; at most
	// MaxTenants.
	Tenants int
	// Rate is each default-band tenant's requests per second (a Poisson process), tenant 0's
	// times Heavy. 0 means DefaultTenantRate; must be finite and > 0.
	Rate float64
	// Heavy is tenant 0's rate as a multiple of Rate: 1 makes it one tenant among equals, 0
	// removes it. Finite and >= 0.
	Heavy float64
	// Critical is the critical tenant's rate as a multiple of Rate; 0 means no critical tenant.
	// Finite and >= 0.
	Critical float64
	// Duration is the span of the arrivals. 0 means DefaultTenantDuration; at most MaxArrival.
	// With the rates, it bounds the requests: the expected number, (Tenants − 1 + Heavy +
	// Critical) × Rate × Duration, is at most MaxWorkloadRequests ÷ 2.
	Duration time.Duration
}

// Salts of the tenants' random sources: tenant i uses tenantSalt + i.
const (
	tenantSalt   = 0x74656e616e74     // "tenant"
	criticalSalt = 0x637269746963616c // "critical"
)

// filled returns w with zero fields replaced by their defaults (Heavy and Critical stay).
func (w Tenants) filled() Tenants {
	w.Tenants = cmp.Or(w.Tenants, DefaultTenantCount)
	w.Rate = cmp.Or(w.Rate, DefaultTenantRate)
	w.Duration = cmp.Or(w.Duration, DefaultTenantDuration)
	return w
}

// validate checks a filled w; the error names the field and the rule.
func (w Tenants) validate() error {
	finite := func(f float64) bool { return !math.IsNaN(f) && !math.IsInf(f, 0) }
	streams := float64(w.Tenants-1) + w.Heavy + w.Critical
	switch {
	case w.Tenants < 1 || w.Tenants > MaxTenants:
		return fmt.Errorf("tenants %d: must be in [1, %d]", w.Tenants, MaxTenants)
	case !(w.Rate > 0) || !finite(w.Rate):
		return fmt.Errorf("rate %v: must be finite and > 0", w.Rate)
	case !(w.Heavy >= 0) || !finite(w.Heavy):
		return fmt.Errorf("heavy %v: must be finite and >= 0", w.Heavy)
	case !(w.Critical >= 0) || !finite(w.Critical):
		return fmt.Errorf("critical %v: must be finite and >= 0", w.Critical)
	case w.Duration <= 0 || w.Duration > MaxArrival:
		return fmt.Errorf("duration %v: must be in (0, %v]", w.Duration, MaxArrival)
	case streams == 0:
		return fmt.Errorf("no tenant sends: with tenants 1, heavy or critical must be > 0")
	case !(streams*w.Rate*w.Duration.Seconds() <= MaxWorkloadRequests/2):
		return fmt.Errorf("%.0f requests expected: must be at most %d (lower the rates or the duration)",
			streams*w.Rate*w.Duration.Seconds(), MaxWorkloadRequests/2)
	}
	return nil
}

// String returns the canonical spec, for example
// "tenants:tenants=4,rate=10,heavy=10,critical=0.7,duration=1m0s".
func (w Tenants) String() string {
	w = w.filled()
	f := func(x float64) string { return strconv.FormatFloat(x, 'g', -1, 64) }
	return fmt.Sprintf("%s:tenants=%d,rate=%s,heavy=%s,critical=%s,duration=%v", WorkloadTenants,
		w.Tenants, f(w.Rate), f(w.Heavy), f(w.Critical), w.Duration)
}

// Generate implements Workload (see Tenants). It also errs, wrapping ErrBadWorkload, when no
// request arrives within Duration or more than MaxWorkloadRequests do.
func (w Tenants) Generate(seed uint64) (*Trace, error) {
	w = w.filled()
	fail := func(err error) error {
		return &configError{msg: "sim: Tenants " + w.String() + ": " + err.Error(), errs: []error{ErrBadWorkload}}
	}
	if err := w.validate(); err != nil {
		return nil, fail(err)
	}
	var reqs []Request
	var tenants []Tenant
	add := func(name string, priority int, rate float64, rng *rand.Rand) {
		if rate == 0 {
			return
		}
		tenants = append(tenants, Tenant{Name: name, Weight: 1})
		message := func() int { return ChatMessageMinTokens + rng.IntN(ChatMessageMaxTokens-ChatMessageMinTokens+1) }
		var prompts [TenantSystemPrompts]Segment
		for k := range prompts {
			prompts[k] = Segment{Stream: rng.Uint64(), Tokens: rng.IntN(ChatSystemPromptMaxTokens + 1)}
		}
		end := w.Duration.Seconds()
		for at := rng.ExpFloat64() / rate; at < end; at += rng.ExpFloat64() / rate {
			system := prompts[rng.IntN(len(prompts))]
			user := Segment{Stream: rng.Uint64(), Tokens: message()}
			segs := []Segment{user}
			if system.Tokens > 0 {
				segs = []Segment{system, user}
			}
			reqs = append(reqs, Request{Arrival: secondsToDuration(at), InputTokens: system.Tokens + user.Tokens,
				OutputTokens: message(), Segments: segs, Tenant: name, Priority: priority})
		}
	}
	for i := range w.Tenants {
		rate := w.Rate
		if i == 0 {
			rate *= w.Heavy
		}
		add("tenant-"+strconv.Itoa(i), 0, rate, rand.New(rand.NewPCG(seed, tenantSalt+uint64(i))))
	}
	add(CriticalTenant, CriticalPriority, w.Critical*w.Rate, rand.New(rand.NewPCG(seed, criticalSalt)))
	switch {
	case len(reqs) == 0:
		return nil, fail(fmt.Errorf("no request arrives within %v: raise the rates or the duration", w.Duration))
	case len(reqs) > MaxWorkloadRequests:
		return nil, fail(fmt.Errorf("%d requests: more than %d", len(reqs), MaxWorkloadRequests))
	}
	t := generated(w, seed, reqs)
	t.Tenants = tenants
	return t, nil
}
