package sim

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/enginepick/enginepick/admission"
	"github.com/enginepick/enginepick/flowcontrol"
	"github.com/enginepick/enginepick/state"
)

// DefaultReportInterval is how often, in virtual time, every simulated engine reports its load:
// 100 ms, well inside loadmon.DefaultFreshness (5 s), so the router always has a fresh report that
// is up to one interval old.
const DefaultReportInterval = 100 * time.Millisecond

// Errors of Replay and ParsePD for configuration that cannot be replayed. Each wraps
// state.ErrInvalidConfiguration, so errors.Is matches either the specific sentinel or the general
// one. Replay returns them before simulating anything: there is no partial report.
var (
	// ErrEmptyFleet: the fleet has no engine (Fleet{}), or a count is negative.
	ErrEmptyFleet = fmt.Errorf("sim: fleet has no engines: %w", state.ErrInvalidConfiguration)
	// ErrIncompletePD: a PD fleet without prefill engines or without decode engines, or a fleet
	// that mixes plain and PD engines.
	ErrIncompletePD = fmt.Errorf("sim: PD fleet needs both prefill and decode engines, and no plain engines: %w", state.ErrInvalidConfiguration)
	// ErrUnknownPolicy: Config.Policies cannot be replayed. Alone, it means a name has no factory
	// in the table; the errors for a name listed twice (ErrDuplicatePolicy) and for an empty list
	// (ErrNoPolicy) match it too, so testing ErrUnknownPolicy catches every bad policy list.
	ErrUnknownPolicy = fmt.Errorf("sim: unknown policy: %w", state.ErrInvalidConfiguration)
	// ErrDuplicatePolicy: Config.Policies names one policy twice. Drop the repeat.
	ErrDuplicatePolicy = fmt.Errorf("sim: policy listed twice: %w", state.ErrInvalidConfiguration)
	// ErrNoPolicy: Config.Policies is empty but not nil (nil means DefaultPolicyNames()).
	ErrNoPolicy = fmt.Errorf("sim: no policy given: %w", state.ErrInvalidConfiguration)
	// ErrBadPDSpec: ParsePD text is not "P:D" with two positive decimal integers.
	ErrBadPDSpec = fmt.Errorf("sim: PD spec must be P:D with positive engine counts: %w", state.ErrInvalidConfiguration)
	// ErrNoTrace: Config.Trace is nil.
	ErrNoTrace = fmt.Errorf("sim: no trace: %w", state.ErrInvalidConfiguration)
)

// configError is an invalid configuration value, worded once for the user: Error returns msg
// (which names the field or input, the value and the rule) followed by
// state.ErrInvalidConfiguration's text, and errors.Is matches each error in errs: the specific
// sentinels above, each of which wraps state.ErrInvalidConfiguration, and any underlying cause.
type configError struct {
	msg  string
	errs []error
}

func (e *configError) Error() string { return e.msg + ": " + state.ErrInvalidConfiguration.Error() }

// Unwrap returns errs.
func (e *configError) Unwrap() []error { return e.errs }

// prefixedError words a wrapped error with the package prefix once: Error returns msg, and
// Unwrap returns err, so errors.Is and errors.As see through it.
type prefixedError struct {
	msg string
	err error
}

func (e *prefixedError) Error() string { return e.msg }

// Unwrap returns the wrapped error.
func (e *prefixedError) Unwrap() error { return e.err }

// wrapf wraps err with the context format describes, for example wrapf(err, "policy %s", name),
// and words the result "sim: <context>: <err>" with err's own leading "sim: " removed, so the
// package prefix appears once however deeply sim wraps its own errors.
func wrapf(err error, format string, args ...any) error {
	return &prefixedError{
		msg: "sim: " + fmt.Sprintf(format, args...) + ": " + strings.TrimPrefix(err.Error(), "sim: "),
		err: err,
	}
}

