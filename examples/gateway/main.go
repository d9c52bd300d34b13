package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/enginepick/enginepick/examples/gateway/internal/gw"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Stdout, os.Stderr, nil); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return
		}
		fmt.Fprintln(os.Stderr, "gateway:", err)
		os.Exit(1)
	}
}

// engineFlags collects repeated --engine flags.
type engineFlags []string

func (e *engineFlags) String() string     { return strings.Join(*e, " ") }
func (e *engineFlags) Set(v string) error { *e = append(*e, v); return nil }

// options are the command's flags.
type options struct {
	listen           string
	config           string
	enginesFile      string
	engineKind       string
	engines          engineFlags
	policy           string
	decodePolicy     string
	blockTokens      int
	engineQueueLimit uint64
	minMatched       uint64
	sessionHeader    string
	routingKeyHeader string
	tokenize         bool
	tokenizeTimeout  time.Duration
	bytesPerToken    int
	maxBodyBytes     int64
	loadInterval     time.Duration
	loadTimeout      time.Duration
	loadJitter       float64
	freshness        time.Duration
	breakerFailures  int
	probeInterval    time.Duration
	probePath        string
	prefillTimeout   time.Duration
	enginePriority   bool
	debug            bool
	fakeEngines      int

	// explicit holds the names of the flags given on the command line (parseArgs).
	explicit map[string]bool
}

// usageText is the head of --help; the flags' own documentation follows it.
const usageText = `gateway: an OpenAI-compatible HTTP gateway routing to vLLM and SGLang engines with enginepick.

Usage: gateway [flags]

The routing comes from one of two places:

  --config FILE   a routing configuration (YAML or JSON, docs/design.md §14; examples/configs/):
                  its engines, models, buckets, groups, policies, admission caps, load and KV
                  settings and affinity settings, the same file examples/replay -config replays.
                  The flags the file replaces (--engine, --engines-file, --policy,
                  --decode-policy, --block-tokens, --engine-queue-limit, --min-matched-tokens,
                  --session-header, --routing-key-header, --load-*, --freshness) are refused
                  with it. An engine's ID is its base URL; its software is SGLang when its load
                  format is sglang_*, vLLM for vllm_metrics, else --engine-kind. With
                  affinity.store redis the bindings live in Redis (password from
                  $ENGINEPICK_REDIS_PASSWORD); with a replicas block, gateways on one
                  Redis channel share their dispatches and act as one router (the same
                  password unless the block sets one). With a flow_control block, requests the
                  engines cannot take wait in the gateway: header x-enginepick-priority (an
                  integer) picks the band, x-enginepick-flow (else the body's "user") the
                  flow; a rejection is a 429 with Retry-After, a band's ttl a 503.
  --engine and --engines-file   engines given one by one, each model served by one plain bucket
                  and/or one PD bucket with --policy and --decode-policy.

An --engines-file is YAML or JSON: "engines:" followed by a list with the same keys as --engine.
An --engine value is comma-separated key=value pairs:
  url=BASE_URL            the engine's base URL, also its ID (required)
  model=NAME              the model name clients send (required)
  kind=vllm|sglang        the server software (required)
  stage=plain|prefill|decode   its role (default plain); a model with prefill and decode engines
                          gets a PD bucket, one with plain engines a plain bucket
  dp_ranks=N              data-parallel ranks (default 1)
  bootstrap_port=PORT     a prefill engine's PD bootstrap port (SGLang); none sends null
  pd_compatibility=LABEL  PD compatibility label: decode engines pair only with prefill engines
                          of the same label (docs/design.md §3)
  load=FORMAT             load source: vllm_metrics (GET /metrics), sglang_get_load (GET
                          /get_load), sglang_loads (GET /v1/loads) or none; default vllm_metrics
                          for vllm, sglang_loads for sglang
  load_url=URL            the load endpoint, if not base URL + the format's path
  kv_events=ZMQ_ENDPOINT  the KV-event publisher of rank 0 (e.g. tcp://host:5557); rank r uses
                          the port + r
  kv_topic=TOPIC          the publisher's topic (default "")
  kv_replay=ZMQ_ENDPOINT  the publisher's replay socket of rank 0 (default none)
  kv_bind=true            bind kv_events instead of dialing it (publishers that connect out)
  dp_rank_start=N         the global DP rank of the engine's rank 0 (a node owning global ranks
                          4..7 has 4): load pages and KV events name global ranks, and a picked
                          rank r is sent as N + r (default 0)
  ranks.R.KEY=VALUE       rank R's own endpoints, for ranks run as separate servers (one HTTP
                          port per rank): KEY is url (a request picked for rank R is sent there,
                          carrying no rank), load_url (default that url + the format's path),
                          kv_events, kv_topic or kv_replay (used as given, no port offset). Set
                          each KEY for every rank or none, and no engine-level load_url or kv_*

Flags:
`

