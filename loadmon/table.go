package loadmon

import (
	"fmt"
	"math"
	"math/bits"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/enginepick/enginepick/internal/lora"
	"github.com/enginepick/enginepick/state"
)

// DefaultFreshness is how long an engine report stays usable: docs/design.md §6
// (5 s, as the experimental SGLang router's `DEFAULT_FRESHNESS`).
const DefaultFreshness = 5 * time.Second

// MaxRanks bounds the DP ranks one engine may declare. Larger values are rejected as invalid
// configuration so that a corrupt discovery record cannot allocate without bound.
const MaxRanks = 1024

// Errors returned by Table.Report and Table.Expect. They wrap state.ErrInvalidSignal (a bad
// report) or state.ErrInvalidConfiguration (a bad expectation) so callers may test either level.
var (
	// ErrRankOutOfRange: a report names a DP rank at or beyond the engine's expected rank count.
	ErrRankOutOfRange = fmt.Errorf("loadmon: DP rank out of range: %w", state.ErrInvalidSignal)
	// ErrInvalidReport: a report is internally inconsistent (empty engine ID, used KV tokens above
	// capacity, a monotonic counter that went backwards is NOT this error: it only resets the rate).
	ErrInvalidReport = fmt.Errorf("loadmon: invalid report: %w", state.ErrInvalidSignal)
)

// Report is one DP rank's load sample, as an engine publishes it (SGLang `LoadStat`,
// docs/design.md §6 and §13). Counts are gauges: the last report of a rank replaces the previous
// one. The Table stamps the report with its own clock on arrival.
type Report struct {
	// Engine is the reporting engine. Required.
	Engine state.EngineID
	// DPRank is the data-parallel rank (0-based). Engines without data parallelism report rank 0.
	DPRank int
	// RunningRequests and WaitingRequests are the engine's running batch and waiting queue, in
	// requests.
	RunningRequests uint64
	WaitingRequests uint64
	// UsedKVTokens is the KV cache in use, in tokens; KVCapacityTokens is the rank's total KV
	// capacity in tokens (SGLang max_total_num_tokens). Zero capacity means unknown capacity.
	UsedKVTokens     uint64
	KVCapacityTokens uint64
	// Native holds the optional LoadStat v3 extension. Nil means an older publisher: the report is
	// fresh for admission of running/waiting, but supplies no native pressure.
	Native *NativeLoad
	// LoRA is the rank's LoRA adapter residency (vLLM's vllm:lora_requests_info). Nil means the
	// engine does not report it: its residency is unknown, which the adapter rules treat as
	// neutral (docs/design.md §18). The table keeps its own copy.
	LoRA *LoRALoad
}

// LoRALoad is the LoRA adapters an engine rank reports, after vLLM's vllm:lora_requests_info
// gauge (labels running_lora_adapters, waiting_lora_adapters, max_lora; vllm-project/vllm
// vllm/v1/metrics/loggers.py). Like the rest of a report, it is current while the report is
// fresh.
type LoRALoad struct {
	// MaxAdapters is the adapters the rank can hold in one batch (vLLM max_loras). Zero means
	// unknown; negative is an invalid report.
	MaxAdapters int
	// Running and Waiting name the adapters of the rank's running and waiting requests, by the
	// name requests use (vLLM lora_name); empty names are an invalid report. Nil means none.
	Running []string
	Waiting []string
}

// NativeLoad is the optional extension of a load report (LoadStat v3, docs/design.md
// §13). It is all-or-nothing: a publisher sends every field or none.
type NativeLoad struct {
	// WaitingUncachedTokens is the prompt tokens of waiting requests that miss the prefix cache.
	WaitingUncachedTokens uint64
	// MaxRunningRequests is the rank's running-batch cap in requests. Zero means unknown, which
	// makes the native data unusable for pressure comparison.
	MaxRunningRequests uint64
	// PrefillUncachedTokensTotal is a monotonic counter of uncached prompt tokens prefilled since
	// the engine started.
	PrefillUncachedTokensTotal uint64
	// PrefillBusyTime is a monotonic counter of time the rank spent prefilling since it started.
	PrefillBusyTime time.Duration
}

