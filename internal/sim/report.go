package sim

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"

	"gonum.org/v1/gonum/floats"
	"gonum.org/v1/gonum/stat"
)

// Report is the outcome of a Replay: the setup and one PolicyResult per policy, in Config.Policies
// order. Times are in seconds of virtual time. A Report holds no wall-clock reading, so the same
// Config yields the same Report, byte for byte, in WriteTable and in JSON.
type Report struct {
	// Trace is the trace's Name.
	Trace string `json:"trace"`
	// Requests is the number of requests replayed (after Config.Limit).
	Requests int `json:"requests"`
	// Span is the time from the first to the last arrival after Speed, in seconds.
	Span float64 `json:"span_s"`
	// Speed is the time compression applied (arrival offsets were divided by it).
	Speed float64 `json:"speed"`
	// Seed is the random seed of every policy run.
	Seed uint64 `json:"seed"`
	// SpreadArrivals is whether each second's arrivals were spread over it (Config.SpreadArrivals).
	SpreadArrivals bool `json:"spread_arrivals,omitempty"`
	// Fleet is the simulated deployment.
	Fleet Fleet `json:"fleet"`
	// SystemPromptTokens is the shared prefix prepended to every prompt (Config.SystemPromptTokens).
	SystemPromptTokens int `json:"system_prompt_tokens,omitempty"`
	// Routers is the number of router replicas (Config.Routers, at least 1).
	Routers int `json:"routers"`
	// ShareDelay is the delay of the replicas' shared decisions (Config.ShareRouters), in
	// seconds; 0 when they share nothing.
	ShareDelay float64 `json:"share_delay,omitempty"`
	// Reports is ReportsBasic when the engines' load reports had no native extension
	// (Config.Reports); empty for native reports.
	Reports LoadReports `json:"reports,omitempty"`
	// FlowControl is whether the routers ran flow control (Config.FlowControl).
	FlowControl bool `json:"flow_control,omitempty"`
	// Warmup is Config.Warmup in seconds: the latency figures leave out the requests arriving
	// before it.
	Warmup float64 `json:"warmup_s,omitempty"`
	// Model is the engines' performance model, defaults filled in.
	Model EngineModel `json:"model"`
	// ReportInterval is the engines' load report interval, in seconds.
	ReportInterval float64 `json:"report_interval_s"`
	// Adapters is the number of LoRA adapters the requests name (Request.Adapter); 0, and absent
	// from the JSON form, when they name none.
	Adapters int `json:"adapters,omitempty"`
	// InfiniteCacheHitRate is the trace's own limit: the fraction of replayed prompt tokens an
	// infinite prefix cache shared by every engine would hold (Trace.InfiniteCacheTokenHitRatio
	// over the replayed requests). 0 for a trace without hash IDs or segments and no system
	// prompt; token-exact for a generated trace, whose requests have segments. With a
	// system prompt of S tokens, every request but the first also hits its S tokens:
	// (hit + S·(requests − 1)) ÷ (prompt tokens + S·requests), exact at token granularity (with
	// LoRA adapters, the first request of the base model and of each adapter misses them).
	InfiniteCacheHitRate float64 `json:"infinite_cache_hit_rate"`
	// Results has one entry per policy.
	Results []PolicyResult `json:"results"`
}

// Latency summarizes a latency distribution over completed requests, in seconds: empirical
// quantiles (gonum stat.Quantile, stat.Empirical) and the mean. All zero when no request
// completed.
type Latency struct {
	P50  float64 `json:"p50_s"`
	P90  float64 `json:"p90_s"`
	P99  float64 `json:"p99_s"`
	Mean float64 `json:"mean_s"`
}

