package loadsource

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/url"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/state"
)

// Defaults of Options.
const (
	// DefaultInterval is the time between two polls of one engine. It is well inside
	// loadmon.DefaultFreshness (5 s), so that one lost poll does not make an engine unknown.
	DefaultInterval = time.Second
	// DefaultTimeout bounds one poll: connection, request and body.
	DefaultTimeout = 500 * time.Millisecond
	// defaultMaxBodyBytes bounds a load page; vLLM's /metrics page with every histogram is a few
	// hundred KiB per DP rank.
	defaultMaxBodyBytes = 16 << 20
)

// Target is one engine's load endpoint: one page for every DP rank (URL), or one page per rank
// (RankURLs).
type Target struct {
	// Engine is the engine the page describes; its reports are recorded under this ID. Required.
	Engine state.EngineID
	// URL is the absolute http or https URL of the endpoint, for example
	// "http://10.0.0.7:8000/metrics" (see Format.Path). Required unless RankURLs is set, and empty
	// then.
	URL string
	// RankURLs, when set, are the engine's per-rank pages in rank order: the page of rank r is
	// served by the process serving only that rank (vLLM's external DP load balancing, one HTTP
	// port per rank). Each page must name exactly one rank, labelled 0 or the rank's global rank
	// RankStart + r, and is recorded as rank r. One poll fetches every page concurrently and records
	// them together; a page that fails leaves its rank out, and the poll returns its error joined
	// with a *MissingRanksError. Nil means the engine has one page, URL.
	RankURLs []string
	// Format is the page format. Required.
	Format Format
	// Ranks is the engine's DP rank count, as the host declared it with loadmon.Table.Expect. A page
	// that lacks a rank below it is recorded for the ranks it has and the poll returns a
	// *MissingRanksError; a page naming a rank at or above it records nothing. 0 means 1, or
	// len(RankURLs) when RankURLs is set (which must then be 0 or len(RankURLs)).
	Ranks int
	// RankStart is the global DP rank of the engine's rank 0, for an engine that serves a slice of a
	// larger DP group (a vLLM node owning global ranks 4..7 labels its series engine="4".."7"): the
	// pages name global ranks RankStart..RankStart+Ranks-1, recorded as ranks 0..Ranks-1. 0 means
	// the engine's ranks are the global ones; negative, or a last global rank at or above
	// loadmon.MaxRanks, is invalid.
	RankStart int
}

// ranks returns the target's DP rank count.
func (t *Target) ranks() int {
	if len(t.RankURLs) > 0 {
		return len(t.RankURLs)
	}
	return max(t.Ranks, 1)
}

// Options configures a Poller. The zero value is usable: DefaultInterval, DefaultTimeout, no
// jitter, 16 MiB pages, a plain http.Client, no logging.
type Options struct {
	// Client sends the polls. Nil means a new &http.Client{} (Timeout below still bounds each poll).
	Client *http.Client
	// Interval is the time between the end of one poll of an engine and the start of the next,
	// before jitter. Zero means DefaultInterval; negative is invalid.
	Interval time.Duration
	// Timeout bounds one poll. Zero means DefaultTimeout; negative or above Interval is invalid.
	Timeout time.Duration
	// Jitter is a fraction in [0, 1]: each wait is Interval plus a uniformly random extra of up to
	// Jitter × Interval, and each engine's first poll waits a uniformly random time up to Jitter ×
	// Interval, so that polls of many engines spread out. Zero means none.
	Jitter float64
	// MaxBodyBytes bounds a page; a longer page is a failed poll. Zero means 16 MiB;
	// negative is invalid.
	MaxBodyBytes int64
	// Rand returns uniform values in [0, 1) for jitter. Nil means math/rand/v2.Float64.
	Rand func() float64
	// Logger receives a debug entry per failed poll. Nil means zap.NewNop().
	Logger *zap.Logger
	// Observe, when set, is called after every poll, from the polling goroutine, with the engine
	// and the poll's outcome (nil on success). It must not block.
	Observe func(engine state.EngineID, err error)
}

// Errors of a poll, usable with errors.Is and errors.As. Every failed poll leaves the table as it
// was, except *MissingRanksError, which follows recording the ranks the page had.
var (
	// ErrStatus: the endpoint answered with a status other than 200.
	ErrStatus = errors.New("loadsource: load endpoint status not 200")
	// ErrBodyTooLarge: the page exceeded Options.MaxBodyBytes.
	ErrBodyTooLarge = errors.New("loadsource: load page too large")
)