// RequestError reports a request of a hand-built Trace that the readers would have rejected. It
// wraps ErrEmptyTrace, ErrNegative, ErrOutOfRange, ErrUnsorted, ErrHashIDMismatch or
// ErrSegmentMismatch.
type RequestError struct {
	// Position is the request's 0-based position in Trace.Requests.
	Position int
	// Err is the trace sentinel.
	Err error
}

func (e *RequestError) Error() string {
	return fmt.Sprintf("sim: trace request %d: %v", e.Position, e.Err)
}

// Unwrap returns Err.
func (e *RequestError) Unwrap() error { return e.Err }

// Fleet is the simulated deployment: Plain engines, or Prefill and Decode engines of one PD
// bucket. Exactly one of the two shapes must be non-empty; the zero Fleet is an error, not a
// default, so that a forgotten field cannot pick a fleet silently.
type Fleet struct {
	// Plain is the number of plain engines (prefill and decode on one engine).
	Plain int `json:"plain,omitempty"`
	// Prefill and Decode are the engine counts of a PD fleet.
	Prefill int `json:"prefill,omitempty"`
	Decode  int `json:"decode,omitempty"`
}

// IsPD reports whether the fleet is prefill/decode disaggregated.
func (f Fleet) IsPD() bool { return f.Prefill > 0 || f.Decode > 0 }

// String returns "16 plain" or "4P:4D".
func (f Fleet) String() string {
	if f.IsPD() {
		return fmt.Sprintf("%dP:%dD", f.Prefill, f.Decode)
	}
	return fmt.Sprintf("%d plain", f.Plain)
}

func (f Fleet) validate() error {
	switch {
	case f.Plain < 0 || f.Prefill < 0 || f.Decode < 0:
		return fmt.Errorf("%w: %+v has a negative count", ErrEmptyFleet, f)
	case f.Plain == 0 && f.Prefill == 0 && f.Decode == 0:
		return ErrEmptyFleet
	case f.IsPD() && (f.Plain > 0 || f.Prefill == 0 || f.Decode == 0):
		return fmt.Errorf("%w: got %d plain, %d prefill, %d decode", ErrIncompletePD, f.Plain, f.Prefill, f.Decode)
	}
	return nil
}

// ParsePD parses the "-pd P:D" syntax: two positive decimal integers separated by one colon, for
// example "4:4". Anything else — a missing part, zero, a sign, spaces — is an error wrapping
// ErrBadPDSpec (and state.ErrInvalidConfiguration); zero prefill or decode engines also wraps
// ErrIncompletePD. The message names the spec and the rule once, for example
// `sim: PD spec "2:0": decode engines must be >= 1: invalid configuration`.
func ParsePD(text string) (Fleet, error) {
	fail := func(rule string, errs ...error) error {
		return &configError{msg: fmt.Sprintf("sim: PD spec %q: %s", text, rule), errs: append([]error{ErrBadPDSpec}, errs...)}
	}
	ps, ds, ok := strings.Cut(text, ":")
	if !ok {
		return Fleet{}, fail("must be P:D, prefill and decode engine counts separated by a colon")
	}
	parse := func(role, s string) (int, error) {
		if s == "" || strings.TrimLeft(s, "0123456789") != "" {
			return 0, fail(fmt.Sprintf("%s count %q is not a decimal number", role, s))
		}
		n, err := strconv.Atoi(s)
		if err != nil {
			return 0, fail(fmt.Sprintf("%s count %s is out of range", role, s), err)
		}
		return n, nil
	}
	p, err := parse("prefill", ps)
	if err != nil {
		return Fleet{}, err
	}
	d, err := parse("decode", ds)
	if err != nil {
		return Fleet{}, err
	}
	switch {
	case p == 0 && d == 0:
		return Fleet{}, fail("prefill and decode engines must be >= 1", ErrIncompletePD)
	case p == 0:
		return Fleet{}, fail("prefill engines must be >= 1", ErrIncompletePD)
	case d == 0:
		return Fleet{}, fail("decode engines must be >= 1", ErrIncompletePD)
	}
	return Fleet{Prefill: p, Decode: d}, nil
}