// PolicyResult is one policy's replay.
//
// A figure that no request defines is undefined, not zero: when no request completed (admission
// rejected them all, say), TTFT, E2E, OutputTokensPerSecond, RequestsPerSecond, Imbalance,
// PrefillUtilization and BusyUtilization, and HitRate when no prompt token was admitted, hold 0
// in Go (see Defined and HitRateDefined), print as "n/a" in WriteTable and are null in the JSON
// form (MarshalJSON).
type PolicyResult struct {
	// Policy is the policy name as listed in Config.Policies.
	Policy string `json:"policy"`
	// Completed is the number of requests that produced their last token.
	Completed int `json:"completed"`
	// Rejected counts requests no bucket would take because admission rejected every engine the
	// policy chose (HTTP 503 from the router); they are dropped.
	Rejected int `json:"rejected"`
	// Shed counts requests flow control refused (HTTP 429: its queue or band was full, a request
	// of a higher band displaced it, or its band is sheddable); they are dropped. With
	// Config.FlowControl, Rejected also counts waits that reached their band's TTL (503).
	Shed int `json:"shed,omitempty"`
	// Unroutable counts requests longer than the bucket's context (prompt plus output above
	// EngineModel.MaxContextTokens; HTTP 400); they are dropped.
	Unroutable int `json:"unroutable"`
	// PromptTokens and CachedTokens sum, over admitted requests, the prompt tokens and those the
	// plain or prefill engine's cache actually served at admission.
	PromptTokens int64 `json:"prompt_tokens"`
	CachedTokens int64 `json:"cached_tokens"`
	// HitRate is CachedTokens ÷ PromptTokens (0 when no prompt token was admitted).
	HitRate float64 `json:"hit_rate"`
	// TTFT is arrival to first token (PD: until the KV reached the decode engine). E2E is
	// arrival to last token. Both summarize the completed requests that arrived at or after
	// Config.Warmup.
	TTFT Latency `json:"ttft"`
	E2E  Latency `json:"e2e"`
	// Makespan is from the first arrival to the last completion, in seconds.
	Makespan float64 `json:"makespan_s"`
	// OutputTokensPerSecond and RequestsPerSecond are completed output tokens and requests per
	// second of Makespan.
	OutputTokensPerSecond float64 `json:"output_tokens_per_s"`
	RequestsPerSecond     float64 `json:"requests_per_s"`
	// EngineRequests counts the requests routed to each plain (PD: prefill) engine, in engine ID
	// order.
	EngineRequests []int `json:"engine_requests"`
	// Imbalance is max ÷ mean of EngineRequests: 1 is perfectly even (0 when nothing was routed).
	Imbalance float64 `json:"imbalance"`
	// PrefillUtilization is the mean, over plain (PD: prefill) engines, of the fraction of
	// Makespan spent in prefill steps.
	PrefillUtilization float64 `json:"prefill_utilization"`
	// BusyUtilization is the same fraction for prefill and decode steps together (plain
	// engines; PD: prefill engines).
	BusyUtilization float64 `json:"busy_utilization"`
	// AdapterLoads counts the LoRA adapters the plain (PD: prefill) engines loaded into a slot
	// (EngineModel.MaxLoRAs); 0, and absent from the JSON form, when the requests name no
	// adapter. WriteTable prints it per 1,000 requests replayed.
	AdapterLoads int `json:"adapter_loads,omitempty"`
	// Overload tells whether the fleet kept up with the trace under this policy.
	Overload Overload `json:"overload"`
	// Tenants has one entry per tenant and priority band of the requests, by band (highest
	// priority first), then in Trace.Tenants order; Bands one per band, in the same order. Both
	// are nil, and absent from the JSON form, when no request names a tenant or a band
	// (Request.Tenant, Request.Priority).
	Tenants []TenantResult `json:"tenants,omitempty"`
	Bands   []BandResult   `json:"bands,omitempty"`
	// TTFTSamples is the TTFT of every completed request TTFT summarizes, in seconds, sorted
	// ascending, for plots. It is not part of the JSON form.
	TTFTSamples []float64 `json:"-"`
}

// Defined reports whether the latency, throughput, imbalance and utilization figures of r are
// defined: some request completed.
func (r *PolicyResult) Defined() bool { return r.Completed > 0 }

