// Command replay shows, offline, what a routing configuration does to real traffic: it replays a
// request trace against a simulated fleet of inference engines once per routing policy, with the
// enginepick library itself as the router, and prints a side-by-side comparison. Run it with
//
//	go run ./examples/replay
//
// By default it replays the embedded Mooncake conversation trace (12,031 requests, about one hour
// of a production chat service) on 16 plain engines, each one Llama-3.1-8B-class model on one
// H100-class GPU (sim.DefaultEngineModel), comparing round_robin, random, power_of_two,
// least_load and cache_aware. Same flags, same output, byte for byte.
//
// The default load point is 16 engines with arrivals compressed 4× (-speed 4): the trace's one
// hour plays in about 15 minutes of virtual time. At the trace's own pace 16 such engines idle,
// with round-robin keeping them about 13 % busy prefilling, so no policy has anything to avoid;
// at 4× round-robin keeps them about 51 % busy prefilling and busy almost all the time once
// decoding is counted, so requests queue behind long prompts and its TTFT p99 nearly triples. Time
// compression keeps the order and mix of requests, and with it the cache reuse of every policy,
// which depends on how many requests come between two turns of a conversation, not on how many
// seconds.
//
// Flags:
//
//	-trace FILE      Mooncake JSONL or Azure CSV trace, optionally gzipped (default: the embedded
//	                 Mooncake conversation trace)
//	-engines N       plain engines (default 16)
//	-pd P:D          prefill/decode fleet instead: P prefill and D decode engines; the prefill group
//	                 uses the policy under test, decode uses power_of_two
//	-policies LIST   comma-separated policies (default
//	                 round_robin,random,power_of_two,least_load,cache_aware). The peer
//	                 baselines dynamo, llmd and smg (the current
//	                 defaults of NVIDIA Dynamo's cost, llm-d's router profile and the Shepherd
//	                 Model Gateway's cache_aware; see sim.Dynamo, sim.LLMD, sim.SMG) and
//	                 dynamo_legacy, llmd_legacy and sglang_legacy (their earlier rules; see
//	                 sim.Dynamo, sim.LLMDLegacy, sim.SGLangLegacy) run when listed, and so does
//	                 llmd_lora (llm-d's scorers with its LoRA affinity scorer; sim.NewLLMDLoRA),
//	                 and so do the affinity policies session_aware, sticky (over one in-memory
//	                 affinity store per run) and sticky_rendezvous (stateless, load factor 1.25),
//	                 keyed by the request's conversation chain (sim.Request.SessionKey; an Azure
//	                 trace has none, so they route every request as keyless), and the oracle
//	                 baselines oracle and oracle_work, which read the simulated engines' exact
//	                 caches and queues and pick the least predicted TTFT (sim.Oracle): what perfect
//	                 information buys on the same engine model
//	-speed X         divide every arrival time by X, a positive finite number (default 4)
//	-limit N         replay only the first N requests (default: all)
//	-seed N          random seed of every policy run (default 1)
//	-spread-arrivals spread each second's requests uniformly over that second, in their order,
//	                 drawn from -seed: the Mooncake trace's timestamps are whole seconds, so as given
//	                 each second's requests arrive at one instant (default: as given)
//	-system-prompt N prepend one shared N-token prompt to every request (default 0: none), the
//	                 case of a long system prompt that every request starts with
//	-routers N       N independent router replicas, each with its own router, in-flight counters
//	                 and approximate entries; requests go round-robin over them and every engine's
//	                 KV events and load reports reach all of them; the affinity policies of all
//	                 replicas share one affinity store, as replicas share Redis (default 1)
//	-share           the -routers replicas share their dispatches and route-time placements, as
//	                 replicas with a replicas block do over Redis
//	-share-delay D   how long a shared decision takes to reach the other replicas (default 5ms)
//	-prefill-model M attention (default): an uncached token costs its linear work plus attention
//	                 over its whole context, cached tokens included; flat: one rate for uncached
//	                 tokens at any length, the earlier model, for comparison (see sim.EngineModel)
//	-engine-priority the engines schedule waiting requests by priority, as vLLM's
//	                 --scheduling-policy priority: the router forwards each request's priority
//	                 negated, since vLLM serves lower values first (sim.EngineModel)
//	-reports R       what the engines' load reports carry: native (default), as SGLang's, with
//	                 the native fields (waiting uncached tokens, prefill counters); basic, as
//	                 vLLM's /metrics: running and waiting requests and KV use only (sim.LoadReports)
//	-sweep           instead of one replay at -speed, find for each policy the highest speed at
//	                 which TTFT p99 stays at or under -slo, by bisection to 5 % (sim.Sweep), and
//	                 print it as a table: the capacity a policy buys, followed by the sustained
//	                 throughput ceiling of any routing (sim.ComputeCeiling). Each policy takes about 8
//	                 replays, so under -sweep -limit defaults to 3000 requests (-limit 0: all)
//	-slo D           TTFT p99 target of -sweep (default 10s)
//	-workload SPEC   replay a generated workload instead of a trace: chats (short multi-turn chats),
//	                 prefix-groups (groups of requests sharing a long prefix), tenants (tenants
//	                 with their own arrival rates, one heavy, and a critical priority band) or lora
//	                 (requests for LoRA adapters of Zipf popularity, which the engines hold in 4
//	                 slots each; sim.LoRA, sim.EngineModel), optionally with parameters, e.g.
//	                 chats:conversations=500,rate=5
//	                 (sim.ParseWorkload, docs/traces.md); -speed then defaults to 1 and KV blocks
//	                 are 16 tokens
//	-workload-seed N random seed of -workload (default: -seed)
//	-json            print the report as JSON instead of a table
//	-admission JSON  per-engine admission caps, e.g. '{"max_waiting_requests": 32}' (default:
//	                 admit everything); unknown fields and values that are not non-negative
//	                 integers are errors that name the field and what is allowed
//	-flow-control    queue in the router what the fleet cannot serve now (package flowcontrol,
//	                 docs/design.md §17): one priority band per request priority, fair shares
//	                 between tenants, the detector's default thresholds. Pair it with an in-flight
//	                 cap at the engines' running batch, -admission '{"max_inflight_requests": 256}',
//	                 as a deployment would: the router then holds what the engines would queue (the
//	                 detector alone reads reports up to one interval old, and a report that shows
//	                 room releases the whole queue). The table gains "shed" (HTTP 429). With
//	                 -config, the file's flow_control block decides instead
//	-warmup D        leave the requests arriving in the first D of the replay (after -speed) out
//	                 of the latency figures, e.g. 10s: they then describe the loaded fleet, not its
//	                 start from idle engines with empty caches; counts, throughput and hit rate
//	                 still cover the whole run (default 0: every request)
//	-plot DIR        also write PNG charts to DIR: ttft_cdf.png, hit_rate.png, imbalance.png
//	-config FILE     replay a routing configuration file instead of -engines, -pd, -policies and
//	                 -admission: the file production builds its router from (config.Load,
//	                 docs/design.md §14, examples/configs/). The replay simulates exactly the
//	                 engines the file lists for the model (their IDs and stages; each one DP rank,
//	                 its load and KV events fed by the simulation instead of its endpoints) and
//	                 routes with config.New from the file: its buckets, groups, policies,
//	                 admission caps, flow control, freshness, KV block size and affinity idle
//	                 time. Redis affinity is replaced by one in-memory store shared by the
//	                 -routers replicas.
//	                 The report has one row, named after the file (see sim.Routing)
//	-model M         with -config: the model whose engines and buckets are replayed (default: the
//	                 file's first model)
//
// When the requests name LoRA adapters (the lora workload), the table gains "loads/1k": the
// adapters the engines loaded into a slot per 1,000 requests replayed.
//
// When the requests name tenants or priority bands (the tenants workload), a second table follows
// the first: per policy, each band and each tenant's requests, TTFT, E2E, output throughput, the
// prompt and output tokens it was served by the last arrival, and Jain's fairness index of each
// band (sim.TenantResult, sim.BandResult).
//
// A figure no request defines (every request of a policy rejected by admission, say) prints as
// "n/a", and is null in -json output. After the table, a line starting "warning:" flags each
// policy whose run was overloaded: its backlog of requests awaiting their first token was still
// growing when the trace ended (the criterion is sim.Overload's), so its latencies measure that
// backlog rather than routing; with -json the same lines go to stderr.
//
// The exit status is 0 on success, 2 for a command-line mistake (an unknown flag, a bad flag value
// or an invalid combination, a -trace that is missing, a directory or empty, a -plot directory
// that cannot be created or written; reported once on stderr, before anything is replayed), 130
// when interrupted (SIGINT, Ctrl-C: the replay stops at once and "replay: interrupted" is
// printed; a second Ctrl-C kills the process) and 1 for any other failure.
//
// A progress bar appears on stderr when stderr is a terminal and the replay takes more than a
// second; the wall time of the replay goes to stderr too, so stdout stays reproducible.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/schollz/progressbar/v3"
	"golang.org/x/term"

	"github.com/enginepick/enginepick/admission"
	"github.com/enginepick/enginepick/config"
	"github.com/enginepick/enginepick/flowcontrol"
	"github.com/enginepick/enginepick/internal/sim"
	"github.com/enginepick/enginepick/state"
)

