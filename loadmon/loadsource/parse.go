package loadsource

import (
	"bytes"
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/enginepick/enginepick/internal/lora"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/state"
)

// Format names an engine load endpoint and its body format.
type Format uint8

// The formats. The zero Format is invalid. Parse ignores every series or field not named here,
// reads a null or absent rank as rank 0, and returns a *PageError (ErrMalformed) for a missing
// required count, a NaN, infinite, negative, fractional or above 2^53 count, a bad or repeated
// rank, or a body that does not parse.
const (
	// FormatVLLMMetrics is vLLM's Prometheus text page, GET /metrics (vllm-project/vllm
	// vllm/v1/metrics/loggers.py). Per DP rank (the "engine" label) Parse reads running and waiting
	// requests (required), the KV usage fraction (vllm:kv_cache_usage_perc, else the deprecated
	// vllm:gpu_cache_usage_perc; optional, in [0, 1]) and, from vllm:cache_config_info's labels,
	// the block size and KV capacity (num_gpu_blocks × block_size tokens; "None" means unknown).
	// Used KV tokens are the fraction × capacity, rounded; without both, used and capacity stay 0
	// (unknown capacity). With LoRA enabled, vllm:lora_requests_info gives the LoRA residency
	// (loadmon.Report.LoRA): vLLM sets one series per distinct label set to the current time at
	// each scheduler step and never removes the old ones, so the series with the newest value is
	// current (newest values tied: their adapters together); its labels running_lora_adapters
	// and waiting_lora_adapters are comma-separated adapter names (spaces trimmed, empty
	// entries dropped) and max_lora the adapter slots. A series without an engine label (vLLM
	// writes none, whatever the DP size) describes every rank. Without the series, LoRA stays nil.
	FormatVLLMMetrics Format = iota + 1
	// FormatSGLangGetLoad is SGLang's GET /get_load (sgl-project/sglang
	// python/sglang/srt/managers/io_struct.py GetLoadReqOutput): a JSON array with one object per
	// DP rank, {dp_rank, num_reqs, num_waiting_reqs, …}. Running requests are num_reqs −
	// num_waiting_reqs (num_reqs counts both: sgl-project/sglang
	// python/sglang/srt/managers/scheduler.py get_load). KV usage and capacity stay unknown.
	FormatSGLangGetLoad
	// FormatSGLangLoads is SGLang's GET /v1/loads (sgl-project/sglang
	// python/sglang/srt/entrypoints/v1_loads.py; the entries are GetLoadsReqOutput in
	// sgl-project/sglang python/sglang/srt/managers/io_struct.py): {"loads": [{dp_rank,
	// num_running_reqs, num_waiting_reqs, num_used_tokens, max_total_num_tokens,
	// num_waiting_uncached_tokens, max_running_requests, …}, …]}. Running and waiting requests are
	// required; used KV tokens and KV capacity are read when both are present (else both stay 0).
	// With waiting uncached tokens, a non-zero running-batch cap and a known capacity, the report
	// carries loadmon.NativeLoad with those figures and zero prefill counters (docs/design.md §6).
	FormatSGLangLoads
)

var formatNames = [...]string{FormatVLLMMetrics: "vllm_metrics", FormatSGLangGetLoad: "sglang_get_load", FormatSGLangLoads: "sglang_loads"}
var formatPaths = [...]string{FormatVLLMMetrics: "/metrics", FormatSGLangGetLoad: "/get_load", FormatSGLangLoads: "/v1/loads"}

// String returns the configuration name: "vllm_metrics", "sglang_get_load" or "sglang_loads", or
// "format(N)" for an invalid value.
func (f Format) String() string {
	if f.Valid() {
		return formatNames[f]
	}
	return fmt.Sprintf("format(%d)", uint8(f))
}

// Valid reports whether f is one of the defined formats.
func (f Format) Valid() bool { return f >= FormatVLLMMetrics && int(f) < len(formatNames) }

// Path returns the endpoint's path on the engine ("/metrics", "/get_load", "/v1/loads"), or "" for
// an invalid format.
func (f Format) Path() string {
	if f.Valid() {
		return formatPaths[f]
	}
	return ""
}