// EngineLoad is an engine's load summed over all its expected DP ranks, as a Snapshot presents it.
// It exists only when every expected rank has reported and is fresh. EngineLoad values a Snapshot
// returns are shared and immutable: read them, never modify them.
type EngineLoad struct {
	// Engine is the engine this load describes.
	Engine state.EngineID
	// ReportedAt is the arrival time of the oldest rank's report: dispatches after it are not
	// reflected in the counts (docs/design.md §8).
	ReportedAt time.Time
	// Ranks is the number of DP ranks summed.
	Ranks int
	// Sums over ranks, saturating at math.MaxUint64. Units as in Report.
	RunningRequests  uint64
	WaitingRequests  uint64
	UsedKVTokens     uint64
	KVCapacityTokens uint64
	// Native reports whether every rank sent the native extension with non-zero KV capacity and
	// non-zero MaxRunningRequests; only then are the fields below meaningful and the engine
	// comparable on reported pressure (docs/design.md §6).
	Native                bool
	WaitingUncachedTokens uint64
	MaxRunningRequests    uint64
	// RunningSlots is how many requests the engine runs at once, summed over its ranks, when
	// every rank shows it (else 0): a native rank's MaxRunningRequests; a rank without it shows
	// its running count as its slots, taken and queued for, from a report with at least as many
	// waiting requests as its two or more running ones until a report has none waiting or
	// another running count (docs/design.md §6, "Running slots"). Known whether or not Native.
	RunningSlots uint64
	// PrefillTokensPerSecond is the summed prefill throughput of the ranks, derived from two
	// successive native samples of each rank; valid only when HasPrefillRate.
	PrefillTokensPerSecond float64
	HasPrefillRate         bool
	// EstimatedPrefillQueue is WaitingUncachedTokens ÷ PrefillTokensPerSecond; valid only when
	// HasPrefillRate (every rank has a rate).
	EstimatedPrefillQueue time.Duration
	// LoRA is the engine's LoRA adapter residency when every rank reports one (else nil:
	// unknown): the adapters running, and waiting, on any rank (sorted, distinct), and the
	// fewest adapter slots of a rank (0 when a rank's are unknown). The adapter rules judge the
	// engine by it (docs/design.md §18).
	LoRA *LoRALoad
	// RankLoads holds, for an engine with several DP ranks, each rank's own load (index = rank),
	// as if the rank were an engine of one rank: its ReportedAt is that rank's arrival time, its
	// Native and prefill rate its own. Nil when the engine has one rank. The queue gate and the
	// pressure comparisons read a rank's own figures through Observation.Figures
	// (docs/design.md §6, "Reports per DP rank").
	RankLoads []*EngineLoad
}

// LeastRankWaitingRequests returns the fewest waiting requests of any one DP rank: the engine's
// waiting requests when it has one rank. The queue gate asks it whether an engine has a rank a
// request could be sent to without queueing (docs/design.md §9.3): ranks queue separately, so
// their sum overstates the wait of the least queued one.
func (l *EngineLoad) LeastRankWaitingRequests() uint64 {
	if len(l.RankLoads) == 0 {
		return l.WaitingRequests
	}
	least := l.RankLoads[0].WaitingRequests
	for _, r := range l.RankLoads[1:] {
		least = min(least, r.WaitingRequests)
	}
	return least
}

// rank returns rank's own load, or false when the engine has one rank (the engine's load is the
// rank's) or rank is out of range.
func (l *EngineLoad) rank(rank int) (*EngineLoad, bool) {
	if rank < 0 || rank >= len(l.RankLoads) {
		return nil, false
	}
	return l.RankLoads[rank], true
}

// KVUsageFraction returns UsedKVTokens ÷ KVCapacityTokens, or 0 and false when capacity is unknown.
func (l *EngineLoad) KVUsageFraction() (float64, bool) {
	if l.KVCapacityTokens == 0 {
		return 0, false
	}
	return float64(l.UsedKVTokens) / float64(l.KVCapacityTokens), true
}

// rankSample is what the table keeps per rank: the latest report, its arrival time and the rate
// derived from the previous native sample.
type rankSample struct {
	set     bool
	report  Report
	native  NativeLoad
	at      time.Time
	rate    float64 // tokens per second, 0 = unknown
	hasRate bool
	// slots is the running slots the rank's reports show (0: none); EngineLoad.RunningSlots.
	slots uint64
}

type engineEntry struct {
	ranks []rankSample
}

// Option configures a Table.
type Option func(*Table)

// WithClock sets the clock used to stamp reports and judge freshness. Nil keeps time.Now.
func WithClock(now func() time.Time) Option {
	return func(t *Table) {
		if now != nil {
			t.now = now
		}
	}
}

