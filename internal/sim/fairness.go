package sim

import (
	"cmp"
	"encoding/json"
	"fmt"
	"math"
	"slices"

	"github.com/enginepick/enginepick/state"
)

// TenantResult is one tenant's share of a policy run: the requests of one Request.Tenant in one
// Request.Priority band (a tenant that sends in two bands has a TenantResult in each).
//
// Service is measured over the arrival span, from the first arrival to the last, while every
// tenant is still sending: afterwards an open-loop replay serves every admitted request in full,
// so service over the whole run would equal demand under any routing. A request's service is its
// prompt tokens that its engine has computed or served from cache (counted as prefill steps end)
// plus the output tokens it has generated.
//
// As in PolicyResult, TTFT, E2E and OutputTokensPerSecond are undefined when no request completed
// (see Defined): 0 in Go, null in JSON.
type TenantResult struct {
	// Tenant is the tenant's name; "" for requests that name none.
	Tenant string `json:"tenant"`
	// Priority is the band of its requests.
	Priority int `json:"priority"`
	// Weight is the tenant's weight (Trace.Tenants; 1 when not listed).
	Weight float64 `json:"weight"`
	// Requests is the number of its requests replayed; Completed, of those, the ones that produced
	// their last token.
	Requests  int `json:"requests"`
	Completed int `json:"completed"`
	// TTFT and E2E summarize its completed requests, as PolicyResult's.
	TTFT Latency `json:"ttft"`
	E2E  Latency `json:"e2e"`
	// OutputTokens is the output tokens of its completed requests; OutputTokensPerSecond divides
	// them by the run's Makespan, so the tenants' figures add up to PolicyResult's.
	OutputTokens          int64   `json:"output_tokens"`
	OutputTokensPerSecond float64 `json:"output_tokens_per_s"`
	// Demand is the prompt plus output tokens of its requests, Config.SystemPromptTokens
	// included, and every output at least 1 token, as the engines generate.
	Demand int64 `json:"demand_tokens"`
	// Service is the prompt plus output tokens it was served within the arrival span (see
	// TenantResult). ServicePerWeight is Service ÷ Weight.
	Service          int64   `json:"service_tokens"`
	ServicePerWeight float64 `json:"service_per_weight"`
	// FairShare is the service, in tokens, that weighted max-min fairness owes it out of its
	// band's: the band's total Service divided among its tenants in proportion to their weights,
	// none getting more than its Demand, the surplus going to the others (see
	// BandResult.Fairness). Service ÷ FairShare is 1 under perfectly fair sharing.
	FairShare float64 `json:"fair_share_tokens"`
	// TTFTSamples is the TTFT of every completed request TTFT summarizes (Config.Warmup), in
	// seconds, sorted ascending. It is not part of the JSON form.
	TTFTSamples []float64 `json:"-"`
}

// Defined reports whether TTFT, E2E and OutputTokensPerSecond are defined: some request
// completed.
func (t *TenantResult) Defined() bool { return t.Completed > 0 }

// MarshalJSON encodes t with the field names of its tags, and null for "ttft", "e2e" and
// "output_tokens_per_s" when no request completed.
func (t TenantResult) MarshalJSON() ([]byte, error) {
	type fields TenantResult // without methods, so encoding does not recurse
	out := struct {
		fields
		TTFT                  *Latency `json:"ttft"`
		E2E                   *Latency `json:"e2e"`
		OutputTokensPerSecond *float64 `json:"output_tokens_per_s"`
	}{fields: fields(t)}
	if t.Defined() {
		out.TTFT, out.E2E, out.OutputTokensPerSecond = &t.TTFT, &t.E2E, &t.OutputTokensPerSecond
	}
	return json.Marshal(out)
}

// BandResult is one priority band's share of a policy run: the TenantResults of its tenants
// summed, latencies over their requests pooled. TTFT, E2E and OutputTokensPerSecond are
// undefined as in TenantResult, and Fairness when no tenant of the band is owed service.
type BandResult struct {
	// Priority is the band's Request.Priority.
	Priority int `json:"priority"`
	// Tenants is the number of its tenants.
	Tenants int `json:"tenants"`
	// Requests, Completed, OutputTokens, OutputTokensPerSecond, Demand and Service sum its
	// tenants'.
	Requests              int     `json:"requests"`
	Completed             int     `json:"completed"`
	OutputTokens          int64   `json:"output_tokens"`
	OutputTokensPerSecond float64 `json:"output_tokens_per_s"`
	Demand                int64   `json:"demand_tokens"`
	Service               int64   `json:"service_tokens"`
	// TTFT and E2E summarize its tenants' completed requests together.
	TTFT Latency `json:"ttft"`
	E2E  Latency `json:"e2e"`
	// Fairness is Jain's fairness index (Jain, Chiu and Hawe, DEC-TR-301, 1984) over its
	// tenants' normalized service x = Service ÷ FairShare, for those with FairShare > 0:
	// (Σx)² ÷ (n·Σx²), 1 when every tenant got its fair share (or the same fraction of it), 1/n
	// when one got everything. When every tenant asks for more than its fair share, FairShare is
	// proportional to Weight and x to ServicePerWeight; a tenant that asks for less is owed only
	// what it asks for, so serving it in full while a heavier one gets the rest is fair.
	Fairness float64 `json:"fairness"`
	// TTFTSamples pools its tenants' TTFTSamples, sorted ascending. It is not part of the JSON
	// form.
	TTFTSamples []float64 `json:"-"`
}