// ParseFormat parses a configuration name (see Format.String). Anything else is an error wrapping
// state.ErrInvalidConfiguration.
func ParseFormat(name string) (Format, error) {
	for f := FormatVLLMMetrics; int(f) < len(formatNames); f++ {
		if formatNames[f] == name {
			return f, nil
		}
	}
	return 0, fmt.Errorf("loadsource: format %q: want vllm_metrics, sglang_get_load or sglang_loads: %w",
		name, state.ErrInvalidConfiguration)
}

// ErrMalformed is matched (errors.Is) by every *PageError: the body could not be read as the
// format's load page. The poll records nothing; the engine's load goes stale.
var ErrMalformed = errors.New("loadsource: malformed load page")

// PageError describes why a page was rejected. Unwrap returns ErrMalformed and, when a decoder
// failed, its error too.
type PageError struct {
	// Engine is the engine whose page was parsed.
	Engine state.EngineID
	// Format is the page's format.
	Format Format
	// Field names the metric or JSON field at fault; empty for a page that did not decode.
	Field string
	// Rank is the DP rank at fault, or -1 when the fault is not a rank's.
	Rank int
	// Reason says what is wrong, in words.
	Reason string
	// Err is the decoder's error, if any.
	Err error
}

// Error implements error.
func (e *PageError) Error() string {
	var b bytes.Buffer
	fmt.Fprintf(&b, "loadsource: engine %q %s page", e.Engine, e.Format)
	if e.Field != "" {
		fmt.Fprintf(&b, ": %s", e.Field)
	}
	if e.Rank >= 0 {
		fmt.Fprintf(&b, " rank %d", e.Rank)
	}
	fmt.Fprintf(&b, ": %s", e.Reason)
	if e.Err != nil {
		fmt.Fprintf(&b, ": %v", e.Err)
	}
	return b.String()
}

// Unwrap returns ErrMalformed and the decoder's error, if any.
func (e *PageError) Unwrap() []error {
	if e.Err != nil {
		return []error{ErrMalformed, e.Err}
	}
	return []error{ErrMalformed}
}

// Page is what one load page says about an engine.
type Page struct {
	// Reports holds one report per DP rank the page names, sorted by rank, each with Engine set.
	Reports []loadmon.Report
	// BlockTokens is the engine's KV block size in tokens when the page states it (vLLM
	// cache_config_info block_size); 0 means the page does not say.
	BlockTokens uint64
}

// Parse parses body as format f for engine (each Format says what it reads). Errors: a *PageError (ErrMalformed) for a body that
// is not a valid page; an error wrapping state.ErrInvalidConfiguration for an invalid format or
// an empty engine ID.
func Parse(f Format, engine state.EngineID, body []byte) (Page, error) {
	if engine == "" {
		return Page{}, fmt.Errorf("loadsource: parse: empty engine ID: %w", state.ErrInvalidConfiguration)
	}
	switch f {
	case FormatVLLMMetrics:
		return parseVLLMMetrics(engine, body)
	case FormatSGLangGetLoad:
		return parseSGLangGetLoad(engine, body)
	case FormatSGLangLoads:
		return parseSGLangLoads(engine, body)
	}
	return Page{}, fmt.Errorf("loadsource: parse: %v: %w", f, state.ErrInvalidConfiguration)
}

// The vLLM series read (vllm-project/vllm vllm/v1/metrics/loggers.py). kv_cache_usage_perc is a
// fraction in [0, 1] despite its name; gpu_cache_usage_perc is its deprecated predecessor, read
// only when the new name is absent.
const (
	vllmRunning     = "vllm:num_requests_running"
	vllmWaiting     = "vllm:num_requests_waiting"
	vllmKVUsage     = "vllm:kv_cache_usage_perc"
	vllmKVUsageOld  = "vllm:gpu_cache_usage_perc"
	vllmCacheConfig = "vllm:cache_config_info"
	vllmLoRA        = "vllm:lora_requests_info"
	// vllmRankLabel is the label vLLM V1 puts on every per-engine-core series: the engine core's
	// index, which is its data-parallel rank behind one API server. A series without it is rank 0.
	vllmRankLabel = "engine"
)