// newFlagSet declares every flag with its documentation (printUsage prints them). Parsing prints
// nothing: parseArgs prints the usage for --help and returns errors for its caller to print.
func newFlagSet(o *options) *flag.FlagSet {
	fs := flag.NewFlagSet("gateway", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.Usage = func() {}
	fs.StringVar(&o.listen, "listen", "127.0.0.1:8080", "address to serve on (host:port)")
	fs.StringVar(&o.config, "config", "", "routing configuration file (YAML or JSON, config.Load; examples/configs/) instead of --engine and --engines-file")
	fs.StringVar(&o.enginesFile, "engines-file", "", "YAML or JSON file with the engine list (engines: [...])")
	fs.StringVar(&o.engineKind, "engine-kind", "vllm", "with --config: server software (vllm or sglang) of the engines without a load endpoint")
	fs.Var(&o.engines, "engine", "an engine, as comma-separated key=value pairs (repeat for each engine; keys above)")
	fs.StringVar(&o.policy, "policy", "cache_aware", "policy of plain and prefill groups: round_robin, random, power_of_two, least_load or cache_aware")
	fs.StringVar(&o.decodePolicy, "decode-policy", "power_of_two", "policy of decode groups: round_robin, random, power_of_two or least_load")
	fs.IntVar(&o.blockTokens, "block-tokens", 16, "KV block size in tokens of the engines (vLLM block_size, SGLang page_size); the prefix index hashes prompts with it")
	fs.Uint64Var(&o.engineQueueLimit, "engine-queue-limit", 0, "cache-aware soft queue gate: divert from a prefix holder with this many waiting requests (0: off)")
	fs.Uint64Var(&o.minMatched, "min-matched-tokens", 0, "cache-aware hit gate in tokens (0: the library default, a fifth of the prompt)")
	fs.StringVar(&o.sessionHeader, "session-header", "x-session-id", "request header read as the session key (empty: none)")
	fs.StringVar(&o.routingKeyHeader, "routing-key-header", "x-sgl-routing-key", "request header read as the sticky routing key (empty: none)")
	fs.BoolVar(&o.tokenize, "tokenize", true, "tokenize prompts through an engine's POST /tokenize (false: estimate every prompt from its body size)")
	fs.DurationVar(&o.tokenizeTimeout, "tokenize-timeout", 2*time.Second, "bound on one /tokenize request; on failure the length is estimated")
	fs.IntVar(&o.bytesPerToken, "bytes-per-token", 4, "body bytes per token of the length estimate used when tokenization is unavailable")
	fs.Int64Var(&o.maxBodyBytes, "max-body-bytes", gw.DefaultMaxBodyBytes, "request body limit in bytes; a larger body is a 413 (vLLM's and SGLang's Python servers set none, vLLM's Rust frontend 32 MiB)")
	fs.DurationVar(&o.loadInterval, "load-interval", time.Second, "time between two load polls of one engine")
	fs.DurationVar(&o.loadTimeout, "load-timeout", 500*time.Millisecond, "bound on one load poll (an engine that hangs goes stale)")
	fs.Float64Var(&o.loadJitter, "load-jitter", 0.1, "random extra wait between load polls, as a fraction of --load-interval, in [0, 1]")
	fs.DurationVar(&o.freshness, "freshness", 5*time.Second, "how long a load report stays usable; older reports make the engine's load unknown")
	fs.IntVar(&o.breakerFailures, "breaker-failures", 3, "consecutive engine failures (a failed health probe, a prefill leg past --prefill-timeout) that mark an engine unhealthy; no connection at all does at once. What a request could have caused (a 5xx answer, no answer after the whole request was sent, an answer cut off) only triggers a health probe of the engine, one at a time per engine, and counts if the probe fails; 4xx answers and bodies the engine refused never count")
	fs.DurationVar(&o.probeInterval, "probe-interval", 5*time.Second, "time between health probes of unhealthy engines")
	fs.StringVar(&o.probePath, "probe-path", "/health", "health endpoint probed to bring an unhealthy engine back, and after a failure a request could have caused (a 200 within 2 s passes)")
	fs.DurationVar(&o.prefillTimeout, "prefill-timeout", 10*time.Minute, "bound on a PD prefill request, which completes even if the client leaves")
	fs.BoolVar(&o.enginePriority, "engine-priority", false, "forward each request's band (x-enginepick-priority, "+
		"the flow_control band it falls in) to vLLM engines as the body's priority, negated: for engines run with "+
		"--scheduling-policy priority, which serve lower values first and refuse other priorities than 0 without it")
	fs.BoolVar(&o.debug, "debug", false, "log at debug level (selection failures, upstream errors, failed polls); warnings are logged without it")
	fs.IntVar(&o.fakeEngines, "fake-engines", 0, "start this many in-process vLLM-like test engines (model \"fake\", no GPU) and route to them, instead of --engine, --engines-file or --config")
	return fs
}

// printUsage writes --help: usageText, then every flag with its documentation and default.
func printUsage(fs *flag.FlagSet, w io.Writer) {
	fmt.Fprint(w, usageText)
	fs.SetOutput(w)
	fs.PrintDefaults()
	fs.SetOutput(io.Discard)
}

// parseArgs parses the command line into options, recording which flags were given. --help (or
// -h) prints the usage to stdout once and returns flag.ErrHelp; a bad flag prints nothing and
// returns its error.
func parseArgs(args []string, stdout io.Writer) (options, error) {
	var o options
	fs := newFlagSet(&o)
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			printUsage(fs, stdout)
			return o, err
		}
		return o, fmt.Errorf("%w (gateway --help lists the flags)", err)
	}
	if fs.NArg() > 0 {
		return o, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	o.explicit = map[string]bool{}
	fs.Visit(func(f *flag.Flag) { o.explicit[f.Name] = true })
	return o, nil
}