// HitRateDefined reports whether HitRate is defined: some prompt token was admitted.
func (r *PolicyResult) HitRateDefined() bool { return r.PromptTokens > 0 }

// MarshalJSON encodes r with the field names of its tags, and null for each undefined figure
// (see PolicyResult): "ttft", "e2e", "output_tokens_per_s", "requests_per_s", "imbalance",
// "prefill_utilization" and "busy_utilization" when no request completed, "hit_rate" when no
// prompt token was admitted. Decoding null leaves the Go zero value.
func (r PolicyResult) MarshalJSON() ([]byte, error) {
	type fields PolicyResult // without methods, so encoding does not recurse
	out := struct {
		fields
		HitRate               *float64 `json:"hit_rate"`
		TTFT                  *Latency `json:"ttft"`
		E2E                   *Latency `json:"e2e"`
		OutputTokensPerSecond *float64 `json:"output_tokens_per_s"`
		RequestsPerSecond     *float64 `json:"requests_per_s"`
		Imbalance             *float64 `json:"imbalance"`
		PrefillUtilization    *float64 `json:"prefill_utilization"`
		BusyUtilization       *float64 `json:"busy_utilization"`
	}{fields: fields(r)}
	if r.HitRateDefined() {
		out.HitRate = &r.HitRate
	}
	if r.Defined() {
		out.TTFT, out.E2E = &r.TTFT, &r.E2E
		out.OutputTokensPerSecond, out.RequestsPerSecond = &r.OutputTokensPerSecond, &r.RequestsPerSecond
		out.Imbalance = &r.Imbalance
		out.PrefillUtilization, out.BusyUtilization = &r.PrefillUtilization, &r.BusyUtilization
	}
	return json.Marshal(out)
}

// result summarizes a finished run.
func (r *run) result() PolicyResult {
	res := PolicyResult{
		Policy:       r.name,
		Completed:    r.finished,
		Rejected:     r.rejected,
		Shed:         r.shed,
		Unroutable:   r.unroutable,
		PromptTokens: r.promptTok,
		CachedTokens: r.cachedTok,
	}
	if r.promptTok > 0 {
		res.HitRate = float64(r.cachedTok) / float64(r.promptTok)
	}
	slices.Sort(r.ttft)
	slices.Sort(r.e2e)
	res.TTFT, res.E2E = summarize(r.ttft), summarize(r.e2e)
	res.TTFTSamples = r.ttft
	span := r.lastFinish - r.reqs[0].arrival
	res.Makespan = span.Seconds()
	if span > 0 {
		res.OutputTokensPerSecond = float64(r.outputTok) / span.Seconds()
		res.RequestsPerSecond = float64(r.finished) / span.Seconds()
	}
	res.Overload = r.overload()
	if r.flows != nil {
		res.Tenants, res.Bands = r.flowResults(span.Seconds())
	}
	counts := make([]float64, len(r.front))
	var prefill, busy []float64
	for k, e := range r.front {
		res.AdapterLoads += e.loads
		res.EngineRequests = append(res.EngineRequests, e.dispatched)
		counts[k] = float64(e.dispatched)
		if span > 0 {
			prefill = append(prefill, e.prefillBusy.Seconds()/span.Seconds())
			busy = append(busy, (e.prefillBusy+e.decodeBusy).Seconds()/span.Seconds())
		}
	}
	if mean := stat.Mean(counts, nil); mean > 0 {
		res.Imbalance = floats.Max(counts) / mean
	}
	if len(prefill) > 0 {
		res.PrefillUtilization = stat.Mean(prefill, nil)
		res.BusyUtilization = stat.Mean(busy, nil)
	}
	return res
}

// summarize computes the quantiles of sorted samples.
func summarize(sorted []float64) Latency {
	if len(sorted) == 0 {
		return Latency{}
	}
	return Latency{
		P50:  stat.Quantile(0.50, stat.Empirical, sorted, nil),
		P90:  stat.Quantile(0.90, stat.Empirical, sorted, nil),
		P99:  stat.Quantile(0.99, stat.Empirical, sorted, nil),
		Mean: stat.Mean(sorted, nil),
	}
}