// maxExactCount is the largest count a float64 gauge carries exactly (2^53).
const maxExactCount = 1 << 53

// parseVLLMMetrics parses a FormatVLLMMetrics page (the constant says what it reads).
//
// A page that does not parse, lacks vllm:num_requests_running, names a rank without both counts,
// holds a NaN, infinite, negative or non-integral count, a usage fraction outside [0, 1], a rank
// label that is not a number below loadmon.MaxRanks, or the same rank twice in one series returns a
// *PageError.
func parseVLLMMetrics(engine state.EngineID, body []byte) (Page, error) {
	bad := func(field string, rank int, reason string, err error) (Page, error) {
		return Page{}, &PageError{Engine: engine, Format: FormatVLLMMetrics, Field: field, Rank: rank, Reason: reason, Err: err}
	}
	parser := expfmt.NewTextParser(model.UTF8Validation)
	families, err := parser.TextToMetricFamilies(bytes.NewReader(body))
	if err != nil {
		return bad("", -1, "not a Prometheus text page", err)
	}
	running, ok := families[vllmRunning]
	if !ok {
		return bad(vllmRunning, -1, "series missing", nil)
	}
	type rankLoad struct {
		running, waiting, usage          float64
		hasRunning, hasWaiting, hasUsage bool
	}
	ranks := map[int]*rankLoad{}
	at := func(r int) *rankLoad {
		l := ranks[r]
		if l == nil {
			l = &rankLoad{}
			ranks[r] = l
		}
		return l
	}
	// read visits every sample of a simple-valued series with its rank.
	read := func(mf *dto.MetricFamily, visit func(rank int, v float64, m *dto.Metric) error) error {
		for _, m := range mf.GetMetric() {
			rank, err := vllmRank(m)
			if err != nil {
				return &PageError{Engine: engine, Format: FormatVLLMMetrics, Field: mf.GetName(), Rank: -1, Reason: err.Error()}
			}
			v, ok := simpleValue(m)
			if !ok {
				return &PageError{Engine: engine, Format: FormatVLLMMetrics, Field: mf.GetName(), Rank: rank, Reason: "not a gauge, counter or untyped sample"}
			}
			if err := visit(rank, v, m); err != nil {
				return err
			}
		}
		return nil
	}
	countInto := func(name string, dst func(*rankLoad) (*float64, *bool)) func(int, float64, *dto.Metric) error {
		return func(rank int, v float64, _ *dto.Metric) error {
			if reason := countProblem(v); reason != "" {
				return &PageError{Engine: engine, Format: FormatVLLMMetrics, Field: name, Rank: rank, Reason: reason}
			}
			p, seen := dst(at(rank))
			if *seen {
				return &PageError{Engine: engine, Format: FormatVLLMMetrics, Field: name, Rank: rank, Reason: "rank appears twice"}
			}
			*p, *seen = v, true
			return nil
		}
	}
	if err := read(running, countInto(vllmRunning, func(l *rankLoad) (*float64, *bool) { return &l.running, &l.hasRunning })); err != nil {
		return Page{}, err
	}
	if mf, ok := families[vllmWaiting]; ok {
		if err := read(mf, countInto(vllmWaiting, func(l *rankLoad) (*float64, *bool) { return &l.waiting, &l.hasWaiting })); err != nil {
			return Page{}, err
		}
	}
	usageName := vllmKVUsage
	usage, ok := families[vllmKVUsage]
	if !ok {
		usageName = vllmKVUsageOld
		usage, ok = families[vllmKVUsageOld]
	}
	if ok {
		err := read(usage, func(rank int, v float64, _ *dto.Metric) error {
			if math.IsNaN(v) || v < 0 || v > 1 {
				return &PageError{Engine: engine, Format: FormatVLLMMetrics, Field: usageName, Rank: rank,
					Reason: fmt.Sprintf("usage fraction %v outside [0, 1]", v)}
			}
			l := at(rank)
			if l.hasUsage {
				return &PageError{Engine: engine, Format: FormatVLLMMetrics, Field: usageName, Rank: rank, Reason: "rank appears twice"}
			}
			l.usage, l.hasUsage = v, true
			return nil
		})
		if err != nil {
			return Page{}, err
		}
	}
	// cache_config_info: an info series (value 1) whose labels carry the cache geometry. Without an
	// engine label it describes every rank.
	type geometry struct{ block, capacity uint64 }
	var allRanks *geometry
	perRank := map[int]geometry{}
	if mf, ok := families[vllmCacheConfig]; ok {
		for _, m := range mf.GetMetric() {
			g, err := cacheGeometry(m)
			if err != nil {
				return bad(vllmCacheConfig, -1, err.Error(), nil)
			}
			if !hasLabel(m, vllmRankLabel) {
				if allRanks != nil {
					return bad(vllmCacheConfig, -1, "two series without an engine label", nil)
				}
				allRanks = &geometry{g.block, g.capacity}
				continue
			}
			rank, err := vllmRank(m)
			if err != nil {
				return bad(vllmCacheConfig, -1, err.Error(), nil)
			}
			if _, dup := perRank[rank]; dup {
				return bad(vllmCacheConfig, rank, "rank appears twice", nil)
			}
			perRank[rank] = geometry{g.block, g.capacity}
		}
	}
	var loraAll *newestLoRA
	loraRanks := map[int]*newestLoRA{}
	if mf, ok := families[vllmLoRA]; ok {
		for _, m := range mf.GetMetric() {
			v, ok := simpleValue(m)
			if !ok || math.IsNaN(v) || math.IsInf(v, 0) {
				return bad(vllmLoRA, -1, "not a finite gauge sample", nil)
			}
			l, err := loraLabels(m)
			if err != nil {
				return bad(vllmLoRA, -1, err.Error(), nil)
			}
			if !hasLabel(m, vllmRankLabel) {
				loraAll = loraAll.offer(v, l)
				continue
			}
			rank, err := vllmRank(m)
			if err != nil {
				return bad(vllmLoRA, -1, err.Error(), nil)
			}
			loraRanks[rank] = loraRanks[rank].offer(v, l)
		}
	}
	page := Page{Reports: make([]loadmon.Report, 0, len(ranks))}
	blockSet := false
	for rank, l := range ranks {
		if !l.hasRunning {
			return bad(vllmRunning, rank, "value missing", nil)
		}
		if !l.hasWaiting {
			return bad(vllmWaiting, rank, "value missing", nil)
		}
		r := loadmon.Report{Engine: engine, DPRank: rank, RunningRequests: uint64(l.running), WaitingRequests: uint64(l.waiting)}
		g, ok := perRank[rank]
		if !ok && allRanks != nil {
			g, ok = *allRanks, true
		}
		if ok && g.block > 0 {
			if blockSet && page.BlockTokens != g.block {
				return bad(vllmCacheConfig, rank, fmt.Sprintf("block size %d differs from another rank's %d", g.block, page.BlockTokens), nil)
			}
			page.BlockTokens, blockSet = g.block, true
		}
		if ok && g.capacity > 0 && l.hasUsage {
			r.KVCapacityTokens = g.capacity
			r.UsedKVTokens = min(uint64(math.Round(l.usage*float64(g.capacity))), g.capacity)
		}
		if n := cmp.Or(loraRanks[rank], loraAll); n != nil {
			r.LoRA = &n.load
		}
		page.Reports = append(page.Reports, r)
	}
	slices.SortFunc(page.Reports, func(a, b loadmon.Report) int { return a.DPRank - b.DPRank })
	return page, nil
}