// Defined reports whether TTFT, E2E and OutputTokensPerSecond are defined: some request
// completed.
func (b *BandResult) Defined() bool { return b.Completed > 0 }

// FairnessDefined reports whether Fairness is defined: some tenant of the band is owed service
// (the band was served something within the arrival span).
func (b *BandResult) FairnessDefined() bool { return b.Service > 0 }

// MarshalJSON encodes b with the field names of its tags, and null for "ttft", "e2e" and
// "output_tokens_per_s" when no request completed and for "fairness" when it is undefined.
func (b BandResult) MarshalJSON() ([]byte, error) {
	type fields BandResult // without methods, so encoding does not recurse
	out := struct {
		fields
		TTFT                  *Latency `json:"ttft"`
		E2E                   *Latency `json:"e2e"`
		OutputTokensPerSecond *float64 `json:"output_tokens_per_s"`
		Fairness              *float64 `json:"fairness"`
	}{fields: fields(b)}
	if b.Defined() {
		out.TTFT, out.E2E, out.OutputTokensPerSecond = &b.TTFT, &b.E2E, &b.OutputTokensPerSecond
	}
	if b.FairnessDefined() {
		out.Fairness = &b.Fairness
	}
	return json.Marshal(out)
}

// jainIndex returns Jain's fairness index of x, (Σx)² ÷ (n·Σx²): 1 when every x is equal, 1/n
// when one holds everything. 0 when x is empty or all zero (undefined).
func jainIndex(x []float64) float64 {
	var sum, sq float64
	for _, v := range x {
		sum += v
		sq += v * v
	}
	if sq == 0 {
		return 0
	}
	return sum * sum / (float64(len(x)) * sq)
}

// fairShares divides capacity among claimants by weighted max-min fairness (water-filling):
// claimant i, of weight[i] > 0, gets min(demand[i], λ·weight[i]), with λ the level at which the
// shares add up to capacity; when capacity covers every demand, each gets its demand.
func fairShares(demand, weight []float64, capacity float64) []float64 {
	order := make([]int, len(demand))
	for i := range order {
		order[i] = i
	}
	slices.SortStableFunc(order, func(a, b int) int { return cmp.Compare(demand[a]/weight[a], demand[b]/weight[b]) })
	var w float64
	for _, i := range order {
		w += weight[i]
	}
	share := make([]float64, len(demand))
	left := capacity
	for k, i := range order {
		if level := left / w; demand[i] > level*weight[i] {
			for _, j := range order[k:] {
				share[j] = level * weight[j]
			}
			return share
		}
		share[i] = demand[i]
		left -= demand[i]
		w -= weight[i]
	}
	return share
}

// flowKey names a tenant in one priority band.
type flowKey struct {
	tenant   string
	priority int
}

// flowPlan is the tenants and bands of a replay's requests, shared read-only by its runs.
type flowPlan struct {
	keys   []flowKey // by priority, highest first, then by Trace.Tenants order, then first request
	weight []float64 // per key
	of     []int32   // per replayed request, its key's index
	demand []int64   // per key, in tokens
}

// flowStats accumulates one flow's outcomes in a run.
type flowStats struct {
	completed int
	outputTok int64
	service   int64
	ttft, e2e []float64
}

// resolveTenants validates Trace.Tenants and, when some request names a tenant or a band, sets
// rc.flows.
func (rc *resolved) resolveTenants() error {
	order := map[string]int{}
	for i, t := range rc.Trace.Tenants {
		if _, dup := order[t.Name]; dup || t.Name == "" || !(t.Weight > 0) || math.IsInf(t.Weight, 1) {
			return &configError{msg: fmt.Sprintf("sim: Trace.Tenants[%d] = %+v: names must be unique and not empty, weights finite and > 0",
				i, t), errs: []error{state.ErrInvalidConfiguration}}
		}
		order[t.Name] = i
	}
	tagged := slices.ContainsFunc(rc.requests, func(r Request) bool { return r.Tenant != "" || r.Priority != 0 })
	if !tagged {
		return nil
	}
	p := &flowPlan{of: make([]int32, len(rc.requests))}
	index := map[flowKey]int{}
	for k := range rc.requests {
		r := &rc.requests[k]
		key := flowKey{r.Tenant, r.Priority}
		if _, ok := index[key]; !ok {
			index[key] = len(p.keys)
			p.keys = append(p.keys, key)
		}
	}
	rank := func(k flowKey) int {
		if i, ok := order[k.tenant]; ok {
			return i
		}
		return len(order) + index[k]
	}
	slices.SortFunc(p.keys, func(a, b flowKey) int {
		return cmp.Or(cmp.Compare(b.priority, a.priority), cmp.Compare(rank(a), rank(b)))
	})
	for i, key := range p.keys {
		index[key] = i
		w := 1.0
		if j, ok := order[key.tenant]; ok {
			w = rc.Trace.Tenants[j].Weight
		}
		p.weight = append(p.weight, w)
	}
	p.demand = make([]int64, len(p.keys))
	for k := range rc.requests {
		r := &rc.requests[k]
		f := index[flowKey{r.Tenant, r.Priority}]
		p.of[k] = int32(f)
		p.demand[f] += int64(rc.SystemPromptTokens+r.InputTokens) + int64(max(r.OutputTokens, 1))
	}
	rc.flows = p
	return nil
}

