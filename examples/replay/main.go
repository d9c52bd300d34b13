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
// with round-robin keeping them about 12 % busy prefilling, so no policy has anything to avoid;
// at 4× round-robin keeps them about 47 % busy prefilling and busy almost all the time once
// decoding is counted, so requests queue behind long prompts and its TTFT tail doubles. Time
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
//	                 round_robin,random,power_of_two,least_load,cache_aware; load_based is accepted
//	                 for least_load)
//	-speed X         divide every arrival time by X (default 4)
//	-limit N         replay only the first N requests (default: all)
//	-seed N          random seed of every policy run (default 1)
//	-json            print the report as JSON instead of a table
//	-plot DIR        also write PNG charts to DIR: ttft_cdf.png, hit_rate.png, imbalance.png
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
	"os"
	"os/signal"
	"strings"
	"sync"
	"time"

	"github.com/schollz/progressbar/v3"
	"golang.org/x/term"

	"github.com/enginepick/enginepick/admission"
	"github.com/enginepick/enginepick/sim"
)

// Defaults of the flags: the documented load point (see the package comment).
const (
	defaultEngines = 16
	defaultSpeed   = 4.0
	defaultSeed    = 1
)

// errFleetFlags reports -engines and -pd given together.
var errFleetFlags = errors.New("replay: -engines and -pd are exclusive: give one fleet")

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	err := run(ctx, os.Args[1:], os.Stdout, os.Stderr, term.IsTerminal(int(os.Stderr.Fd())))
	switch {
	case errors.Is(err, flag.ErrHelp):
		os.Exit(0)
	case err != nil:
		fmt.Fprintln(os.Stderr, "replay:", err)
		os.Exit(1)
	}
}

// run parses args, replays and writes the report to stdout. Progress and timing go to stderr; the
// progress bar only when interactive is true.
func run(ctx context.Context, args []string, stdout, stderr io.Writer, interactive bool) error {
	fs := flag.NewFlagSet("replay", flag.ContinueOnError)
	fs.SetOutput(stderr)
	tracePath := fs.String("trace", "", "Mooncake JSONL or Azure CSV trace file, optionally gzipped (default: embedded Mooncake conversation trace)")
	engines := fs.Int("engines", defaultEngines, "number of plain engines")
	pd := fs.String("pd", "", "prefill/decode fleet P:D instead of plain engines")
	policies := fs.String("policies", strings.Join(sim.DefaultPolicyNames(), ","), "comma-separated policies to compare")
	speed := fs.Float64("speed", defaultSpeed, "time compression: arrival times are divided by this")
	limit := fs.Int("limit", 0, "replay only the first N requests (0: all)")
	seed := fs.Uint64("seed", defaultSeed, "random seed of every policy run")
	asJSON := fs.Bool("json", false, "print the report as JSON")
	plotDir := fs.String("plot", "", "directory to write PNG charts to")
	limitsJSON := fs.String("admission", "", `per-engine admission caps as JSON, e.g. '{"max_waiting_requests": 32}' (default: admit everything)`)
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("replay: unexpected arguments %q", fs.Args())
	}

	cfg := sim.Config{Speed: *speed, Limit: *limit, Seed: *seed, Fleet: sim.Fleet{Plain: *engines}}
	if *pd != "" {
		engSet := false
		fs.Visit(func(f *flag.Flag) { engSet = engSet || f.Name == "engines" })
		if engSet {
			return errFleetFlags
		}
		fleet, err := sim.ParsePD(*pd)
		if err != nil {
			return err
		}
		cfg.Fleet = fleet
	}
	cfg.Policies = splitList(*policies)
	if *limitsJSON != "" {
		var limits admission.Limits
		if err := json.Unmarshal([]byte(*limitsJSON), &limits); err != nil {
			return fmt.Errorf("-admission: %w", err)
		}
		cfg.Admission = limits
	}
	var err error
	if *tracePath == "" {
		cfg.Trace, err = sim.MooncakeConversation()
	} else {
		cfg.Trace, err = sim.ReadTraceFile(*tracePath)
	}
	if err != nil {
		return err
	}

	start := time.Now()
	prog := &progress{out: stderr, start: start, enabled: interactive}
	cfg.Progress = prog.update
	rep, err := sim.Replay(ctx, cfg)
	prog.finish()
	if err != nil {
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
		return rep.WriteJSON(stdout)
	}
	return rep.WriteTable(stdout)
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