// newestLoRA is the newest vllm:lora_requests_info series seen so far (of one rank, or of every
// rank): its value (the time vLLM set it) and its residency, the union of every series tied at
// that value.
type newestLoRA struct {
	at   float64
	load loadmon.LoRALoad
}

// offer returns n updated with a series of value at and residency l: l when newer (or n is nil),
// both together when tied, else n.
func (n *newestLoRA) offer(at float64, l loadmon.LoRALoad) *newestLoRA {
	switch {
	case n == nil || at > n.at:
		return &newestLoRA{at: at, load: l}
	case at == n.at:
		n.load.Running = lora.Union(n.load.Running, l.Running)
		n.load.Waiting = lora.Union(n.load.Waiting, l.Waiting)
		n.load.MaxAdapters = min(n.load.MaxAdapters, l.MaxAdapters)
	}
	return n
}

// loraLabels reads the residency of a vllm:lora_requests_info series: max_lora (absent or empty:
// 0, unknown; else a count) and the comma-separated adapter names of running_lora_adapters and
// waiting_lora_adapters.
func loraLabels(m *dto.Metric) (loadmon.LoRALoad, error) {
	var l loadmon.LoRALoad
	for _, lp := range m.GetLabel() {
		switch v := lp.GetValue(); lp.GetName() {
		case "max_lora":
			if v == "" {
				continue
			}
			n, err := strconv.ParseUint(v, 10, 31)
			if err != nil {
				return l, fmt.Errorf("label max_lora=%q is not a count", v)
			}
			l.MaxAdapters = int(n)
		case "running_lora_adapters":
			l.Running = adapterNames(v)
		case "waiting_lora_adapters":
			l.Waiting = adapterNames(v)
		}
	}
	return l, nil
}