// recordFlow accounts a finished request to its flow.
func (r *run) recordFlow(q *reqState, measured bool, ttft, e2e float64) {
	f := &r.flows[r.rc.flows.of[q.pos]]
	f.completed++
	f.outputTok += int64(q.output)
	if measured {
		f.ttft = append(f.ttft, ttft)
		f.e2e = append(f.e2e, e2e)
	}
}

// measureService sets every flow's service: the prompt and output tokens served by now (see
// TenantResult). It is called when the last request arrives, before that request is routed.
func (r *run) measureService() {
	// Output tokens of the decode runs in progress, which requests' generated counts include only
	// when a run ends.
	inRun := map[*reqState]int{}
	for _, e := range r.all {
		if e.kind != segDecode {
			continue
		}
		k := e.stepsCovering(r.now - e.segStart)
		if k > 0 && e.decodeTime(k) > r.now-e.segStart {
			k-- // the step in progress has not produced its token yet
		}
		for _, q := range e.decoding {
			inRun[q] = k
		}
	}
	for k := range r.reqs {
		q := &r.reqs[k]
		served := q.cached + q.prefilled + min(q.generated+inRun[q], q.output)
		r.flows[r.rc.flows.of[k]].service += int64(served)
	}
}

// flowResults returns the run's per-tenant and per-band results; span is its Makespan in seconds.
func (r *run) flowResults(span float64) ([]TenantResult, []BandResult) {
	p := r.rc.flows
	count := make([]int, len(p.keys))
	for _, f := range p.of {
		count[f]++
	}
	perSecond := func(tokens int64) float64 {
		if span > 0 {
			return float64(tokens) / span
		}
		return 0
	}
	tenants := make([]TenantResult, len(p.keys))
	var bands []BandResult
	for i, key := range p.keys {
		f := &r.flows[i]
		slices.Sort(f.ttft)
		slices.Sort(f.e2e)
		tenants[i] = TenantResult{Tenant: key.tenant, Priority: key.priority, Weight: p.weight[i],
			Requests: count[i], Completed: f.completed, TTFT: summarize(f.ttft), E2E: summarize(f.e2e),
			OutputTokens: f.outputTok, OutputTokensPerSecond: perSecond(f.outputTok), Demand: p.demand[i],
			Service: f.service, ServicePerWeight: float64(f.service) / p.weight[i], TTFTSamples: f.ttft}
		if len(bands) == 0 || bands[len(bands)-1].Priority != key.priority {
			bands = append(bands, BandResult{Priority: key.priority})
		}
	}
	first := 0
	for b := range bands {
		band := &bands[b]
		end := first
		var e2e []float64
		for end < len(tenants) && tenants[end].Priority == band.Priority {
			t := &tenants[end]
			band.Tenants++
			band.Requests += t.Requests
			band.Completed += t.Completed
			band.OutputTokens += t.OutputTokens
			band.Demand += t.Demand
			band.Service += t.Service
			band.TTFTSamples = append(band.TTFTSamples, t.TTFTSamples...)
			e2e = append(e2e, r.flows[end].e2e...)
			end++
		}
		slices.Sort(band.TTFTSamples)
		slices.Sort(e2e)
		band.TTFT, band.E2E = summarize(band.TTFTSamples), summarize(e2e)
		band.OutputTokensPerSecond = perSecond(band.OutputTokens)
		members := tenants[first:end]
		demand := make([]float64, len(members))
		weight := make([]float64, len(members))
		for j := range members {
			demand[j], weight[j] = float64(members[j].Demand), members[j].Weight
		}
		shares := fairShares(demand, weight, float64(band.Service))
		var x []float64
		for j := range members {
			members[j].FairShare = shares[j]
			if shares[j] > 0 {
				x = append(x, float64(members[j].Service)/shares[j])
			}
		}
		band.Fairness = jainIndex(x)
		first = end
	}
	return tenants, bands
}