// Defaults of the flags: the documented load point (see the package comment).
const (
	defaultEngines = 16
	defaultSpeed   = 4.0
	defaultSeed    = 1
)

// Command-line errors of run. main prefixes every message with "replay: ", so none of them does.
var (
	// errFleetFlags reports -engines and -pd given together.
	errFleetFlags = errors.New("-engines and -pd are exclusive: give one fleet")
	// errBadSpeed reports a -speed that is zero, negative, NaN or infinite. sim.Config.Speed
	// reads 0 as 1; the flag does not, so that "-speed 0" cannot run at the trace's pace
	// unnoticed.
	errBadSpeed = errors.New("must be a positive finite number")
	// errInterrupted reports a replay stopped by SIGINT; main exits with exitInterrupted.
	errInterrupted = errors.New("interrupted")
	// errEmptyTrace reports a -trace file of zero bytes.
	errEmptyTrace = errors.New("file is empty")
	// errTraceIsDir reports a -trace that names a directory.
	errTraceIsDir = errors.New("is a directory, want a trace file")
	// errPlotNotDir reports a -plot that names something other than a directory.
	errPlotNotDir = errors.New("is not a directory")
)

// exitInterrupted is the exit status after SIGINT: 128 + 2, as a shell reports a process killed
// by it.
const exitInterrupted = 130