// adapterNames splits a comma-separated label value into adapter names, trimming spaces and
// dropping empty entries; nil when none.
func adapterNames(v string) []string {
	var out []string
	for name := range strings.SplitSeq(v, ",") {
		if name = strings.TrimSpace(name); name != "" {
			out = append(out, name)
		}
	}
	return out
}

// vllmRank reads the engine label of a vLLM series: absent is rank 0.
func vllmRank(m *dto.Metric) (int, error) {
	for _, lp := range m.GetLabel() {
		if lp.GetName() == vllmRankLabel {
			return parseRank(lp.GetValue())
		}
	}
	return 0, nil
}

func hasLabel(m *dto.Metric, name string) bool {
	for _, lp := range m.GetLabel() {
		if lp.GetName() == name {
			return true
		}
	}
	return false
}

func parseRank(text string) (int, error) {
	n, err := strconv.ParseUint(text, 10, 32)
	if err != nil || n >= loadmon.MaxRanks {
		return 0, fmt.Errorf("rank %q is not a number in [0, %d)", text, loadmon.MaxRanks)
	}
	return int(n), nil
}

// cacheGeometry reads block_size and num_gpu_blocks from a cache_config_info series. A label that
// is absent, empty or "None" is unknown (0); any other non-number is an error.
func cacheGeometry(m *dto.Metric) (struct{ block, capacity uint64 }, error) {
	var g struct{ block, capacity uint64 }
	var blocks uint64
	for _, lp := range m.GetLabel() {
		var dst *uint64
		switch lp.GetName() {
		case "block_size":
			dst = &g.block
		case "num_gpu_blocks":
			dst = &blocks
		default:
			continue
		}
		v := lp.GetValue()
		if v == "" || v == "None" {
			continue
		}
		n, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			return g, fmt.Errorf("label %s=%q is not a count", lp.GetName(), v)
		}
		*dst = n
	}
	if g.block > 0 && blocks > 0 {
		if blocks > math.MaxUint64/g.block {
			return g, fmt.Errorf("capacity %d blocks × %d tokens overflows", blocks, g.block)
		}
		g.capacity = blocks * g.block
	}
	return g, nil
}

// simpleValue returns the value of a gauge, counter or untyped sample.
func simpleValue(m *dto.Metric) (float64, bool) {
	switch {
	case m.Gauge != nil:
		return m.GetGauge().GetValue(), true
	case m.Untyped != nil:
		return m.GetUntyped().GetValue(), true
	case m.Counter != nil:
		return m.GetCounter().GetValue(), true
	}
	return 0, false
}

// countProblem says what is wrong with a count, or "" when v is a whole number in [0, 2^53].
func countProblem(v float64) string {
	switch {
	case math.IsNaN(v):
		return "NaN count"
	case math.IsInf(v, 0):
		return "infinite count"
	case v < 0:
		return fmt.Sprintf("negative count %v", v)
	case v != math.Trunc(v):
		return fmt.Sprintf("count %v is not a whole number", v)
	case v > maxExactCount:
		return fmt.Sprintf("count %v above 2^53", v)
	}
	return ""
}