// MissingRanksError reports that a page lacked some of the engine's expected DP ranks, or that some
// of its per-rank pages (Target.RankURLs) failed. The ranks present were recorded; the missing ones were not refreshed, so the engine's load becomes unknown
// once their last reports are stale (docs/design.md §6).
type MissingRanksError struct {
	// Engine is the polled engine.
	Engine state.EngineID
	// Missing lists the absent ranks, ascending.
	Missing []int
}

// Error implements error.
func (e *MissingRanksError) Error() string {
	return fmt.Sprintf("loadsource: engine %q load page lacks DP ranks %v", e.Engine, e.Missing)
}

// TargetStats counts one target's polls.
type TargetStats struct {
	// Engine is the target's engine.
	Engine state.EngineID
	// Polls counts every poll; Failures those that returned an error (missing ranks included).
	Polls    uint64
	Failures uint64
	// LastSuccess is when the last poll that recorded every rank ended; zero if none did.
	LastSuccess time.Time
	// LastError is the last failed poll's error text; empty if none failed. It may contain the
	// endpoint URL: log it, do not show it to API clients.
	LastError string
}

type targetState struct {
	Target
	polls, failures atomic.Uint64
	lastSuccess     atomic.Int64 // unix nanos
	lastErr         atomic.Pointer[string]
}

// Poller fetches engines' load pages and records them in a loadmon.Table. Build it with NewPoller
// and start it with Run; Poll runs one poll of one target for hosts that schedule polls
// themselves. All methods are safe for concurrent use.
type Poller struct {
	table    *loadmon.Table
	targets  []*targetState
	client   *http.Client
	interval time.Duration
	timeout  time.Duration
	jitter   float64
	maxBody  int64
	rand     func() float64
	log      *zap.Logger
	observe  func(state.EngineID, error)

	running atomic.Bool
}

// NewPoller validates the targets and options and returns a Poller that starts nothing until Run.
// A nil table, a target with an empty engine ID, a URL that is not absolute http(s), both URL and
// RankURLs or a rank count that disagrees with RankURLs, an invalid format, Ranks outside
// [0, loadmon.MaxRanks], global ranks beyond loadmon.MaxRanks, two targets for one engine, or an
// invalid option is an error wrapping state.ErrInvalidConfiguration.
func NewPoller(table *loadmon.Table, targets []Target, opts Options) (*Poller, error) {
	bad := func(format string, args ...any) (*Poller, error) {
		return nil, fmt.Errorf("loadsource: "+format+": %w", append(args, state.ErrInvalidConfiguration)...)
	}
	if table == nil {
		return bad("nil table")
	}
	p := &Poller{table: table, client: opts.Client, interval: opts.Interval, timeout: opts.Timeout,
		jitter: opts.Jitter, maxBody: opts.MaxBodyBytes, rand: opts.Rand, log: opts.Logger, observe: opts.Observe}
	if p.client == nil {
		p.client = &http.Client{}
	}
	if p.interval == 0 {
		p.interval = DefaultInterval
	}
	if p.timeout == 0 {
		p.timeout = min(DefaultTimeout, p.interval)
	}
	if p.maxBody == 0 {
		p.maxBody = defaultMaxBodyBytes
	}
	if p.rand == nil {
		p.rand = rand.Float64
	}
	if p.log == nil {
		p.log = zap.NewNop()
	}
	switch {
	case p.interval < 0:
		return bad("Interval %v is negative", p.interval)
	case p.timeout < 0 || p.timeout > p.interval:
		return bad("Timeout %v must be in (0, Interval %v]", p.timeout, p.interval)
	case !(p.jitter >= 0 && p.jitter <= 1):
		return bad("Jitter %v must be in [0, 1]", p.jitter)
	case p.maxBody < 0:
		return bad("MaxBodyBytes %d is negative", p.maxBody)
	}
	seen := make(map[state.EngineID]bool, len(targets))
	for i, t := range targets {
		if t.Engine == "" {
			return bad("target %d: empty engine ID", i)
		}
		if seen[t.Engine] {
			return bad("target %d: engine %q has two targets", i, t.Engine)
		}
		seen[t.Engine] = true
		urls := t.RankURLs
		switch {
		case len(urls) == 0:
			urls = []string{t.URL}
		case t.URL != "":
			return bad("target %q: both URL and RankURLs are set", t.Engine)
		case t.Ranks != 0 && t.Ranks != len(urls):
			return bad("target %q: Ranks %d but %d RankURLs", t.Engine, t.Ranks, len(urls))
		}
		for _, raw := range urls {
			u, err := url.Parse(raw)
			if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
				return bad("target %q: URL %q is not an absolute http(s) URL", t.Engine, raw)
			}
		}
		if !t.Format.Valid() {
			return bad("target %q: invalid format %v", t.Engine, t.Format)
		}
		if t.Ranks < 0 || t.Ranks > loadmon.MaxRanks || len(t.RankURLs) > loadmon.MaxRanks {
			return bad("target %q: Ranks %d outside [0, %d]", t.Engine, max(t.Ranks, len(t.RankURLs)), loadmon.MaxRanks)
		}
		if t.RankStart < 0 || t.RankStart+t.ranks() > loadmon.MaxRanks {
			return bad("target %q: global ranks %d..%d outside [0, %d)", t.Engine, t.RankStart, t.RankStart+t.ranks()-1, loadmon.MaxRanks)
		}
		t.RankURLs = slices.Clone(t.RankURLs)
		p.targets = append(p.targets, &targetState{Target: t})
	}
	return p, nil
}