// usageText is the paragraph -h prints before the flags.
const usageText = `Usage: replay [flags]

replay shows, offline, what a routing configuration does to real traffic: it replays a request
trace (by default the embedded Mooncake conversation trace, 12,031 requests of a production chat
service) against a simulated fleet of inference engines once per routing policy, with the
enginepick library as the router, and prints one row per policy: the share of prompt tokens the
engines' prefix caches served (hit rate; the heading gives the trace's infinite-cache limit),
time to first token (TTFT) and end-to-end (E2E) latency quantiles in seconds of virtual time,
output tokens per second, load imbalance (max ÷ mean requests per engine, 1 is even), the
engines' mean share of time spent prefilling (prefill util) and prefilling or decoding (busy),
and the requests dropped because admission rejected every engine (rejected, HTTP 503), flow
control refused them (shed, HTTP 429; -flow-control) or no bucket fits them (too long, HTTP
400). When the requests name LoRA adapters (-workload lora), "loads/1k" gives the adapters the
engines loaded into a slot per 1,000 requests. When the requests name tenants (-workload
tenants), a second table gives the same per
priority band and tenant, with the tokens each was served by the last arrival and each band's
Jain fairness index. "n/a" marks a figure no request defines; a "warning:" line after the
table marks a policy whose run was overloaded (queues still growing when the trace
ended), whose latencies measure that backlog, not routing. The same flags print the same bytes.

Flags:
`

// replayStarting, when set (tests), is called once the flags and the trace are checked, just before
// the replay starts.
var replayStarting func()

// usageError is a command-line mistake: main exits with status 2 for it, as the flag package
// does. printed reports that the flag set has already written the error, and the usage, to
// stderr, so main must not print it again.
type usageError struct {
	err     error
	printed bool
}

func (e *usageError) Error() string { return e.err.Error() }