// getLoadEntry is one element of SGLang's /get_load array. num_reqs counts running and waiting
// requests together; num_tokens (or num_pages in some releases) adds waiting prompts to the KV in
// use, so it is not KV usage and is not read.
type getLoadEntry struct {
	DPRank         *json.RawMessage `json:"dp_rank"`
	NumReqs        *json.RawMessage `json:"num_reqs"`
	NumWaitingReqs *json.RawMessage `json:"num_waiting_reqs"`
}

// parseSGLangGetLoad parses a FormatSGLangGetLoad page (the constant says what it reads).
//
// A body that is not a JSON array of objects, an empty array, a missing or null count, a count that
// is negative, fractional or above 2^53, num_waiting_reqs above num_reqs, a rank that is not a
// number below loadmon.MaxRanks, or the same rank twice returns a *PageError.
func parseSGLangGetLoad(engine state.EngineID, body []byte) (Page, error) {
	bad := func(field string, rank int, reason string, err error) (Page, error) {
		return Page{}, &PageError{Engine: engine, Format: FormatSGLangGetLoad, Field: field, Rank: rank, Reason: reason, Err: err}
	}
	var entries []getLoadEntry
	if err := json.Unmarshal(body, &entries); err != nil {
		return bad("", -1, "not a JSON array of objects", err)
	}
	if len(entries) == 0 {
		return bad("", -1, "no ranks", nil)
	}
	page := Page{Reports: make([]loadmon.Report, 0, len(entries))}
	for _, e := range entries {
		rank, err := jsonRank(e.DPRank)
		if err != nil {
			return bad("dp_rank", -1, err.Error(), nil)
		}
		total, err := jsonCount(e.NumReqs)
		if err != nil {
			return bad("num_reqs", rank, err.Error(), nil)
		}
		waiting, err := jsonCount(e.NumWaitingReqs)
		if err != nil {
			return bad("num_waiting_reqs", rank, err.Error(), nil)
		}
		if waiting > total {
			return bad("num_waiting_reqs", rank, fmt.Sprintf("%d waiting above %d requests in all", waiting, total), nil)
		}
		page.Reports = append(page.Reports, loadmon.Report{Engine: engine, DPRank: rank, RunningRequests: total - waiting, WaitingRequests: waiting})
	}
	if rank, dup := sortRanks(page.Reports); dup {
		return bad("dp_rank", rank, "rank appears twice", nil)
	}
	return page, nil
}

// loadsBody is SGLang's GET /v1/loads body; only "loads" is read.
type loadsBody struct {
	Loads *[]loadsEntry `json:"loads"`
}

// loadsEntry is one rank of /v1/loads (GetLoadsReqOutput).
type loadsEntry struct {
	DPRank                   *json.RawMessage `json:"dp_rank"`
	NumRunningReqs           *json.RawMessage `json:"num_running_reqs"`
	NumWaitingReqs           *json.RawMessage `json:"num_waiting_reqs"`
	NumUsedTokens            *json.RawMessage `json:"num_used_tokens"`
	MaxTotalNumTokens        *json.RawMessage `json:"max_total_num_tokens"`
	NumWaitingUncachedTokens *json.RawMessage `json:"num_waiting_uncached_tokens"`
	MaxRunningRequests       *json.RawMessage `json:"max_running_requests"`
}