// WithFreshness sets how long a report stays usable. Zero or negative keeps DefaultFreshness.
func WithFreshness(d time.Duration) Option {
	return func(t *Table) {
		if d > 0 {
			t.freshness = d
		}
	}
}

// Table is the engine-reported load table, keyed by (engine, DP rank). Reports are gauges stamped
// on arrival; an engine's load is published only when every expected rank has reported.
//
// Writes (Report, Expect, Forget) are serialized by a mutex and publish a new immutable view;
// Snapshot is lock-free and allocation-free. All methods are safe for concurrent use.
type Table struct {
	now       func() time.Time
	freshness time.Duration

	mu      sync.Mutex
	entries map[state.EngineID]*engineEntry
	view    atomic.Pointer[tableView]
	version uint64
	// subs is the OnChange callbacks; nil until the first one (replaced as a whole under mu).
	subs atomic.Pointer[[]*subscription]
}

// subscription is one OnChange callback; its pointer identifies it for removal.
type subscription struct{ fn func(state.EngineID) }

type tableView struct {
	version uint64
	loads   map[state.EngineID]*EngineLoad
}

// NewTable returns an empty table with DefaultFreshness and time.Now unless options say otherwise.
func NewTable(opts ...Option) *Table {
	t := &Table{now: time.Now, freshness: DefaultFreshness, entries: map[state.EngineID]*engineEntry{}}
	for _, o := range opts {
		o(t)
	}
	t.view.Store(&tableView{loads: map[state.EngineID]*EngineLoad{}})
	return t
}

// Freshness returns how long a report stays usable.
func (t *Table) Freshness() time.Duration { return t.freshness }