// Config is one replay: a trace, a fleet, the engine model and the policies to compare. The zero
// value of each optional field is its documented default; Trace and Fleet are required.
type Config struct {
	// Trace is the request trace to replay. Required; it is only read. Hand-built traces are
	// validated as the readers validate files (*RequestError).
	Trace *Trace
	// Fleet is the simulated deployment. Required (ErrEmptyFleet, ErrIncompletePD).
	Fleet Fleet
	// Model is the engines' performance model; zero fields take their defaults (EngineModel).
	Model EngineModel
	// Policies names the policies to compare, in report order. Nil means DefaultPolicyNames();
	// empty but not nil is an error (ErrNoPolicy). Each name must be a key of Factories
	// (ErrUnknownPolicy) and may appear once (ErrDuplicatePolicy).
	Policies []string
	// Factories maps policy names to factories. Nil means DefaultPolicies().
	Factories map[string]PolicyFactory
	// Speed compresses time: every arrival offset is divided by it. 0 means 1; it must be finite
	// and > 0.
	Speed float64
	// Limit replays only the first Limit requests. 0 means all; negative is invalid.
	Limit int
	// SystemPromptTokens prepends one shared prompt of this many tokens to every request: the same
	// synthetic token IDs (a fixed stream that no trace block produces) come before each
	// request's own, so every prompt grows by SystemPromptTokens and all of them share that
	// prefix, as behind a long system prompt. 0 means none; negative or above MaxTraceTokens is
	// invalid. A request whose prompt plus output then exceeds EngineModel.MaxContextTokens is
	// refused as too long (PolicyResult.Unroutable).
	SystemPromptTokens int
	// Routers is the number of independent router replicas in front of the fleet (MaxRouters at
	// most): each has its own Router, load table, in-flight counters, prefix index (so its own
	// approximate entries) and policy instances with their own bookkeeping; request k goes to
	// replica k mod Routers (round-robin); every engine reports its load to every replica and
	// publishes its KV events to every replica's index. Replica j's policies draw from
	// PCG(Seed, Seed+j), so Routers 1 replays exactly as 0. 0 means 1; negative is invalid.
	Routers int
	// ShareRouters makes the router replicas share their decisions as replicas over a broker do
	// (docs/design.md §6, "Router replicas"): each replica's dispatch starts and ends and
	// route-time placements reach every other replica ShareDelay later, and count there in
	// pressure comparisons and prefix matches. Without it (and with one replica) nothing is
	// shared.
	ShareRouters bool
	// ShareDelay is the virtual time a shared decision takes to reach the other replicas. 0
	// means DefaultShareDelay; negative is invalid.
	ShareDelay time.Duration
	// SpreadArrivals redraws the arrivals of each whole second of trace time (before Speed)
	// uniformly over that second, in their order, from a PCG random source seeded with Seed: for
	// a trace whose timestamps were truncated to the second (the Mooncake conversation trace),
	// whose requests would otherwise arrive in same-instant bursts that no load report or shared
	// decision can come between. False replays the arrivals as given.
	SpreadArrivals bool
	// Seed seeds each policy run's PCG random source (math/rand/v2 PCG(Seed, Seed)). The same
	// Config gives a byte-identical Report.
	Seed uint64
	// ReportInterval is the virtual time between two load reports of every engine. 0 means
	// DefaultReportInterval; negative is invalid.
	ReportInterval time.Duration
	// Reports is what the engines' load reports carry: ReportsNative or ReportsBasic. "" means
	// ReportsNative; any other value is invalid.
	Reports LoadReports
	// Admission checks every engine a policy returns. Nil means admission.Limits{} (admit all).
	// A request no bucket admits is dropped and counted in PolicyResult.Rejected, or waits under
	// FlowControl.
	Admission admission.Checker
	// FlowControl, when set, gives every router replica its own flow-control Controller
	// (enginepick.Options.FlowControl, docs/design.md §17) built from it, on the virtual clock: a
	// request the fleet cannot serve waits in the router, Request.Priority choosing its band and
	// Request.Tenant its flow, until an engine's load report or a request's end frees capacity.
	// Nil Bands means one band per priority the requests name, with Band's defaults; nil Weight
	// means the weights of Trace.Tenants. TTFT counts the wait; a wait that times out counts in
	// PolicyResult.Rejected, a request refused by flow control (queue full, displaced, sheddable)
	// in PolicyResult.Shed. A band's TTL ends a wait at the first event at or after it (a load
	// report comes every ReportInterval). Nil means no flow control. An invalid Config is an error
	// wrapping state.ErrInvalidConfiguration. With Routing, the file's flow_control block
	// configures flow control instead (FlowControl set too: ErrRoutingConflict).
	FlowControl *flowcontrol.Config
	// Warmup leaves the requests arriving before it (on the replay's clock, after Speed) out of
	// the latency figures (TTFT and E2E, of the run, its bands and its tenants), so that they
	// describe the fleet once it has filled, not its start from idle engines with empty caches.
	// They are replayed and counted like the others: throughput, hit rate, service and the
	// request counts cover the whole run; a tenant or band with no completed request after it has
	// zero latencies. 0 means none; negative, or at or past the last arrival, is invalid.
	Warmup time.Duration
	// Parallelism bounds how many policy runs simulate at once; each run is single-threaded and
	// independent, so the report does not depend on it. 0 means runtime.GOMAXPROCS(0).
	Parallelism int
	// Routing, when set, replays a routing configuration file instead of Policies: one run,
	// over exactly the engines the file lists for Routing.Model, routed by config.New from the
	// file (see Routing). Fleet, Policies, Factories and Admission must then be zero
	// (ErrRoutingConflict); the file's kv.block_tokens (16 when unset, as config.New) sets
	// Model.BlockTokens.
	Routing *Routing
	// Progress, when set, is called with the number of requests finished or dropped so far, over
	// every policy run, and the total (requests × policies). Runs call it from their own
	// goroutines, so it must be safe for concurrent use; it is called at most every 256 requests
	// of a run, and once more when a run ends.
	Progress func(done, total int)

	// inspect, when set (tests), receives each finished run before its resources are dropped,
	// and runs keep each cached block's kvindex key for the index check.
	inspect func(*run) error
}