// parseSGLangLoads parses a FormatSGLangLoads page (the constant says what it reads).
//
// Errors (*PageError): a body that is not a JSON object with a "loads" array of objects, an empty
// array, a missing or null required count, a count that is negative, fractional or above 2^53,
// used KV tokens above capacity, a bad or repeated rank.
func parseSGLangLoads(engine state.EngineID, body []byte) (Page, error) {
	bad := func(field string, rank int, reason string, err error) (Page, error) {
		return Page{}, &PageError{Engine: engine, Format: FormatSGLangLoads, Field: field, Rank: rank, Reason: reason, Err: err}
	}
	var doc loadsBody
	if err := json.Unmarshal(body, &doc); err != nil {
		return bad("", -1, "not a JSON object with a loads array", err)
	}
	if doc.Loads == nil {
		return bad("loads", -1, "field missing", nil)
	}
	if len(*doc.Loads) == 0 {
		return bad("loads", -1, "no ranks", nil)
	}
	page := Page{Reports: make([]loadmon.Report, 0, len(*doc.Loads))}
	for _, e := range *doc.Loads {
		rank, err := jsonRank(e.DPRank)
		if err != nil {
			return bad("dp_rank", -1, err.Error(), nil)
		}
		r := loadmon.Report{Engine: engine, DPRank: rank}
		if r.RunningRequests, err = jsonCount(e.NumRunningReqs); err != nil {
			return bad("num_running_reqs", rank, err.Error(), nil)
		}
		if r.WaitingRequests, err = jsonCount(e.NumWaitingReqs); err != nil {
			return bad("num_waiting_reqs", rank, err.Error(), nil)
		}
		used, usedOK, err := jsonOptionalCount(e.NumUsedTokens)
		if err != nil {
			return bad("num_used_tokens", rank, err.Error(), nil)
		}
		capacity, capOK, err := jsonOptionalCount(e.MaxTotalNumTokens)
		if err != nil {
			return bad("max_total_num_tokens", rank, err.Error(), nil)
		}
		uncached, uncachedOK, err := jsonOptionalCount(e.NumWaitingUncachedTokens)
		if err != nil {
			return bad("num_waiting_uncached_tokens", rank, err.Error(), nil)
		}
		maxRunning, maxRunningOK, err := jsonOptionalCount(e.MaxRunningRequests)
		if err != nil {
			return bad("max_running_requests", rank, err.Error(), nil)
		}
		if usedOK && capOK && capacity > 0 {
			if used > capacity {
				return bad("num_used_tokens", rank, fmt.Sprintf("%d used above capacity %d", used, capacity), nil)
			}
			r.UsedKVTokens, r.KVCapacityTokens = used, capacity
			if uncachedOK && maxRunningOK && maxRunning > 0 {
				r.Native = &loadmon.NativeLoad{WaitingUncachedTokens: uncached, MaxRunningRequests: maxRunning}
			}
		}
		page.Reports = append(page.Reports, r)
	}
	if rank, dup := sortRanks(page.Reports); dup {
		return bad("dp_rank", rank, "rank appears twice", nil)
	}
	return page, nil
}

// sortRanks sorts reports by rank and reports the first repeated rank.
func sortRanks(reports []loadmon.Report) (int, bool) {
	slices.SortFunc(reports, func(a, b loadmon.Report) int { return a.DPRank - b.DPRank })
	for i := 1; i < len(reports); i++ {
		if reports[i].DPRank == reports[i-1].DPRank {
			return reports[i].DPRank, true
		}
	}
	return 0, false
}

func jsonRank(n *json.RawMessage) (int, error) {
	if n == nil {
		return 0, nil
	}
	return parseRank(string(*n))
}

func jsonCount(n *json.RawMessage) (uint64, error) {
	v, ok, err := jsonOptionalCount(n)
	if err == nil && !ok {
		err = errors.New("value missing")
	}
	return v, err
}

// jsonOptionalCount reads a count that may be absent or null (false). JSON integers are read
// exactly; a number written with a fraction or exponent must be a whole number up to 2^53.
func jsonOptionalCount(n *json.RawMessage) (uint64, bool, error) {
	if n == nil {
		return 0, false, nil
	}
	text := string(*n)
	if v, err := strconv.ParseUint(text, 10, 64); err == nil {
		return v, true, nil
	}
	// Only a JSON number may follow: strings, booleans, arrays and objects are not counts.
	if text == "" || !(text[0] == '-' || (text[0] >= '0' && text[0] <= '9')) {
		return 0, false, fmt.Errorf("%.40s is not a number", text)
	}
	f, err := strconv.ParseFloat(text, 64)
	if err != nil && !errors.Is(err, strconv.ErrRange) {
		return 0, false, fmt.Errorf("%.40s is not a count", text)
	}
	if reason := countProblem(f); reason != "" {
		return 0, false, errors.New(reason)
	}
	return uint64(f), true, nil
}