// Unwrap returns the mistake.
func (e *usageError) Unwrap() error { return e.err }

// usage marks err as a command-line mistake that main still has to print.
func usage(err error) error { return &usageError{err: err} }

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	// After the first SIGINT, restore the default action, so that a second one kills the process
	// even if something does not stop.
	context.AfterFunc(ctx, stop)
	err := run(ctx, os.Args[1:], os.Stdout, os.Stderr, term.IsTerminal(int(os.Stderr.Fd())))
	stop()
	os.Exit(exitCode(err, os.Stderr))
}

// exitCode writes err to stderr, prefixed "replay: ", unless the flag set has printed it already,
// and returns the exit status: 0 for no error or -help, 2 for a command-line mistake, 130
// (exitInterrupted) for errInterrupted, 1 for any other failure.
func exitCode(err error, stderr io.Writer) int {
	var ue *usageError
	switch {
	case err == nil || errors.Is(err, flag.ErrHelp):
		return 0
	case errors.Is(err, errInterrupted):
		fmt.Fprintln(stderr, "replay:", errInterrupted)
		return exitInterrupted
	case errors.As(err, &ue):
		if !ue.printed {
			fmt.Fprintln(stderr, "replay:", err)
		}
		return 2
	default:
		fmt.Fprintln(stderr, "replay:", err)
		return 1
	}
}

