package sim

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/enginepick/enginepick/state"
)

// Defaults of SweepConfig.
const (
	// DefaultSweepSLO is the TTFT p99 target of a sweep: 10 s.
	DefaultSweepSLO = 10 * time.Second
	// DefaultSweepTolerance is the relative width of the final bracket: the highest passing
	// speed is known to within 5 %.
	DefaultSweepTolerance = 0.05
	// DefaultSweepMinSpeed and DefaultSweepMaxSpeed bound the speeds a sweep tries: below the
	// minimum a policy is reported as meeting the target at no speed tried, above the maximum as
	// meeting it at the maximum.
	DefaultSweepMinSpeed = 1.0 / 64
	DefaultSweepMaxSpeed = 1024.0
)

// SweepConfig is a capacity sweep: for every policy of Config.Policies, the highest speed (time
// compression of the trace) at which the policy keeps TTFT p99 at or under SLO.
type SweepConfig struct {
	// Config is the replay every probe runs, with one policy and its own speed: Config.Speed is
	// where each policy's search starts (0 means 1); Config.Policies and Factories name the
	// policies as for Replay. Progress is ignored. Every other field applies to every probe.
	Config
	// SLO is the TTFT p99 target. 0 means DefaultSweepSLO; negative is invalid.
	SLO time.Duration
	// Tolerance is the relative width at which the search stops: it returns a passing speed s
	// and a failing speed at most s·(1 + Tolerance). 0 means DefaultSweepTolerance; it must be
	// finite and > 0.
	Tolerance float64
	// MinSpeed and MaxSpeed bound the search. 0 means DefaultSweepMinSpeed and
	// DefaultSweepMaxSpeed; they must be finite, positive and ordered.
	MinSpeed, MaxSpeed float64
}

// SweepResult is one policy's sweep.
type SweepResult struct {
	// Policy is the policy name.
	Policy string `json:"policy"`
	// Speed is the highest speed found at which the policy met the target: TTFT p99 at or under
	// SLO and no request rejected by admission. 0 when it failed even at MinSpeed; MaxSpeed when
	// it met it there (Capped).
	Speed float64 `json:"speed"`
	// FailSpeed is the lowest speed found at which it missed the target, at most
	// Speed·(1 + Tolerance); 0 when Capped.
	FailSpeed float64 `json:"fail_speed"`
	// Capped reports that the policy met the target at MaxSpeed, so its capacity is at least that.
	Capped bool `json:"capped,omitempty"`
	// TTFTP99 is the TTFT p99 at Speed, in seconds (0 when Speed is 0).
	TTFTP99 float64 `json:"ttft_p99_s"`
	// HitRate is the prefix hit rate at Speed.
	HitRate float64 `json:"hit_rate"`
	// Probes is the number of replays the search ran.
	Probes int `json:"probes"`
}

// SweepReport is the outcome of a Sweep, one result per policy in Config.Policies order.
type SweepReport struct {
	// Trace, Requests, Fleet, Seed, SpreadArrivals, SystemPromptTokens, Routers and Reports
	// describe the replays, as in Report.
	Trace              string      `json:"trace"`
	Requests           int         `json:"requests"`
	Fleet              Fleet       `json:"fleet"`
	Seed               uint64      `json:"seed"`
	SpreadArrivals     bool        `json:"spread_arrivals,omitempty"`
	SystemPromptTokens int         `json:"system_prompt_tokens,omitempty"`
	Routers            int         `json:"routers"`
	Reports            LoadReports `json:"reports,omitempty"`
	Model              EngineModel `json:"model"`
	// SLO is the TTFT p99 target, in seconds; Tolerance the relative bracket width.
	SLO       float64 `json:"slo_s"`
	Tolerance float64 `json:"tolerance"`
	// Results has one entry per policy.
	Results []SweepResult `json:"results"`
	// Ceiling is the sustained throughput ceiling of the swept requests on the fleet
	// (ComputeCeiling): no router sustains a higher speed, though a finite replay can pass it by
	// the backlog it ends with.
	Ceiling *Ceiling `json:"ceiling"`
}