func newReport(rc *resolved, results []PolicyResult) *Report {
	reqs := rc.requests
	t := &Trace{Name: rc.Trace.Name, Format: rc.Trace.Format, Requests: reqs}
	stats := t.InfiniteCache()
	hitRate := stats.TokenHitRatio()
	if sp := int64(rc.SystemPromptTokens); sp > 0 {
		var prompt int64
		for i := range reqs {
			prompt += int64(reqs[i].InputTokens)
		}
		n := int64(len(reqs))
		// The first request of the base model and of each adapter misses it (an adapter's KV is
		// its own).
		firsts := int64(len(rc.adapters))
		if slices.ContainsFunc(reqs, func(r Request) bool { return r.Adapter == "" }) {
			firsts++
		}
		hitRate = float64(stats.HitTokens+sp*(n-firsts)) / float64(prompt+sp*n)
	}
	first := float64(reqs[0].Arrival) / rc.Speed
	last := float64(reqs[len(reqs)-1].Arrival) / rc.Speed
	return &Report{
		Trace:                rc.Trace.Name,
		Requests:             len(reqs),
		Span:                 (last - first) / 1e9,
		Speed:                rc.Speed,
		Seed:                 rc.Seed,
		SpreadArrivals:       rc.SpreadArrivals,
		Fleet:                rc.Fleet,
		Adapters:             len(rc.adapters),
		SystemPromptTokens:   rc.SystemPromptTokens,
		Routers:              rc.Routers,
		ShareDelay:           rc.shareDelay(),
		Reports:              basicOnly(rc.Reports),
		FlowControl:          rc.flowControlled(),
		Warmup:               rc.Warmup.Seconds(),
		Model:                rc.Model,
		ReportInterval:       rc.ReportInterval.Seconds(),
		InfiniteCacheHitRate: hitRate,
		Results:              results,
	}
}

// basicOnly returns ReportsBasic for basic reports and "" for native ones: reports record only the
// departure from the default.
func basicOnly(r LoadReports) LoadReports {
	if r == ReportsBasic {
		return r
	}
	return ""
}

// Result returns the result of the named policy.
func (rep *Report) Result(policy string) (PolicyResult, bool) {
	for _, r := range rep.Results {
		if r.Policy == policy {
			return r, true
		}
	}
	return PolicyResult{}, false
}

// WriteJSON writes the report as indented JSON (TTFTSamples omitted).
func (rep *Report) WriteJSON(w io.Writer) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(rep)
}