// run parses args, replays and writes the report to stdout. Progress, timing and, with -json, the
// overload warnings go to stderr; the progress bar only when interactive is true. Command-line
// mistakes come back as a *usageError: flag syntax errors (already printed by the flag set, with
// the usage), bad flag values and combinations, -trace and -plot paths that cannot be used, and the
// configuration errors sim.Replay returns for them (those wrapping
// state.ErrInvalidConfiguration). -help returns flag.ErrHelp; a cancelled ctx returns
// errInterrupted.
func run(ctx context.Context, args []string, stdout, stderr io.Writer, interactive bool) error {
	fs := flag.NewFlagSet("replay", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), usageText)
		fs.PrintDefaults()
	}
	tracePath := fs.String("trace", "", "Mooncake JSONL or Azure CSV trace file, optionally gzipped (default: embedded Mooncake conversation trace)")
	engines := fs.Int("engines", defaultEngines, "number of plain engines")
	pd := fs.String("pd", "", "prefill/decode fleet P:D instead of plain engines")
	policies := fs.String("policies", strings.Join(sim.DefaultPolicyNames(), ","), "comma-separated policies to compare")
	speed := fs.Float64("speed", defaultSpeed, "time compression: arrival times are divided by this positive, finite number")
	limit := fs.Int("limit", 0, "replay only the first N requests (0: all)")
	seed := fs.Uint64("seed", defaultSeed, "random seed of every policy run")
	asJSON := fs.Bool("json", false, "print the report as JSON (undefined figures are null; warnings go to stderr)")
	plotDir := fs.String("plot", "", "directory to write PNG charts to, created if needed (checked before the replay)")
	limitsJSON := fs.String("admission", "", `per-engine admission caps as JSON, e.g. '{"max_waiting_requests": 32}' (default: admit everything)`)
	configPath := fs.String("config", "", "routing configuration file (YAML or JSON, as config.Load reads) to replay instead of -engines, -pd, -policies and -admission")
	model := fs.String("model", "", "with -config: the model to replay (default: the file's first model)")
	flowControl := fs.Bool("flow-control", false, `queue in the router what the fleet cannot serve now: a band per priority, fair shares between tenants (pair with -admission '{"max_inflight_requests": 256}')`)
	warmup := fs.Duration("warmup", 0, "leave the requests arriving in the first D (after -speed) out of the latency figures, e.g. 10s; counts, throughput and hit rate still cover every request (default 0: none left out)")
	scenario := addScenarioFlags(fs)
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return &usageError{err: err, printed: true}
	}
	if fs.NArg() > 0 {
		return usage(fmt.Errorf("unexpected arguments %q", fs.Args()))
	}
	if !(*speed > 0) || math.IsInf(*speed, 1) {
		return usage(fmt.Errorf("-speed %v: %w", *speed, errBadSpeed))
	}

	cfg := sim.Config{Speed: *speed, Limit: *limit, Seed: *seed, Fleet: sim.Fleet{Plain: *engines}}
	if *pd != "" {
		engSet := false
		fs.Visit(func(f *flag.Flag) { engSet = engSet || f.Name == "engines" })
		if engSet {
			return usage(errFleetFlags)
		}
		fleet, err := sim.ParsePD(*pd)
		if err != nil {
			return usage(err)
		}
		cfg.Fleet = fleet
	}
	cfg.Policies = splitList(*policies)
	if *configPath != "" || *model != "" {
		if err := applyConfigFile(fs, &cfg, *configPath, *model); err != nil {
			return err
		}
	}
	if err := scenario.apply(fs, &cfg); err != nil {
		return err
	}
	if *limitsJSON != "" {
		var limits admission.Limits
		if err := json.Unmarshal([]byte(*limitsJSON), &limits); err != nil {
			return usage(admissionError(err))
		}
		cfg.Admission = limits
	}
	if *flowControl {
		cfg.FlowControl = &flowcontrol.Config{}
	}
	if *warmup < 0 {
		return usage(fmt.Errorf("-warmup %v: must not be negative", *warmup))
	}
	cfg.Warmup = *warmup
	if *tracePath != "" {
		if err := checkTrace(*tracePath); err != nil {
			return usage(err)
		}
	}
	if *plotDir != "" {
		if err := checkPlotDir(*plotDir); err != nil {
			return usage(err)
		}
	}
	var err error
	switch {
	case cfg.Trace != nil: // generated by -workload
	case *tracePath == "":
		cfg.Trace, err = sim.MooncakeConversation()
	default:
		cfg.Trace, err = sim.ReadTraceFile(*tracePath)
	}
	if err != nil {
		return err
	}
	if ctx.Err() != nil {
		return errInterrupted
	}
	if replayStarting != nil {
		replayStarting()
	}

	if *scenario.sweep {
		return scenario.runSweep(ctx, fs, cfg, *asJSON, stdout, stderr)
	}
	start := time.Now()
	prog := &progress{out: stderr, start: start, enabled: interactive}
	cfg.Progress = prog.update
	rep, err := sim.Replay(ctx, cfg)
	prog.finish()
	switch {
	case ctx.Err() != nil:
		return errInterrupted
	case errors.Is(err, state.ErrInvalidConfiguration):
		return usage(err) // a flag's value: -engines, -policies, -limit
	case err != nil:
		return err
	}
	fmt.Fprintf(stderr, "replayed %d requests × %d policies in %.1f s\n", rep.Requests, len(rep.Results),
		time.Since(start).Seconds())

	if *plotDir != "" {
		if err := writePlots(*plotDir, rep); err != nil {
			return err
		}
	}
	if *asJSON {
		for _, w := range rep.Warnings() {
			fmt.Fprintln(stderr, w)
		}
		return rep.WriteJSON(stdout)
	}
	return rep.WriteTable(stdout)
}

// errConfigFlags reports -config with a flag that the file replaces.
var errConfigFlags = errors.New("the file describes the fleet, its policies and admission")

// applyConfigFile loads the -config file into cfg.Routing, for model (empty: the file's first).
// -engines, -pd, -policies and -admission are the file's business, and -model needs -config: each
// such combination, and a file config.Load rejects, is a command-line mistake.
func applyConfigFile(fs *flag.FlagSet, cfg *sim.Config, path, model string) error {
	if path == "" {
		return usage(errors.New("-model needs -config"))
	}
	var clash []string
	fs.Visit(func(f *flag.Flag) {
		switch f.Name {
		case "engines", "pd", "policies", "admission":
			clash = append(clash, "-"+f.Name)
		}
	})
	if len(clash) > 0 {
		return usage(fmt.Errorf("-config and %s are exclusive: %w", strings.Join(clash, ", "), errConfigFlags))
	}
	rc, err := config.Load(path)
	if err != nil {
		return usage(&flagError{msg: "-config " + path + ": " + err.Error(), err: err})
	}
	name := strings.TrimSuffix(filepath.Base(path), filepath.Ext(path))
	if model != "" {
		name += "/" + model
	}
	*cfg = sim.Config{Speed: cfg.Speed, Limit: cfg.Limit, Seed: cfg.Seed,
		Routing: &sim.Routing{Config: rc, Model: state.ModelID(model), Name: name}}
	return nil
}