// Sweep finds, for every policy, the highest speed at which TTFT p99 stays at or under cfg.SLO
// with no request rejected by admission. Each policy's search is independent and deterministic:
// from Config.Speed it doubles (or halves) the speed until the outcome changes, within
// [MinSpeed, MaxSpeed], then bisects geometrically until the failing speed is within Tolerance of
// the passing one. Every probe is a full Replay of the trace (cut to Config.Limit) with that one
// policy, so a sweep costs about 8 replays per policy: use Config.Limit to keep it affordable.
// Policies run in parallel up to Config.Parallelism; each probe is single-threaded.
//
// Errors: those of Replay for the configuration (before any probe runs), an error wrapping
// state.ErrInvalidConfiguration for an invalid SLO, Tolerance or speed bound, ctx's error, or a
// probe's error. No partial report is returned.
func Sweep(ctx context.Context, cfg SweepConfig) (*SweepReport, error) {
	if err := cfg.fill(); err != nil {
		return nil, err
	}
	base := cfg.Config
	base.Progress = nil
	rc, err := base.resolve() // validate once, before any probe
	if err != nil {
		return nil, err
	}
	ceiling, err := ComputeCeiling(base)
	if err != nil {
		return nil, err
	}
	results := make([]SweepResult, len(rc.names))
	errs := make([]error, len(rc.names))
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	sem := make(chan struct{}, rc.Parallelism)
	var wg sync.WaitGroup
	for i, name := range rc.names {
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			res, err := sweepPolicy(ctx, &cfg, base, name, rc.Speed)
			if err != nil {
				errs[i] = fmt.Errorf("sim: sweep of %s: %w", name, err)
				cancel()
				return
			}
			results[i] = res
		})
	}
	wg.Wait()
	for _, e := range errs {
		if e != nil && !errors.Is(e, context.Canceled) {
			return nil, e
		}
	}
	for _, e := range errs {
		if e != nil {
			return nil, e
		}
	}
	return &SweepReport{Trace: rc.Trace.Name, Requests: len(rc.requests), Fleet: rc.Fleet, Seed: rc.Seed,
		SpreadArrivals: rc.SpreadArrivals, SystemPromptTokens: rc.SystemPromptTokens, Routers: rc.Routers, Reports: basicOnly(rc.Reports), Model: rc.Model,
		SLO: cfg.SLO.Seconds(), Tolerance: cfg.Tolerance, Results: results, Ceiling: ceiling}, nil
}

func (c *SweepConfig) fill() error {
	bad := func(field string, v any, rule string) error {
		return fmt.Errorf("sim: SweepConfig.%s = %v: %s: %w", field, v, rule, state.ErrInvalidConfiguration)
	}
	if c.SLO == 0 {
		c.SLO = DefaultSweepSLO
	}
	if c.Tolerance == 0 {
		c.Tolerance = DefaultSweepTolerance
	}
	if c.MinSpeed == 0 {
		c.MinSpeed = DefaultSweepMinSpeed
	}
	if c.MaxSpeed == 0 {
		c.MaxSpeed = DefaultSweepMaxSpeed
	}
	finite := func(v float64) bool { return v > 0 && !math.IsInf(v, 1) }
	switch {
	case c.SLO < 0:
		return bad("SLO", c.SLO, "must be > 0")
	case !finite(c.Tolerance):
		return bad("Tolerance", c.Tolerance, "must be finite and > 0")
	case !finite(c.MinSpeed):
		return bad("MinSpeed", c.MinSpeed, "must be finite and > 0")
	case !finite(c.MaxSpeed) || c.MaxSpeed < c.MinSpeed:
		return bad("MaxSpeed", c.MaxSpeed, fmt.Sprintf("must be finite and >= MinSpeed (%g)", c.MinSpeed))
	}
	return nil
}

// sweepPolicy searches one policy's capacity from speed start, one Replay per probe.
func sweepPolicy(ctx context.Context, cfg *SweepConfig, base Config, name string, start float64) (SweepResult, error) {
	probe := func(speed float64) (bool, PolicyResult, error) {
		c := base
		c.Policies = []string{name}
		c.Speed = speed
		c.Parallelism = 1
		rep, err := Replay(ctx, c)
		if err != nil {
			return false, PolicyResult{}, err
		}
		r := rep.Results[0]
		return r.TTFT.P99 <= cfg.SLO.Seconds() && r.Rejected == 0, r, nil
	}
	res, err := search(probe, start, cfg.MinSpeed, cfg.MaxSpeed, cfg.Tolerance)
	res.Policy = name
	return res, err
}

// search finds the highest passing speed of probe, which must pass at every speed below one that
// passes (the sweep assumes a policy that meets the target at some speed meets it at any lower
// one). It starts at start clamped to [lo, hi], doubles or halves until the outcome changes, then
// bisects geometrically until the failing speed is within tol of the passing one.
func search(probe func(float64) (bool, PolicyResult, error), start, minSpeed, maxSpeed, tol float64) (SweepResult, error) {
	var res SweepResult
	run := func(speed float64) (bool, PolicyResult, error) {
		res.Probes++
		return probe(speed)
	}
	speed := min(max(start, minSpeed), maxSpeed)
	ok, r, err := run(speed)
	if err != nil {
		return res, err
	}
	var lo, hi float64 // passing and failing speeds; 0 while unknown
	var loRes PolicyResult
	if ok {
		lo, loRes = speed, r
		for hi == 0 {
			if lo >= maxSpeed {
				res.Speed, res.Capped, res.TTFTP99, res.HitRate = lo, true, loRes.TTFT.P99, loRes.HitRate
				return res, nil
			}
			next := min(2*lo, maxSpeed)
			if ok, r, err = run(next); err != nil {
				return res, err
			}
			if ok {
				lo, loRes = next, r
			} else {
				hi = next
			}
		}
	} else {
		hi = speed
		for lo == 0 {
			if hi <= minSpeed {
				res.FailSpeed = hi
				return res, nil
			}
			next := max(hi/2, minSpeed)
			if ok, r, err = run(next); err != nil {
				return res, err
			}
			if ok {
				lo, loRes = next, r
			} else {
				hi = next
			}
		}
	}
	for hi > lo*(1+tol) {
		mid := math.Sqrt(lo * hi)
		if ok, r, err = run(mid); err != nil {
			return res, err
		}
		if ok {
			lo, loRes = mid, r
		} else {
			hi = mid
		}
	}
	res.Speed, res.FailSpeed, res.TTFTP99, res.HitRate = lo, hi, loRes.TTFT.P99, loRes.HitRate
	return res, nil
}