// run parses args, builds the gateway and serves until ctx is done. It writes --help and its
// start-up line to stdout and its log to stderr, and returns every error for its caller to print.
// ready, when set, is called with the listening address once the server accepts connections.
func run(ctx context.Context, args []string, stdout, stderr io.Writer, ready func(addr string)) error {
	o, err := parseArgs(args, stdout)
	if err != nil {
		return err
	}
	if o.fakeEngines != 0 {
		stop, err := startFakeEngines(&o, stdout)
		if err != nil {
			return err
		}
		defer stop()
	}
	// Warnings (degraded load reports, KV-event feed failures) go to stderr; --debug adds the rest.
	log := zap.New(zapcore.NewCore(zapcore.NewConsoleEncoder(zap.NewDevelopmentEncoderConfig()), zapcore.Lock(zapcore.AddSync(stderr)), zap.WarnLevel))
	if o.debug {
		var err error
		if log, err = zap.NewDevelopment(); err != nil {
			return err
		}
	}
	g, err := build(o, log)
	if err != nil {
		return err
	}
	defer g.close()
	ln, err := net.Listen("tcp", o.listen)
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: g.handler, ReadHeaderTimeout: 30 * time.Second}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	errc := make(chan error, 1)
	go func() { errc <- g.runBackground(ctx) }()
	go func() {
		<-ctx.Done()
		shutdown, done := context.WithTimeout(context.Background(), 10*time.Second)
		defer done()
		_ = srv.Shutdown(shutdown)
	}()
	fmt.Fprintf(stdout, "gateway: serving %d engines on http://%s\n", len(g.registry.All()), ln.Addr())
	if ready != nil {
		ready(ln.Addr().String())
	}
	err = srv.Serve(ln)
	cancel()
	if bgErr := <-errc; bgErr != nil && err == nil {
		err = bgErr
	}
	if errors.Is(err, http.ErrServerClosed) {
		return nil
	}
	return err
}