// LoadReports names what the simulated engines' load reports carry (Config.Reports).
type LoadReports string

const (
	// ReportsNative: running and waiting requests, KV use and capacity, and the native extension
	// (waiting uncached tokens, running-batch cap, prefill counters), as SGLang's load report
	// (loadmon.NativeLoad).
	ReportsNative LoadReports = "native"
	// ReportsBasic: running and waiting requests, KV use and capacity only, as vLLM's /metrics
	// page gives them (loadsource.Parse): no native extension.
	ReportsBasic LoadReports = "basic"
)

// DefaultShareDelay is Config.ShareDelay's default: a broker's publish-to-delivery time on one
// network.
const DefaultShareDelay = 5 * time.Millisecond

// MaxRouters bounds Config.Routers.
const MaxRouters = 64

// systemPromptSeed seeds the token stream of Config.SystemPromptTokens ("system").
const systemPromptSeed = 0x73797374656d

// spreadArrivalsSalt is the second PCG seed of Config.SpreadArrivals ("spread").
const spreadArrivalsSalt = 0x737072656164

// resolved is a validated Config with defaults filled and the trace cut to Limit.
type resolved struct {
	Config
	systemPrompt []uint32 // the shared prefix of every prompt (SystemPromptTokens IDs)
	requests     []Request
	names        []string
	factories    []PolicyFactory
	routing      *routingPlan        // nil unless Config.Routing is set
	flows        *flowPlan           // nil unless some request names a tenant or a band
	flowControl  *flowcontrol.Config // FlowControl with Bands and Weight filled; nil without
	adapters     []string            // the LoRA adapters the requests name, in name order; nil: none
	adapterIDs   map[string]int32    // adapter name → its index in adapters
	adapterRoots []uint64            // per adapter, the root of the engines' block hash chains
}