// Result returns the result of the named policy.
func (rep *SweepReport) Result(policy string) (SweepResult, bool) {
	for _, r := range rep.Results {
		if r.Policy == policy {
			return r, true
		}
	}
	return SweepResult{}, false
}

// WriteJSON writes the report as indented JSON.
func (rep *SweepReport) WriteJSON(w io.Writer) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(rep)
}

// WriteTable writes the report as a heading and one row per policy: the highest speed meeting the
// target, that speed relative to power_of_two's (or to the first policy's when power_of_two was
// not swept), TTFT p99 and hit rate there, and the replays run; then the sustained throughput
// ceiling, and a note naming the policies that carried more than it (a trace prefix too short
// for the ceiling to bind).
func (rep *SweepReport) WriteTable(w io.Writer) error {
	bw := bufio.NewWriter(w)
	name := rep.Trace
	if name == "" {
		name = "(unnamed trace)"
	}
	fmt.Fprintf(bw, "capacity sweep: trace %s, %d requests, fleet %s, seed %d", name, rep.Requests, rep.Fleet, rep.Seed)
	if rep.SpreadArrivals {
		fmt.Fprint(bw, ", arrivals spread within each second")
	}
	if rep.SystemPromptTokens > 0 {
		fmt.Fprintf(bw, ", %d-token system prompt", rep.SystemPromptTokens)
	}
	if rep.Routers > 1 {
		fmt.Fprintf(bw, ", %d router replicas", rep.Routers)
	}
	if rep.Reports == ReportsBasic {
		fmt.Fprint(bw, ", basic load reports (running and waiting only)")
	}
	fmt.Fprintf(bw, "\nhighest speed with TTFT p99 <= %g s and no admission rejection, to within %g %%\n\n", rep.SLO, 100*rep.Tolerance)
	ref, ok := rep.Result(NamePowerOfTwo)
	if !ok && len(rep.Results) > 0 {
		ref = rep.Results[0]
	}
	tw := tabwriter.NewWriter(bw, 0, 0, 2, ' ', 0)
	fmt.Fprintf(tw, "policy\tmax speed\t× %s\tTTFT p99 there\thit rate there\treplays\n", ref.Policy)
	for _, r := range rep.Results {
		speed := fmt.Sprintf("%.3g", r.Speed)
		switch {
		case r.Capped:
			speed = fmt.Sprintf(">= %.3g", r.Speed)
		case r.Speed == 0:
			speed = fmt.Sprintf("< %.3g", r.FailSpeed)
		}
		ratio := "n/a"
		if ref.Speed > 0 && r.Speed > 0 {
			ratio = fmt.Sprintf("%.2f", r.Speed/ref.Speed)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%.2f s\t%.1f %%\t%d\n", r.Policy, speed, ratio, r.TTFTP99, 100*r.HitRate, r.Probes)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if c := rep.Ceiling; c != nil && !math.IsInf(c.Speed, 1) {
		fmt.Fprintf(bw, "\nsustained throughput ceiling of any routing: speed %.3g", c.Speed)
		if ref.Speed > 0 {
			fmt.Fprintf(bw, " (%.2f × %s)", c.Speed/ref.Speed, ref.Policy)
		}
		fmt.Fprintf(bw, ", with one never-evicted cache shared by all engines (prefill %.0f s instead of %.0f s) and every engine busy all the time (decode %.0f s)\n",
			c.PrefillInfiniteCache, c.PrefillNoCache, c.DecodeKV+c.DecodeBase)
		var above []string
		for _, r := range rep.Results {
			if r.Speed > c.Speed {
				above = append(above, r.Policy)
			}
		}
		if len(above) > 0 {
			fmt.Fprintf(bw, "note: %s carried more than this sustained ceiling: on %d requests the fleet can finish the work left when the last one arrives within the TTFT target, so the ceiling binds only on a trace long enough to reach a steady state (raise -limit)\n",
				strings.Join(above, ", "), rep.Requests)
		}
	}
	return bw.Flush()
}