// Expect declares how many DP ranks the engine has (from discovery). Until every rank in
// [0, ranks) has reported, the engine's load is unknown. An engine never declared has one rank.
// Changing the count keeps the samples of ranks that remain in range. ranks < 1 or > MaxRanks, or
// an empty engine ID, is an error wrapping state.ErrInvalidConfiguration.
func (t *Table) Expect(engine state.EngineID, ranks int) error {
	if engine == "" {
		return fmt.Errorf("loadmon: expect: empty engine ID: %w", state.ErrInvalidConfiguration)
	}
	if ranks < 1 || ranks > MaxRanks {
		return fmt.Errorf("loadmon: expect %q: ranks %d, want 1..%d: %w", engine, ranks, MaxRanks, state.ErrInvalidConfiguration)
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	e := t.entries[engine]
	if e == nil {
		e = &engineEntry{}
		t.entries[engine] = e
	}
	if len(e.ranks) == ranks {
		return nil
	}
	kept := make([]rankSample, ranks)
	copy(kept, e.ranks)
	e.ranks = kept
	t.recompute(engine, e)
	return nil
}

// Report records one rank's sample, stamped with the table's clock. A report with an empty engine
// ID or used KV tokens above a known capacity wraps ErrInvalidReport; a rank outside the expected
// range wraps ErrRankOutOfRange. On error the table is unchanged.
//
// The prefill rate of a rank is derived from this native sample and the previous one when both
// monotonic counters strictly increased (docs/design.md §6); otherwise the rank has no
// rate until the next such pair.
func (t *Table) Report(r Report) error {
	if err := checkReport(&r); err != nil {
		return err
	}
	now := t.now()
	t.mu.Lock()
	if err := t.checkRankLocked(&r); err != nil {
		t.mu.Unlock()
		return err
	}
	e := t.applyLocked(&r, now)
	t.recompute(r.Engine, e)
	t.mu.Unlock()
	t.notify(r.Engine)
	return nil
}

// ReportBatch records several samples at once, all stamped with one clock reading: one poll of an
// engine's load endpoint, for example, which reports every DP rank together. It is all or
// nothing: if any report is invalid (the errors of Report), or two reports name the same engine
// and rank (ErrInvalidReport), none is recorded and the table is unchanged. Each touched engine's
// load is published once. An empty batch does nothing.
func (t *Table) ReportBatch(reports []Report) error {
	for i := range reports {
		if err := checkReport(&reports[i]); err != nil {
			return err
		}
		for j := range i {
			if reports[j].Engine == reports[i].Engine && reports[j].DPRank == reports[i].DPRank {
				return fmt.Errorf("%w: engine %q rank %d reported twice in one batch",
					ErrInvalidReport, reports[i].Engine, reports[i].DPRank)
			}
		}
	}
	if len(reports) == 0 {
		return nil
	}
	now := t.now()
	t.mu.Lock()
	for i := range reports {
		if err := t.checkRankLocked(&reports[i]); err != nil {
			t.mu.Unlock()
			return err
		}
	}
	for i := range reports {
		t.applyLocked(&reports[i], now)
	}
	for i := range reports {
		if firstOfEngine(reports, i) {
			t.recompute(reports[i].Engine, t.entries[reports[i].Engine])
		}
	}
	t.mu.Unlock()
	if t.subs.Load() != nil {
		for i := range reports {
			if firstOfEngine(reports, i) {
				t.notify(reports[i].Engine)
			}
		}
	}
	return nil
}

// firstOfEngine reports whether reports[i] is the first report of its engine in reports.
func firstOfEngine(reports []Report, i int) bool {
	for j := range i {
		if reports[j].Engine == reports[i].Engine {
			return false
		}
	}
	return true
}

// OnChange registers fn to be called with the engine's ID after every change to an engine's
// reports: once per engine a Report, ReportBatch or Forget changed, after the change is visible to
// Snapshot, on the caller's goroutine and outside the table's lock. fn must be quick and must not
// block (a Router with flow control wakes its waiting requests with it, docs/design.md §17); it
// may call the table. The returned function removes fn; calling it again does nothing. Without
// callbacks, reports pay one atomic load for this.
func (t *Table) OnChange(fn func(engine state.EngineID)) (remove func()) {
	s := &subscription{fn: fn}
	t.mu.Lock()
	var next []*subscription
	if old := t.subs.Load(); old != nil {
		next = append(next, *old...)
	}
	next = append(next, s)
	t.subs.Store(&next)
	t.mu.Unlock()
	return func() {
		t.mu.Lock()
		defer t.mu.Unlock()
		old := t.subs.Load()
		if old == nil {
			return
		}
		i := slices.Index(*old, s)
		if i < 0 {
			return
		}
		if len(*old) == 1 {
			t.subs.Store(nil)
			return
		}
		next := slices.Delete(slices.Clone(*old), i, i+1)
		t.subs.Store(&next)
	}
}

// notify calls the OnChange callbacks for the engine. Callers do not hold t.mu.
func (t *Table) notify(engine state.EngineID) {
	if subs := t.subs.Load(); subs != nil {
		for _, s := range *subs {
			s.fn(engine)
		}
	}
}

// checkReport validates what a report says about itself; it takes no lock.
func checkReport(r *Report) error {
	if r.Engine == "" {
		return fmt.Errorf("%w: empty engine ID", ErrInvalidReport)
	}
	if r.KVCapacityTokens > 0 && r.UsedKVTokens > r.KVCapacityTokens {
		return fmt.Errorf("%w: engine %q rank %d: used KV tokens %d above capacity %d",
			ErrInvalidReport, r.Engine, r.DPRank, r.UsedKVTokens, r.KVCapacityTokens)
	}
	if l := r.LoRA; l != nil && (l.MaxAdapters < 0 || slices.Contains(l.Running, "") || slices.Contains(l.Waiting, "")) {
		return fmt.Errorf("%w: engine %q rank %d: LoRA adapters: negative slots %d or an empty adapter name",
			ErrInvalidReport, r.Engine, r.DPRank, l.MaxAdapters)
	}
	if r.Native != nil && r.Native.PrefillBusyTime < 0 {
		return fmt.Errorf("%w: engine %q rank %d: negative prefill busy time %v",
			ErrInvalidReport, r.Engine, r.DPRank, r.Native.PrefillBusyTime)
	}
	return nil
}

// checkRankLocked checks the report's rank against the engine's expected ranks (one for an engine
// never declared). Callers hold t.mu.
func (t *Table) checkRankLocked(r *Report) error {
	ranks := 1
	if e := t.entries[r.Engine]; e != nil {
		ranks = len(e.ranks)
	}
	if r.DPRank < 0 || r.DPRank >= ranks {
		return fmt.Errorf("%w: engine %q rank %d, expected ranks %d", ErrRankOutOfRange, r.Engine, r.DPRank, ranks)
	}
	return nil
}

// applyLocked stores a checked report stamped now and returns its engine entry; the caller
// recomputes the engine. Callers hold t.mu.
func (t *Table) applyLocked(r *Report, now time.Time) *engineEntry {
	e := t.entries[r.Engine]
	if e == nil {
		e = &engineEntry{ranks: make([]rankSample, 1)}
		t.entries[r.Engine] = e
	}
	s := &e.ranks[r.DPRank]
	next := rankSample{set: true, report: *r, at: now}
	switch {
	case r.RunningRequests > 1 && r.WaitingRequests >= r.RunningRequests:
		// A full round waits: slots, not one request's prefill, hold the queue back.
		next.slots = r.RunningRequests
	case s.slots > 0 && r.WaitingRequests > 0 && r.RunningRequests == s.slots:
		next.slots = s.slots // still full, requests still waiting
	}
	next.report.Native, next.report.LoRA = nil, nil // never retain the caller's pointers
	if r.LoRA != nil {
		next.report.LoRA = &LoRALoad{MaxAdapters: r.LoRA.MaxAdapters, Running: slices.Clone(r.LoRA.Running),
			Waiting: slices.Clone(r.LoRA.Waiting)}
	}
	if r.Native != nil {
		next.native = *r.Native
		next.report.Native = &next.native
		if s.set && s.report.Native != nil {
			dTok := r.Native.PrefillUncachedTokensTotal - s.native.PrefillUncachedTokensTotal
			dBusy := r.Native.PrefillBusyTime - s.native.PrefillBusyTime
			if r.Native.PrefillUncachedTokensTotal > s.native.PrefillUncachedTokensTotal && dBusy > 0 {
				next.rate = float64(dTok) / dBusy.Seconds()
				next.hasRate = true
			} else if r.Native.PrefillUncachedTokensTotal == s.native.PrefillUncachedTokensTotal &&
				r.Native.PrefillBusyTime == s.native.PrefillBusyTime && s.hasRate {
				// An idle rank keeps its last measured rate: nothing was prefilled in between.
				next.rate, next.hasRate = s.rate, true
			}
		}
	}
	*s = next
	return e
}

// Forget removes every rank of the engine (engine removal). Its load becomes unknown; a later
// report starts a new engine with one expected rank.
func (t *Table) Forget(engine state.EngineID) {
	t.mu.Lock()
	if _, ok := t.entries[engine]; !ok {
		t.mu.Unlock()
		return
	}
	delete(t.entries, engine)
	t.publish(engine, nil)
	t.mu.Unlock()
	t.notify(engine)
}

// recompute aggregates the engine's ranks and publishes the result. Callers hold t.mu.
func (t *Table) recompute(engine state.EngineID, e *engineEntry) {
	var agg *EngineLoad
	complete := len(e.ranks) > 0
	for i := range e.ranks {
		if !e.ranks[i].set {
			complete = false
			break
		}
	}
	if complete {
		agg = aggregate(engine, e.ranks)
		if len(e.ranks) > 1 {
			agg.RankLoads = make([]*EngineLoad, len(e.ranks))
			for i := range e.ranks {
				agg.RankLoads[i] = aggregate(engine, e.ranks[i:i+1])
			}
		}
	}
	t.publish(engine, agg)
}

// aggregate sums the samples of ranks, all set, into one load (docs/design.md §6).
func aggregate(engine state.EngineID, ranks []rankSample) *EngineLoad {
	agg := &EngineLoad{Engine: engine, Ranks: len(ranks), Native: true, HasPrefillRate: true}
	slotsKnown := true
	for i := range ranks {
		s := &ranks[i]
		slots := s.slots
		if s.report.Native != nil && s.native.MaxRunningRequests > 0 {
			slots = s.native.MaxRunningRequests
		}
		slotsKnown = slotsKnown && slots > 0
		agg.RunningSlots = satAdd(agg.RunningSlots, slots)
		if i == 0 || s.at.Before(agg.ReportedAt) {
			agg.ReportedAt = s.at
		}
		agg.RunningRequests = satAdd(agg.RunningRequests, s.report.RunningRequests)
		agg.WaitingRequests = satAdd(agg.WaitingRequests, s.report.WaitingRequests)
		agg.UsedKVTokens = satAdd(agg.UsedKVTokens, s.report.UsedKVTokens)
		agg.KVCapacityTokens = satAdd(agg.KVCapacityTokens, s.report.KVCapacityTokens)
		if s.report.Native == nil || s.report.KVCapacityTokens == 0 || s.native.MaxRunningRequests == 0 {
			agg.Native = false
		}
		agg.WaitingUncachedTokens = satAdd(agg.WaitingUncachedTokens, s.native.WaitingUncachedTokens)
		agg.MaxRunningRequests = satAdd(agg.MaxRunningRequests, s.native.MaxRunningRequests)
		if s.hasRate {
			agg.PrefillTokensPerSecond += s.rate
		} else {
			agg.HasPrefillRate = false
		}
	}
	agg.LoRA = aggregateLoRA(ranks)
	if !slotsKnown {
		agg.RunningSlots = 0
	}
	if !agg.Native {
		agg.WaitingUncachedTokens, agg.MaxRunningRequests = 0, 0
		agg.HasPrefillRate = false
	}
	if agg.HasPrefillRate && agg.PrefillTokensPerSecond > 0 {
		sec := float64(agg.WaitingUncachedTokens) / agg.PrefillTokensPerSecond
		if sec*float64(time.Second) >= math.MaxInt64 {
			agg.EstimatedPrefillQueue = time.Duration(math.MaxInt64)
		} else {
			agg.EstimatedPrefillQueue = time.Duration(sec * float64(time.Second))
		}
	} else {
		agg.PrefillTokensPerSecond, agg.HasPrefillRate = 0, false
	}
	return agg
}

// aggregateLoRA is the LoRA residency of ranks (EngineLoad.LoRA): nil unless every rank reports
// one; one rank's is shared as it is.
func aggregateLoRA(ranks []rankSample) *LoRALoad {
	if len(ranks) == 1 {
		return ranks[0].report.LoRA
	}
	for i := range ranks {
		if ranks[i].report.LoRA == nil {
			return nil
		}
	}
	running := make([][]string, len(ranks))
	waiting := make([][]string, len(ranks))
	slots := 0
	for i := range ranks {
		l := ranks[i].report.LoRA
		running[i], waiting[i] = l.Running, l.Waiting
		if i == 0 || l.MaxAdapters < slots {
			slots = l.MaxAdapters
		}
	}
	return &LoRALoad{MaxAdapters: slots, Running: lora.Union(running...), Waiting: lora.Union(waiting...)}
}

// publish copies the current view with the engine's load replaced (nil removes it). Callers hold
// t.mu. The copy is O(engines); reports are far rarer than picks, which read without locking.
func (t *Table) publish(engine state.EngineID, load *EngineLoad) {
	old := t.view.Load()
	loads := make(map[state.EngineID]*EngineLoad, len(old.loads)+1)
	for k, v := range old.loads {
		loads[k] = v
	}
	if load == nil {
		delete(loads, engine)
	} else {
		loads[engine] = load
	}
	t.version++
	t.view.Store(&tableView{version: t.version, loads: loads})
}

// Snapshot captures the table as it is now. It takes no lock and allocates nothing. A policy
// captures one Snapshot per pick and reuses it for that pick's admission (docs/design.md
// §6); reports arriving later do not change it.
func (t *Table) Snapshot() Snapshot {
	return Snapshot{view: t.view.Load(), at: t.now(), freshness: t.freshness}
}

// Snapshot is an immutable view of a Table at one instant. The zero Snapshot knows no engine.
// Safe for concurrent use.
type Snapshot struct {
	view      *tableView
	at        time.Time
	freshness time.Duration
}

// Version increases with every change to the table; equal versions mean equal contents.
func (s Snapshot) Version() uint64 {
	if s.view == nil {
		return 0
	}
	return s.view.version
}

// CapturedAt returns the clock reading at capture; freshness is judged against it.
func (s Snapshot) CapturedAt() time.Time { return s.at }

// Load returns the engine's load if every expected rank has reported and the oldest report is no
// older than the table's freshness at capture time. Otherwise it returns false: unknown, never
// zero (docs/design.md §6).
func (s Snapshot) Load(engine state.EngineID) (*EngineLoad, bool) {
	if s.view == nil {
		return nil, false
	}
	l := s.view.loads[engine]
	if l == nil || s.at.Sub(l.ReportedAt) > s.freshness {
		return nil, false
	}
	return l, true
}

// Reported returns the engine's last complete load (every expected rank has reported) whether or
// not it is still fresh, for diagnostics and metrics: its ReportedAt tells how stale it is. Routing
// must use Load, which never returns a stale load. False when the engine never completed a report
// (or was forgotten).
func (s Snapshot) Reported(engine state.EngineID) (*EngineLoad, bool) {
	if s.view == nil {
		return nil, false
	}
	l := s.view.loads[engine]
	return l, l != nil
}

func satAdd(a, b uint64) uint64 {
	sum, carry := bits.Add64(a, b, 0)
	if carry != 0 {
		return math.MaxUint64
	}
	return sum
}