// flagError is a bad flag value worded once: Error returns msg, Unwrap the cause, so errors.Is
// still finds os.ErrNotExist, state.ErrUnknownField and the like.
type flagError struct {
	msg string
	err error
}

func (e *flagError) Error() string { return e.msg }

// Unwrap returns the cause.
func (e *flagError) Unwrap() error { return e.err }

// admissionError words an -admission decoding error without repeating the admission package's
// prefix: `-admission: limits field "max_waitin": unknown field: want one of …`.
func admissionError(err error) error {
	return &flagError{msg: "-admission: " + strings.TrimPrefix(err.Error(), "admission: "), err: err}
}

// checkTrace reports a -trace path that cannot be a trace: missing or unreadable, a directory, or
// an empty file. The trace's content is checked when it is read.
func checkTrace(path string) error {
	fail := func(err error) error { return &flagError{msg: fmt.Sprintf("-trace %s: %v", path, err), err: err} }
	f, err := os.Open(path)
	if err != nil {
		return fail(pathCause(err, path))
	}
	defer f.Close()
	st, err := f.Stat()
	switch {
	case err != nil:
		return fail(pathCause(err, path))
	case st.IsDir():
		return fail(errTraceIsDir)
	case st.Size() == 0:
		return fail(errEmptyTrace)
	}
	return nil
}

// checkPlotDir creates the -plot directory if needed and checks that a file can be written in it,
// so that a replay is not lost to an unwritable directory at the end.
func checkPlotDir(dir string) error {
	fail := func(err error) error { return &flagError{msg: fmt.Sprintf("-plot %s: %v", dir, err), err: err} }
	if st, err := os.Stat(dir); err == nil && !st.IsDir() {
		return fail(errPlotNotDir)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fail(pathCause(err, dir))
	}
	f, err := os.CreateTemp(dir, ".replay-write-check-*")
	if err != nil {
		return fail(fmt.Errorf("cannot write: %w", pathCause(err, "")))
	}
	name := f.Name()
	if err := errors.Join(f.Close(), os.Remove(name)); err != nil {
		return fail(fmt.Errorf("cannot write: %w", pathCause(err, "")))
	}
	return nil
}

// pathCause returns the cause of an *fs.PathError about path itself (any path when path is
// empty), whose message would repeat a path the caller already names, or err itself.
func pathCause(err error, path string) error {
	var pe *os.PathError
	if errors.As(err, &pe) && (path == "" || filepath.Clean(pe.Path) == filepath.Clean(path)) {
		return pe.Err
	}
	return err
}

// splitList splits a comma-separated list, trimming spaces. An empty string yields an empty,
// non-nil list, which sim.Replay rejects.
func splitList(s string) []string {
	out := []string{}
	for _, part := range strings.Split(s, ",") {
		if part = strings.TrimSpace(part); part != "" {
			out = append(out, part)
		}
	}
	return out
}

// progress draws a progress bar on stderr once a replay has run for a second, if stderr is a
// terminal. The replay calls update from several goroutines.
type progress struct {
	out     io.Writer
	start   time.Time
	enabled bool

	mu   sync.Mutex
	bar  *progressbar.ProgressBar
	done int
}

func (p *progress) update(done, total int) {
	if !p.enabled {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if done <= p.done {
		return // calls from different runs may arrive out of order
	}
	p.done = done
	if p.bar == nil {
		if time.Since(p.start) < time.Second {
			return
		}
		p.bar = progressbar.NewOptions(total,
			progressbar.OptionSetWriter(p.out),
			progressbar.OptionSetDescription("replaying"),
			progressbar.OptionShowCount(),
			progressbar.OptionSetPredictTime(true),
			progressbar.OptionThrottle(100*time.Millisecond),
			progressbar.OptionClearOnFinish(),
		)
	}
	_ = p.bar.Set(done)
}

func (p *progress) finish() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.bar != nil {
		_ = p.bar.Finish()
		_ = p.bar.Clear()
	}
}