func (cfg *Config) resolve() (*resolved, error) {
	if cfg.Trace == nil {
		return nil, ErrNoTrace
	}
	rc := &resolved{Config: *cfg}
	if cfg.Routing != nil {
		if err := rc.resolveRouting(); err != nil {
			return nil, err
		}
	} else if err := cfg.Fleet.validate(); err != nil {
		return nil, err
	}
	rc.Model.fill()
	if err := rc.Model.validate(); err != nil {
		return nil, err
	}
	if rc.Speed == 0 {
		rc.Speed = 1
	}
	if !(rc.Speed > 0) || math.IsInf(rc.Speed, 1) {
		return nil, fmt.Errorf("sim: Config.Speed = %v: must be finite and > 0: %w", cfg.Speed, state.ErrInvalidConfiguration)
	}
	if rc.Limit < 0 {
		return nil, fmt.Errorf("sim: Config.Limit = %d: must be >= 0: %w", cfg.Limit, state.ErrInvalidConfiguration)
	}
	if rc.SystemPromptTokens < 0 || rc.SystemPromptTokens > MaxTraceTokens {
		return nil, fmt.Errorf("sim: Config.SystemPromptTokens = %d: must be in [0, %d]: %w", cfg.SystemPromptTokens, MaxTraceTokens, state.ErrInvalidConfiguration)
	}
	if rc.SystemPromptTokens > 0 {
		rc.systemPrompt = make([]uint32, rc.SystemPromptTokens)
		fillStream(rc.systemPrompt, systemPromptSeed)
	}
	if rc.Routers == 0 {
		rc.Routers = 1
	}
	if rc.Routers < 0 || rc.Routers > MaxRouters {
		return nil, fmt.Errorf("sim: Config.Routers = %d: must be in [0, %d]: %w", cfg.Routers, MaxRouters, state.ErrInvalidConfiguration)
	}
	if rc.ShareDelay == 0 {
		rc.ShareDelay = DefaultShareDelay
	}
	if rc.ShareDelay < 0 {
		return nil, fmt.Errorf("sim: Config.ShareDelay = %v: must be >= 0: %w", cfg.ShareDelay, state.ErrInvalidConfiguration)
	}
	if rc.ReportInterval == 0 {
		rc.ReportInterval = DefaultReportInterval
	}
	if rc.ReportInterval < 0 {
		return nil, fmt.Errorf("sim: Config.ReportInterval = %v: must be > 0: %w", cfg.ReportInterval, state.ErrInvalidConfiguration)
	}
	switch rc.Reports {
	case "":
		rc.Reports = ReportsNative
	case ReportsNative, ReportsBasic:
	default:
		return nil, fmt.Errorf("sim: Config.Reports = %q: must be %q or %q: %w", cfg.Reports, ReportsNative, ReportsBasic, state.ErrInvalidConfiguration)
	}
	if rc.Parallelism == 0 {
		rc.Parallelism = runtime.GOMAXPROCS(0)
	}
	if rc.Warmup < 0 {
		return nil, fmt.Errorf("sim: Config.Warmup = %v: must be >= 0: %w", cfg.Warmup, state.ErrInvalidConfiguration)
	}
	if rc.Parallelism < 0 {
		return nil, fmt.Errorf("sim: Config.Parallelism = %d: must be >= 0: %w", cfg.Parallelism, state.ErrInvalidConfiguration)
	}
	if rc.Admission == nil {
		rc.Admission = admission.Limits{}
	}
	if rc.routing == nil { // a Routing run has its one name; its policies are the file's
		if err := rc.resolvePolicies(); err != nil {
			return nil, err
		}
	}
	reqs := cfg.Trace.Requests
	if rc.Limit > 0 && rc.Limit < len(reqs) {
		reqs = reqs[:rc.Limit]
	}
	if err := validateRequests(reqs); err != nil {
		return nil, err
	}
	rc.requests = reqs
	if rc.SpreadArrivals {
		rc.requests = spreadArrivals(reqs, rc.Seed)
	}
	if last := time.Duration(float64(rc.requests[len(rc.requests)-1].Arrival) / rc.Speed); rc.Warmup > 0 && rc.Warmup >= last {
		return nil, fmt.Errorf("sim: Config.Warmup = %v: at or past the last arrival (%v): no latency would be measured: %w",
			cfg.Warmup, last, state.ErrInvalidConfiguration)
	}
	rc.resolveAdapters()
	if err := rc.resolveTenants(); err != nil {
		return nil, err
	}
	if err := rc.resolveFlowControl(); err != nil {
		return nil, err
	}
	return rc, nil
}