// Run polls every target until ctx is done: one goroutine per target, each waiting its jittered
// interval between the end of one poll and the start of the next. It returns nil once ctx is done
// and every goroutine has exited. Running a Poller twice at once is an error wrapping
// state.ErrInvalidConfiguration.
func (p *Poller) Run(ctx context.Context) error {
	if !p.running.CompareAndSwap(false, true) {
		return fmt.Errorf("loadsource: poller already running: %w", state.ErrInvalidConfiguration)
	}
	defer p.running.Store(false)
	var wg sync.WaitGroup
	for _, t := range p.targets {
		wg.Go(func() { p.loop(ctx, t) })
	}
	wg.Wait()
	return nil
}

func (p *Poller) loop(ctx context.Context, t *targetState) {
	timer := time.NewTimer(p.wait(true))
	defer timer.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-timer.C:
		}
		_ = p.poll(ctx, t)
		timer.Reset(p.wait(false))
	}
}

// wait is the delay before a poll: a random fraction of the jitter span for the first, the
// interval plus one for the others.
func (p *Poller) wait(first bool) time.Duration {
	extra := time.Duration(p.jitter * p.rand() * float64(p.interval))
	if first {
		return extra
	}
	return p.interval + extra
}

// Poll runs one poll of the engine's target now: fetch within the timeout, parse, and record every
// rank the page names as one loadmon.Table.ReportBatch. Errors: an error wrapping
// state.ErrInvalidConfiguration for an engine without a target; a transport error or
// context.DeadlineExceeded (the endpoint hung); ErrStatus; ErrBodyTooLarge; a *PageError
// (ErrMalformed); the table's rejection (loadmon.ErrRankOutOfRange for a rank outside the target's
// ranks); in all these cases nothing is recorded. *MissingRanksError follows recording the ranks
// present; with per-rank pages, it is joined with each failed page's error.
func (p *Poller) Poll(ctx context.Context, engine state.EngineID) error {
	for _, t := range p.targets {
		if t.Engine == engine {
			return p.poll(ctx, t)
		}
	}
	return fmt.Errorf("loadsource: poll: engine %q has no target: %w", engine, state.ErrInvalidConfiguration)
}

func (p *Poller) poll(ctx context.Context, t *targetState) error {
	err := p.fetchAndRecord(ctx, t)
	t.polls.Add(1)
	if err != nil {
		t.failures.Add(1)
		msg := err.Error()
		t.lastErr.Store(&msg)
		if ce := p.log.Check(zap.DebugLevel, "load poll failed"); ce != nil {
			ce.Write(zap.String("engine", string(t.Engine)), zap.Stringer("format", t.Format), zap.Error(err))
		}
	} else {
		t.lastSuccess.Store(time.Now().UnixNano())
	}
	if p.observe != nil {
		p.observe(t.Engine, err)
	}
	return err
}