// WriteTable writes the report as a heading and an aligned text table, one row per policy:
// prefix hit rate, when the requests name LoRA adapters the adapters the engines loaded per 1,000
// requests replayed, TTFT p50/p90/p99, end-to-end p50/p99 (seconds), output throughput, load
// imbalance, mean prefill utilization of the engines, requests dropped because admission rejected
// every engine or their flow-control wait timed out (503), with flow control the requests it
// refused (429), and requests too long for any bucket (400). An undefined figure (see
// PolicyResult) prints as "n/a". After the table, one warning line per overloaded policy run (see
// Overload), starting "warning: ".
func (rep *Report) WriteTable(w io.Writer) error {
	bw := bufio.NewWriter(w)
	name := rep.Trace
	if name == "" {
		name = "(unnamed trace)"
	}
	fmt.Fprintf(bw, "trace %s: %d requests over %.0f s (speed %g), fleet %s, seed %d",
		name, rep.Requests, rep.Span, rep.Speed, rep.Fleet, rep.Seed)
	if rep.SpreadArrivals {
		fmt.Fprint(bw, ", arrivals spread within each second")
	}
	if rep.SystemPromptTokens > 0 {
		fmt.Fprintf(bw, ", %d-token system prompt", rep.SystemPromptTokens)
	}
	if rep.Routers > 1 {
		fmt.Fprintf(bw, ", %d router replicas", rep.Routers)
		if rep.ShareDelay > 0 {
			fmt.Fprintf(bw, " sharing decisions (%g ms)", rep.ShareDelay*1e3)
		}
	}
	if rep.Reports == ReportsBasic {
		fmt.Fprint(bw, ", basic load reports (running and waiting only)")
	}
	if rep.FlowControl {
		fmt.Fprint(bw, ", flow control")
	}
	if rep.Adapters > 0 {
		fmt.Fprintf(bw, ", %d LoRA adapters", rep.Adapters)
	}
	if rep.Warmup > 0 {
		fmt.Fprintf(bw, ", latencies of arrivals after %g s", rep.Warmup)
	}
	fmt.Fprintln(bw)
	m := &rep.Model
	prefill := fmt.Sprintf("prefill %.0f tok/s + %.2f ns per attended token pair", m.PrefillLinearTokensPerSecond,
		1e9/m.PrefillAttentionPairsPerSecond)
	if m.PrefillModel == PrefillFlat {
		prefill = fmt.Sprintf("flat prefill %.0f tok/s", m.PrefillTokensPerSecond)
	}
	lora := ""
	if rep.Adapters > 0 {
		lora = fmt.Sprintf(", %d LoRA slots (load %v)", m.MaxLoRAs, m.LoRALoadTime)
	}
	fmt.Fprintf(bw, "engines: %s, decode step %v + %.1f ns/KV token, KV %d tokens in %d-token blocks, max %d running, chunk %d%s; load reports every %g s\n",
		prefill, m.DecodeStepBase, m.kvTokenSeconds()*1e9, m.KVCapacityTokens, m.BlockTokens,
		m.MaxRunningRequests, m.ChunkedPrefillTokens, lora, rep.ReportInterval)
	if m.PriorityScheduling {
		fmt.Fprintln(bw, "engines schedule waiting requests by priority (vLLM --scheduling-policy priority)")
	}
	fmt.Fprintf(bw, "infinite-cache prefix hit limit: %.1f %% of prompt tokens\n\n", 100*rep.InfiniteCacheHitRate)
	tw := tabwriter.NewWriter(bw, 0, 0, 2, ' ', 0)
	shed, loads := "", ""
	if rep.FlowControl {
		shed = "shed\t"
	}
	if rep.Adapters > 0 {
		loads = "loads/1k\t"
	}
	fmt.Fprintln(tw, "policy\thit rate\t"+loads+"TTFT p50\tp90\tp99\tE2E p50\tp99\tout tok/s\timbalance\tprefill util\tbusy\trejected\t"+shed+"too long")
	for i := range rep.Results {
		r := &rep.Results[i]
		def := r.Defined()
		if rep.FlowControl {
			shed = strconv.Itoa(r.Shed) + "\t"
		}
		if rep.Adapters > 0 {
			loads = fmt.Sprintf("%.1f\t", 1000*float64(r.AdapterLoads)/float64(rep.Requests))
		}
		fmt.Fprintf(tw, "%s\t%s\t%s%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%d\t%s%d\n", r.Policy,
			figure(r.HitRateDefined(), "%.1f %%", 100*r.HitRate), loads,
			figure(def, "%.2f s", r.TTFT.P50), figure(def, "%.2f s", r.TTFT.P90), figure(def, "%.2f s", r.TTFT.P99),
			figure(def, "%.1f s", r.E2E.P50), figure(def, "%.1f s", r.E2E.P99),
			figure(def, "%.0f", r.OutputTokensPerSecond), figure(def, "%.2f", r.Imbalance),
			figure(def, "%.0f %%", 100*r.PrefillUtilization), figure(def, "%.0f %%", 100*r.BusyUtilization),
			r.Rejected, shed, r.Unroutable)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	for _, warning := range rep.Warnings() {
		fmt.Fprintln(bw, warning)
	}
	if err := rep.writeTenantTable(bw); err != nil {
		return err
	}
	return bw.Flush()
}

// writeTenantTable writes, when the results have tenants, a blank line and a second table: per
// policy, one row per priority band (highest first) followed by one row per tenant of the band:
// requests, completed, TTFT p50/p99, E2E p99, output throughput, service within the arrival span
// (millions of tokens), service ÷ weight, service ÷ fair share, and on band rows Jain's index of
// the band's tenants (see TenantResult, BandResult).
func (rep *Report) writeTenantTable(w io.Writer) error {
	if !slices.ContainsFunc(rep.Results, func(r PolicyResult) bool { return r.Bands != nil }) {
		return nil
	}
	fmt.Fprintln(w, "\nper priority band and tenant; service: prompt and output tokens served by the last arrival (M tokens), "+
		"fair: its weighted max-min share of the band's service")
	var table bytes.Buffer
	tw := tabwriter.NewWriter(&table, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "policy\tband\ttenant\tweight\trequests\tcompleted\tTTFT p50\tp99\tE2E p99\tout tok/s\tservice\t÷ weight\t÷ fair\tJain\t")
	row := func(policy string, band int, tenant, weight string, requests, completed int, def bool, ttft, e2e Latency, tps float64, service, perWeight, ratio, jain string) {
		cells := []string{policy, strconv.Itoa(band), tenant, weight, strconv.Itoa(requests), strconv.Itoa(completed),
			figure(def, "%.2f s", ttft.P50), figure(def, "%.2f s", ttft.P99), figure(def, "%.1f s", e2e.P99),
			figure(def, "%.0f", tps), service, perWeight, ratio, jain}
		fmt.Fprintln(tw, strings.Join(cells, "\t")+"\t")
	}
	millions := func(tokens float64) string { return fmt.Sprintf("%.2f", tokens/1e6) }
	for i := range rep.Results {
		r := &rep.Results[i]
		t := 0
		for j := range r.Bands {
			b := &r.Bands[j]
			row(r.Policy, b.Priority, "(all)", "", b.Requests, b.Completed, b.Defined(), b.TTFT, b.E2E, b.OutputTokensPerSecond,
				millions(float64(b.Service)), "", "", figure(b.FairnessDefined(), "%.3f", b.Fairness))
			for ; t < len(r.Tenants) && r.Tenants[t].Priority == b.Priority; t++ {
				x := &r.Tenants[t]
				row(r.Policy, x.Priority, x.Tenant, fmt.Sprintf("%g", x.Weight), x.Requests, x.Completed, x.Defined(), x.TTFT, x.E2E,
					x.OutputTokensPerSecond, millions(float64(x.Service)), millions(x.ServicePerWeight),
					figure(x.FairShare > 0, "%.2f", float64(x.Service)/x.FairShare), "")
			}
		}
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	for line := range strings.Lines(table.String()) {
		fmt.Fprintln(w, strings.TrimRight(line, " \n")) // every cell is padded, the last ones too
	}
	return nil
}

// NotApplicable is how WriteTable prints an undefined figure (see PolicyResult).
const NotApplicable = "n/a"

// figure formats v, or returns NotApplicable when it is not defined.
func figure(defined bool, format string, v float64) string {
	if !defined {
		return NotApplicable
	}
	return fmt.Sprintf(format, v)
}

// Warnings returns one line per overloaded policy run (Overload.Overloaded), in Results order,
// each starting "warning: " and without a trailing newline; none when every run kept up.
func (rep *Report) Warnings() []string {
	var out []string
	for _, r := range rep.Results {
		if o := r.Overload; o.Overloaded {
			out = append(out, fmt.Sprintf("warning: %s: overloaded: requests awaiting their first token grew from %.0f on average to %.0f over the last %.0f %% of the arrivals; the latencies measure queueing behind that backlog, not routing (add engines or lower the speed)",
				r.Policy, o.MeanBacklog, o.EndBacklog, 100*OverloadWindow))
		}
	}
	return out
}

// shareDelay returns Report.ShareDelay: the delay in seconds when the replicas share, else 0.
func (rc *resolved) shareDelay() float64 {
	if !rc.ShareRouters || rc.Routers < 2 {
		return 0
	}
	return rc.ShareDelay.Seconds()
}