// resolveAdapters collects the LoRA adapters the requests name and, when there are any, fills
// the engine model's LoRA defaults.
func (rc *resolved) resolveAdapters() {
	ids := map[string]int32{}
	for i := range rc.requests {
		if a := rc.requests[i].Adapter; a != "" {
			if _, ok := ids[a]; !ok {
				ids[a] = 0
				rc.adapters = append(rc.adapters, a)
			}
		}
	}
	if len(rc.adapters) == 0 {
		return
	}
	slices.Sort(rc.adapters)
	rc.adapterRoots = make([]uint64, len(rc.adapters))
	for i, a := range rc.adapters {
		ids[a] = int32(i)
		rc.adapterRoots[i] = adapterHashRoot(a)
	}
	rc.adapterIDs = ids
	rc.Model.fillLoRA()
}

// resolvePolicies sets rc.names and rc.factories from Policies and Factories.
func (rc *resolved) resolvePolicies() error {
	cfg := &rc.Config
	rc.names = cfg.Policies
	if rc.names == nil {
		rc.names = DefaultPolicyNames()
	}
	table := cfg.Factories
	if table == nil {
		table = DefaultPolicies()
	}
	if len(rc.names) == 0 {
		return &configError{msg: "sim: Config.Policies: no policy given", errs: []error{ErrNoPolicy, ErrUnknownPolicy}}
	}
	for i, name := range rc.names {
		f := table[name]
		if f == nil {
			known := make([]string, 0, len(table))
			for k, v := range table {
				if v != nil {
					known = append(known, k)
				}
			}
			slices.Sort(known)
			return &configError{msg: fmt.Sprintf("sim: Config.Policies: unknown policy %q (known: %s)", name, strings.Join(known, ", ")),
				errs: []error{ErrUnknownPolicy}}
		}
		if slices.Contains(rc.names[:i], name) {
			return &configError{msg: fmt.Sprintf("sim: Config.Policies: policy %q listed twice", name),
				errs: []error{ErrDuplicatePolicy, ErrUnknownPolicy}}
		}
		rc.factories = append(rc.factories, f)
	}
	return nil
}

// validateRequests applies the readers' rules to a possibly hand-built request list.
func validateRequests(reqs []Request) error {
	if len(reqs) == 0 {
		return &RequestError{Position: 0, Err: ErrEmptyTrace}
	}
	var prev time.Duration
	for i := range reqs {
		r := &reqs[i]
		fail := func(err error) error { return &RequestError{Position: i, Err: err} }
		switch {
		case r.InputTokens < 0 || r.OutputTokens < 0 || r.Arrival < 0:
			return fail(fmt.Errorf("%w: input %d, output %d, arrival %v", ErrNegative, r.InputTokens, r.OutputTokens, r.Arrival))
		case r.InputTokens > MaxTraceTokens || r.OutputTokens > MaxTraceTokens || r.Arrival > MaxArrival:
			return fail(fmt.Errorf("%w: input %d, output %d, arrival %v", ErrOutOfRange, r.InputTokens, r.OutputTokens, r.Arrival))
		case r.Arrival < prev:
			return fail(fmt.Errorf("%w: %v after %v", ErrUnsorted, r.Arrival, prev))
		case r.HashIDs != nil && len(r.HashIDs) != ceilBlocks(r.InputTokens):
			return fail(fmt.Errorf("%w: %d IDs for %d tokens", ErrHashIDMismatch, len(r.HashIDs), r.InputTokens))
		case r.Segments != nil:
			if err := checkSegments(r); err != nil {
				return fail(err)
			}
		}
		prev = r.Arrival
	}
	return nil
}