func (p *Poller) fetchAndRecord(ctx context.Context, t *targetState) error {
	if len(t.RankURLs) > 0 {
		return p.fetchRanks(ctx, t)
	}
	body, err := p.fetch(ctx, t.Engine, t.URL)
	if err != nil {
		return err
	}
	page, err := Parse(t.Format, t.Engine, body)
	if err != nil {
		return err
	}
	ranks := t.ranks()
	for i := range page.Reports {
		r := &page.Reports[i]
		if r.DPRank < t.RankStart || r.DPRank >= t.RankStart+ranks {
			return fmt.Errorf("%w: engine %q page names rank %d, expected ranks %d..%d", loadmon.ErrRankOutOfRange, t.Engine, r.DPRank, t.RankStart, t.RankStart+ranks-1)
		}
		r.DPRank -= t.RankStart
	}
	if err := p.table.ReportBatch(page.Reports); err != nil {
		return fmt.Errorf("loadsource: engine %q: %w", t.Engine, err)
	}
	if len(page.Reports) < ranks {
		var missing []int
		next := 0
		for _, r := range page.Reports {
			for ; next < r.DPRank; next++ {
				missing = append(missing, next)
			}
			next = r.DPRank + 1
		}
		for ; next < ranks; next++ {
			missing = append(missing, next)
		}
		return &MissingRanksError{Engine: t.Engine, Missing: missing}
	}
	return nil
}

// fetchRanks polls a target with one page per rank: every page at once, then one ReportBatch of
// the ranks whose page was good.
func (p *Poller) fetchRanks(ctx context.Context, t *targetState) error {
	reports := make([]loadmon.Report, len(t.RankURLs))
	errs := make([]error, len(t.RankURLs))
	var wg sync.WaitGroup
	for r, u := range t.RankURLs {
		wg.Go(func() { reports[r], errs[r] = p.fetchRank(ctx, t, r, u) })
	}
	wg.Wait()
	var good []loadmon.Report
	var missing []int
	for r := range reports {
		if errs[r] != nil {
			errs[r] = fmt.Errorf("rank %d: %w", r, errs[r])
			missing = append(missing, r)
			continue
		}
		good = append(good, reports[r])
	}
	if err := p.table.ReportBatch(good); err != nil {
		return fmt.Errorf("loadsource: engine %q: %w", t.Engine, err)
	}
	if len(missing) == 0 {
		return nil
	}
	return errors.Join(append(errs, &MissingRanksError{Engine: t.Engine, Missing: missing})...)
}

// fetchRank fetches and parses rank r's page, which must name that one rank (0 or its global
// rank), and returns its report as rank r.
func (p *Poller) fetchRank(ctx context.Context, t *targetState, r int, u string) (loadmon.Report, error) {
	body, err := p.fetch(ctx, t.Engine, u)
	if err != nil {
		return loadmon.Report{}, err
	}
	page, err := Parse(t.Format, t.Engine, body)
	if err != nil {
		return loadmon.Report{}, err
	}
	global := t.RankStart + r
	if len(page.Reports) != 1 || (page.Reports[0].DPRank != 0 && page.Reports[0].DPRank != global) {
		named := make([]int, len(page.Reports))
		for i, rep := range page.Reports {
			named[i] = rep.DPRank
		}
		return loadmon.Report{}, fmt.Errorf("%w: engine %q rank %d's page names ranks %v, want one: 0 or %d", loadmon.ErrRankOutOfRange, t.Engine, r, named, global)
	}
	rep := page.Reports[0]
	rep.DPRank = r
	return rep, nil
}

func (p *Poller) fetch(ctx context.Context, engine state.EngineID, u string) ([]byte, error) {
	ctx, cancel := context.WithTimeout(ctx, p.timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return nil, fmt.Errorf("loadsource: engine %q: %w", engine, err)
	}
	resp, err := p.client.Do(req)
	if err != nil {
		return nil, fmt.Errorf("loadsource: engine %q: %w", engine, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 4096))
		return nil, fmt.Errorf("%w: engine %q answered %d", ErrStatus, engine, resp.StatusCode)
	}
	body, err := io.ReadAll(io.LimitReader(resp.Body, p.maxBody+1))
	if err != nil {
		return nil, fmt.Errorf("loadsource: engine %q: reading page: %w", engine, err)
	}
	if int64(len(body)) > p.maxBody {
		return nil, fmt.Errorf("%w: engine %q page above %d bytes", ErrBodyTooLarge, engine, p.maxBody)
	}
	return body, nil
}

// Stats returns every target's counters, in the order the targets were given.
func (p *Poller) Stats() []TargetStats {
	out := make([]TargetStats, len(p.targets))
	for i, t := range p.targets {
		out[i] = TargetStats{Engine: t.Engine, Polls: t.polls.Load(), Failures: t.failures.Load()}
		if ns := t.lastSuccess.Load(); ns != 0 {
			out[i].LastSuccess = time.Unix(0, ns)
		}
		if e := t.lastErr.Load(); e != nil {
			out[i].LastError = *e
		}
	}
	return out
}