// spreadArrivals returns a copy of reqs (sorted by arrival) in which the requests of each whole
// second of arrival time arrive at sorted uniform draws over that second, in their order, from
// PCG(seed, spreadArrivalsSalt). The copy stays sorted.
func spreadArrivals(reqs []Request, seed uint64) []Request {
	out := slices.Clone(reqs)
	rng := rand.New(rand.NewPCG(seed, spreadArrivalsSalt))
	var at []time.Duration
	for i := 0; i < len(out); {
		second := out[i].Arrival.Truncate(time.Second)
		j := i + 1
		for j < len(out) && out[j].Arrival.Truncate(time.Second) == second {
			j++
		}
		at = at[:0]
		for range j - i {
			at = append(at, second+time.Duration(rng.Int64N(int64(time.Second))))
		}
		slices.Sort(at)
		for k := i; k < j; k++ {
			out[k].Arrival = at[k-i]
		}
		i = j
	}
	return out
}

// checkSegments reports a request whose Segments do not spell exactly InputTokens tokens or that
// also has HashIDs (ErrSegmentMismatch).
func checkSegments(r *Request) error {
	if r.HashIDs != nil {
		return fmt.Errorf("%w: both segments and hash IDs", ErrSegmentMismatch)
	}
	sum := 0
	for _, s := range r.Segments {
		if s.Tokens < 0 || s.Tokens > MaxTraceTokens {
			return fmt.Errorf("%w: a segment of %d tokens", ErrSegmentMismatch, s.Tokens)
		}
		sum += s.Tokens // at most len(Segments) × MaxTraceTokens: no overflow
	}
	if sum != r.InputTokens {
		return fmt.Errorf("%w: %d segment tokens for %d input tokens", ErrSegmentMismatch, sum, r.InputTokens)
	}
	return nil
}

// Replay replays cfg.Trace once per policy against a fresh simulated fleet and returns the
// side-by-side Report. Each run is deterministic: a single-goroutine event loop on a virtual
// clock with a seeded random source, so the same Config yields a byte-identical report whatever
// cfg.Parallelism is.
//
// Errors: ErrNoTrace, ErrEmptyFleet, ErrIncompletePD, ErrUnknownPolicy (with ErrDuplicatePolicy or
// ErrNoPolicy for those cases), *RequestError, or an
// error wrapping state.ErrInvalidConfiguration for another invalid field, all before anything is
// simulated; a policy factory's error; ctx's error when it is cancelled; an error wrapping
// kvindex or loadmon sentinels if the library rejects a simulated event (a bug). No partial
// report is returned.
func Replay(ctx context.Context, cfg Config) (*Report, error) {
	rc, err := cfg.resolve()
	if err != nil {
		return nil, err
	}
	total := len(rc.requests) * len(rc.names)
	var done atomic.Int64
	progress := func(n int) {
		d := done.Add(int64(n))
		if rc.Progress != nil {
			rc.Progress(int(d), total)
		}
	}
	results := make([]PolicyResult, len(rc.names))
	errs := make([]error, len(rc.names))
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	sem := make(chan struct{}, rc.Parallelism)
	var wg sync.WaitGroup
	for i := range rc.names {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sem <- struct{}{}
			defer func() { <-sem }()
			if ctx.Err() != nil {
				errs[i] = ctx.Err()
				return
			}
			res, err := simulate(ctx, rc, i, progress)
			if err != nil {
				errs[i] = wrapf(err, "policy %s", rc.names[i])
				cancel()
				return
			}
			results[i] = res
		}()
	}
	wg.Wait()
	// Report the first real failure in policy order, not a cancellation it caused.
	var first error
	for _, e := range errs {
		if e != nil && !errors.Is(e, context.Canceled) {
			return nil, e
		}
		if e != nil && first == nil {
			first = e
		}
	}
	if first != nil {
		return nil, first
	}
	return newReport(rc, results), nil
}
