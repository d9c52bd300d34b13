package sim

import (
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/enginepick/enginepick"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/state"
)

// reqState is one trace request during a replay.
type reqState struct {
	pos      int32 // position in the replay's request list
	tr       *Request
	adapter  int32    // tr.Adapter's index in resolved.adapters; -1 for the base model
	input    int      // prompt tokens: Config.SystemPromptTokens + tr.InputTokens
	replica  *replica // the router replica that routed it
	arrival  time.Duration
	output   int // tokens to generate, at least 1
	dispatch *enginepick.Dispatch
	front    *engine // plain or prefill engine
	decode   *engine // PD decode engine; nil in plain mode

	tokens []uint32 // prompt token IDs, until the prompt is prefilled
	hashes []uint64 // engine hashes of the prompt's full blocks
	keys   []uint64 // kvindex keys of those blocks (index check only)

	estUncached int     // uncached prompt tokens estimated at enqueue (waiting-uncached load)
	cached      int     // prompt tokens served from the front engine's cache
	work        int     // prompt tokens to prefill: InputTokens - cached
	prefilled   int     // of work, done
	chain       []int32 // front-engine cache slots the request references, in prompt order
	private     int     // front-engine private KV reservation, tokens
	decPrivate  int     // decode-engine KV reservation, tokens (PD)
	generated   int     // output tokens produced so far

	firstToken time.Duration
	routed     bool // its selection ended (flow control: once, counted by the sim)
	finished   bool
}

// segmentKind is what an engine is doing between two of its events.
type segmentKind uint8

const (
	segIdle segmentKind = iota
	segPrefill
	segDecode
)

// batchItem is one request's share of a prefill step.
type batchItem struct {
	q      *reqState
	tokens int
}

// engine is one simulated inference server (see EngineModel for its behaviour). It runs on the
// replay's goroutine only.
type engine struct {
	r      *run
	idx    int32
	id     state.EngineID
	static *state.StaticEngine
	stage  state.Stage
	m      *EngineModel
	cache  *kvCache

	waiting         []*reqState // FIFO; head at waitHead
	waitHead        int
	waitingUncached int
	prefilling      []*reqState // admitted, prompt incomplete (FIFO)
	decoding        []*reqState
	transferring    int // PD decode: admitted, KV on its way
	holding         int // PD prefill: prompt done, KV not yet sent

	// Current segment.
	kind     segmentKind
	segStart time.Duration
	segEnd   time.Duration
	version  uint64
	batch    []batchItem // segPrefill
	steps    int         // segDecode: steps planned
	kv0      float64     // segDecode: KV tokens of the batch at the first step
	bsize    float64     // segDecode: requests in the batch

	// Counters.
	prefillTokens uint64
	prefillBusy   time.Duration
	decodeBusy    time.Duration
	dispatched    int
	native        loadmon.NativeLoad

	// LoRA adapters (plain and prefill engines, when the trace names adapters).
	slots      []loraSlot // resident adapters, at most EngineModel.MaxLoRAs
	waitingFor []int32    // queued requests per adapter
	loads      int        // adapters loaded into a slot
	touches    uint64     // recency clock of the slots
}

// loraSlot is one adapter resident in an engine's GPU slot.
type loraSlot struct {
	adapter int32
	running int32  // requests of the adapter in the engine's running batch
	used    uint64 // the engine's touches when a request of it last entered or left the batch
}

func (e *engine) waitLen() int { return len(e.waiting) - e.waitHead }

// hasSlots reports whether the engine models adapter slots: a plain or prefill engine of a trace
// that names adapters.
func (e *engine) hasSlots() bool { return e.waitingFor != nil }

// slotFor returns where a request of adapter a would run: the index of a's slot, or of the slot
// to load it into (len(e.slots) for a free one, else the least recently used slot no running
// request uses), and whether that takes a load. ok is false when every slot is in use by another
// adapter's running requests. The base model (a < 0) needs no slot: -1, no load, ok.
func (e *engine) slotFor(a int32) (slot int, load, ok bool) {
	if a < 0 || !e.hasSlots() {
		return -1, false, true
	}
	victim := -1
	for i := range e.slots {
		sl := &e.slots[i]
		if sl.adapter == a {
			return i, false, true
		}
		if sl.running == 0 && (victim < 0 || sl.used < e.slots[victim].used) {
			victim = i
		}
	}
	if len(e.slots) < e.m.MaxLoRAs {
		return len(e.slots), true, true
	}
	return victim, true, victim >= 0
}

// enterSlot counts a request of adapter a entering the running batch in slot (from slotFor),
// loading a into it when load is set.
func (e *engine) enterSlot(a int32, slot int, load bool) {
	if slot < 0 {
		return
	}
	if slot == len(e.slots) {
		e.slots = append(e.slots, loraSlot{})
	}
	sl := &e.slots[slot]
	if load {
		*sl = loraSlot{adapter: a}
		e.loads++
	}
	sl.running++
	e.touches++
	sl.used = e.touches
}

// leaveSlot counts a request of adapter a leaving the running batch.
func (e *engine) leaveSlot(a int32) {
	if a < 0 || !e.hasSlots() {
		return
	}
	for i := range e.slots {
		if sl := &e.slots[i]; sl.adapter == a {
			sl.running--
			e.touches++
			sl.used = e.touches
			return
		}
	}
}

// loraReport returns the engine's adapters as vLLM's vllm:lora_requests_info reports them: its
// slots, and the adapters of its running and waiting requests in name order; nil for an engine
// without slots.
func (e *engine) loraReport() *loadmon.LoRALoad {
	if !e.hasSlots() {
		return nil
	}
	l := &loadmon.LoRALoad{MaxAdapters: e.m.MaxLoRAs}
	names := e.r.rc.adapters
	for a, n := range e.waitingFor {
		if n > 0 {
			l.Waiting = append(l.Waiting, names[a])
		}
	}
	for _, sl := range e.slots {
		if sl.running > 0 {
			l.Running = append(l.Running, names[sl.adapter])
		}
	}
	slices.Sort(l.Running)
	return l
}

// running returns the requests counted against MaxRunningRequests and reported as running.
func (e *engine) running() int {
	switch e.stage {
	case state.StagePrefill:
		return len(e.prefilling)
	case state.StageDecode:
		return len(e.decoding) + e.transferring
	}
	return len(e.prefilling) + len(e.decoding)
}

// report publishes the engine's load to the replay's table, with the native extension unless
// Config.Reports is ReportsBasic. Waiting uncached tokens are the prompt tokens still to prefill: the queue's (estimated against the cache when each request was
// queued) plus the rest of any prompt whose prefill is in progress, so that waiting uncached ÷
// prefill throughput estimates when a new request's prefill could start.
func (e *engine) report() error {
	return e.reportTo(e.r.replicas)
}

// reportTo publishes the engine's load to the tables of reps.
func (e *engine) reportTo(reps []*replica) error {
	pending := e.waitingUncached
	for _, q := range e.prefilling {
		pending += q.work - q.prefilled
	}
	e.native = loadmon.NativeLoad{
		WaitingUncachedTokens:      uint64(pending),
		MaxRunningRequests:         uint64(e.m.MaxRunningRequests),
		PrefillUncachedTokensTotal: e.prefillTokens,
		PrefillBusyTime:            e.prefillBusy,
	}
	rep := loadmon.Report{
		Engine:           e.id,
		RunningRequests:  uint64(e.running()),
		WaitingRequests:  uint64(e.waitLen()),
		UsedKVTokens:     uint64(e.cache.used()),
		KVCapacityTokens: uint64(e.cache.capacity),
		Native:           &e.native,
		LoRA:             e.loraReport(),
	}
	if e.r.rc.Reports == ReportsBasic {
		rep.Native = nil
	}
	for _, x := range reps {
		if err := x.load.Report(rep); err != nil {
			return err
		}
	}
	return nil
}

// cachedBlocks returns how many leading blocks of q's prompt the front engine would serve from
// its cache now: the matched blocks, keeping the last prompt token to recompute.
func (e *engine) cachedBlocks(q *reqState) int {
	n := q.input
	if n <= 0 {
		return 0
	}
	return min(e.cache.match(q.hashes), (n-1)/e.m.BlockTokens)
}

// enqueue adds a routed request to a plain or prefill engine's queue.
func (e *engine) enqueue(q *reqState) error {
	q.estUncached = q.input - e.cachedBlocks(q)*e.m.BlockTokens
	e.waitingUncached += q.estUncached
	e.waiting = append(e.waiting, q)
	if e.m.PriorityScheduling {
		// Behind every waiting request of its priority or higher (EngineModel.PriorityScheduling).
		i := len(e.waiting) - 1
		for ; i > e.waitHead && e.waiting[i-1].tr.Priority < q.tr.Priority; i-- {
			e.waiting[i] = e.waiting[i-1]
		}
		e.waiting[i] = q
	}
	if q.adapter >= 0 && e.hasSlots() {
		e.waitingFor[q.adapter]++
	}
	e.dispatched++
	return e.poke()
}

// poke tells the engine it has new work: an idle engine plans at once; a decode run is cut at its
// next step boundary, where the engine plans again; a prefill step runs to its end.
func (e *engine) poke() error {
	switch e.kind {
	case segIdle:
		return e.plan()
	case segDecode:
		e.cutDecode()
	}
	return nil
}

// plan chooses the next segment at a step boundary.
func (e *engine) plan() error {
	e.kind = segIdle
	if e.stage != state.StageDecode {
		if err := e.planPrefill(); err != nil || e.kind != segIdle {
			return err
		}
		if e.stage == state.StagePrefill {
			return nil
		}
	}
	if len(e.decoding) > 0 {
		e.planDecode()
	}
	return nil
}

// planPrefill forms a prefill batch (see EngineModel) and starts it, if there is one.
func (e *engine) planPrefill() error {
	budget := e.m.ChunkedPrefillTokens
	e.batch = e.batch[:0]
	seconds := 0.0
	for _, q := range e.prefilling {
		if budget == 0 {
			break
		}
		take := min(q.work-q.prefilled, budget)
		e.batch = append(e.batch, batchItem{q, take})
		budget -= take
		seconds += e.m.prefillSeconds(take, q.cached+q.prefilled)
	}
	for i := e.waitHead; budget > 0 && i < len(e.waiting) && e.running() < e.m.MaxRunningRequests; {
		q := e.waiting[i]
		slot, load, ok := e.slotFor(q.adapter)
		if !ok {
			i++ // its adapter can get no slot now: skipped, it keeps its place
			continue
		}
		ok, err := e.admit(q, i)
		if err != nil {
			return err
		}
		if !ok {
			break
		}
		i = max(i, e.waitHead) // the head moved on; a request behind it left its place to the next
		e.enterSlot(q.adapter, slot, load)
		if load {
			seconds += e.m.LoRALoadTime.Seconds()
		}
		take := min(q.work, budget)
		e.batch = append(e.batch, batchItem{q, take})
		budget -= take
		seconds += e.m.prefillSeconds(take, q.cached)
	}
	if len(e.batch) == 0 {
		return nil
	}
	e.kind = segPrefill
	e.segStart = e.r.now
	e.segEnd = e.r.now + secondsToDuration(seconds)
	e.version++
	e.r.schedule(e.segEnd, evStep, e.idx, e.version)
	return nil
}

// admit moves q, the queued request at e.waiting[i], into the running batch if its KV fits: it
// references the cached prefix and reserves the rest of the prompt (and, on a plain engine, the
// output).
func (e *engine) admit(q *reqState, i int) (bool, error) {
	blocks := e.cachedBlocks(q)
	cached := blocks * e.m.BlockTokens
	work := q.input - cached
	need := work
	if e.stage == state.StagePlain {
		need += q.output
	}
	// Matched blocks nobody references are evictable now but will not be once referenced.
	idle := 0
	for _, h := range q.hashes[:blocks] {
		if e.cache.blocks[e.cache.byHash[h]].refs == 0 {
			idle++
		}
	}
	c := e.cache
	if need > c.free()+(c.evictable-idle)*c.blockTokens {
		return false, nil
	}
	q.chain = q.chain[:0]
	for _, h := range q.hashes[:blocks] {
		q.chain = append(q.chain, c.acquire(h))
	}
	if err := c.reserve(need); err != nil {
		return false, err
	}
	q.private = need
	q.cached, q.work, q.prefilled = cached, work, 0
	if i == e.waitHead {
		e.waiting[e.waitHead] = nil
		e.waitHead++
	} else { // a request behind skipped ones
		copy(e.waiting[i:], e.waiting[i+1:])
		e.waiting[len(e.waiting)-1] = nil
		e.waiting = e.waiting[:len(e.waiting)-1]
	}
	if e.waitHead == len(e.waiting) {
		e.waiting, e.waitHead = e.waiting[:0], 0
	}
	if q.adapter >= 0 && e.hasSlots() {
		e.waitingFor[q.adapter]--
	}
	e.waitingUncached -= q.estUncached
	e.prefilling = append(e.prefilling, q)
	e.r.observeAdmission(q)
	return true, nil
}

// endPrefill applies a finished prefill step.
func (e *engine) endPrefill() error {
	total := 0
	done := 0
	for _, it := range e.batch {
		q := it.q
		q.prefilled += it.tokens
		total += it.tokens
		if err := e.storeBlocks(q); err != nil {
			return err
		}
		if q.prefilled == q.work {
			done++
		}
	}
	e.prefillTokens += uint64(total)
	e.prefillBusy += e.segEnd - e.segStart
	if done > 0 {
		kept := e.prefilling[:0]
		for _, q := range e.prefilling {
			if q.prefilled < q.work {
				kept = append(kept, q)
			}
		}
		clear(e.prefilling[len(kept):])
		e.prefilling = kept
		for _, it := range e.batch {
			if q := it.q; q.prefilled == q.work {
				if err := e.r.promptDone(q); err != nil {
					return err
				}
			}
		}
	}
	clear(e.batch)
	return e.plan()
}

// storeBlocks caches every full prompt block q has computed and not yet cached, publishing each
// run of newly inserted blocks as one BlockStored event. A block another request cached first is
// referenced instead; q keeps its own copy in its private reservation.
func (e *engine) storeBlocks(q *reqState) error {
	c := e.cache
	B := e.m.BlockTokens
	full := min((q.cached+q.prefilled)/B, len(q.hashes))
	start := -1 // first block of the current run of inserts
	flush := func(end int) error {
		if start < 0 {
			return nil
		}
		var parent uint64
		if start > 0 {
			parent = q.hashes[start-1]
		}
		err := c.publishStored(q.adapter, parent, start > 0, q.hashes[start:end], q.tokens[start*B:end*B])
		start = -1
		return err
	}
	for j := len(q.chain); j < full; j++ {
		h := q.hashes[j]
		if _, ok := c.byHash[h]; ok {
			if err := flush(j); err != nil {
				return err
			}
			q.chain = append(q.chain, c.acquire(h))
			continue
		}
		parent := int32(-1)
		if j > 0 {
			parent = q.chain[j-1]
		}
		var key uint64
		if c.recordKey {
			key = q.keys[j]
		}
		q.chain = append(q.chain, c.insert(h, parent, key))
		q.private -= B
		if start < 0 {
			start = j
		}
	}
	return flush(full)
}

// releaseFront returns q's front-engine KV and its place in the engine's running batch.
func (e *engine) releaseFront(q *reqState) {
	e.cache.release(q.chain)
	e.cache.unreserve(q.private)
	q.chain, q.private = q.chain[:0], 0
	e.leaveSlot(q.adapter)
}

// planDecode starts a run of decode steps that ends when the first decoding request completes.
func (e *engine) planDecode() {
	n := math.MaxInt
	kv := 0
	for _, q := range e.decoding {
		n = min(n, q.output-q.generated)
		kv += q.input + q.generated
	}
	e.kind = segDecode
	e.segStart = e.r.now
	e.steps = n
	e.kv0 = float64(kv)
	e.bsize = float64(len(e.decoding))
	e.segEnd = e.segStart + e.decodeTime(n)
	e.version++
	e.r.schedule(e.segEnd, evStep, e.idx, e.version)
}

// decodeTime returns the time of the first k steps of the current decode run: step i reads the
// weights and kv0 + i × batch tokens of KV.
func (e *engine) decodeTime(k int) time.Duration {
	kf := float64(k)
	c := e.m.kvTokenSeconds()
	s := kf*(e.m.DecodeStepBase.Seconds()+c*e.kv0) + c*e.bsize*kf*(kf-1)/2
	return secondsToDuration(s)
}

// cutDecode shortens the current decode run to the step in progress now, so that the engine
// plans again at that boundary.
func (e *engine) cutDecode() {
	elapsed := e.r.now - e.segStart
	k := e.stepsCovering(elapsed)
	if k >= e.steps {
		return
	}
	end := e.segStart + e.decodeTime(k)
	if end == e.segEnd {
		return
	}
	e.steps = k
	e.segEnd = end
	e.version++
	e.r.schedule(end, evStep, e.idx, e.version)
}

// stepsCovering returns the fewest steps of the current run that take at least elapsed.
func (e *engine) stepsCovering(elapsed time.Duration) int {
	if elapsed <= 0 {
		return 0
	}
	c := e.m.kvTokenSeconds()
	a := c * e.bsize / 2
	b := e.m.DecodeStepBase.Seconds() + c*e.kv0 - a
	x := elapsed.Seconds()
	var k float64
	switch {
	case a > 0:
		k = (-b + math.Sqrt(b*b+4*a*x)) / (2 * a)
	case b > 0:
		k = x / b
	default:
		return 0 // steps take no time
	}
	n := int(min(math.Ceil(k), float64(e.steps)))
	n = max(n, 0)
	for n > 0 && e.decodeTime(n-1) >= elapsed {
		n--
	}
	for n < e.steps && e.decodeTime(n) < elapsed {
		n++
	}
	return n
}

// endDecode applies a finished run of decode steps.
func (e *engine) endDecode() error {
	k := e.steps
	e.decodeBusy += e.segEnd - e.segStart
	if k > 0 {
		kept := e.decoding[:0]
		var done []*reqState
		for _, q := range e.decoding {
			q.generated += k
			if q.generated >= q.output {
				done = append(done, q)
			} else {
				kept = append(kept, q)
			}
		}
		clear(e.decoding[len(kept):])
		e.decoding = kept
		for _, q := range done {
			if err := e.r.finish(q); err != nil {
				return err
			}
		}
	}
	return e.plan()
}

// onStep handles an evStep event.
func (e *engine) onStep(ver uint64) error {
	if ver != e.version {
		return nil // superseded by a cut
	}
	switch e.kind {
	case segPrefill:
		return e.endPrefill()
	case segDecode:
		return e.endDecode()
	}
	return fmt.Errorf("sim: engine %q: step event while idle", e.id)
}

// startDecoding adds a request whose first token exists to the decode batch.
func (e *engine) startDecoding(q *reqState) error {
	q.generated = 1
	e.decoding = append(e.decoding, q)
	return e.poke()
}

// PD decode engines.

// enqueueDecode adds a prefilled request to a decode engine's queue.
func (e *engine) enqueueDecode(q *reqState) error {
	e.waiting = append(e.waiting, q)
	return e.admitDecode()
}

// admitDecode reserves KV for queued requests in FIFO order and starts their transfers.
func (e *engine) admitDecode() error {
	for e.waitLen() > 0 && e.running() < e.m.MaxRunningRequests {
		q := e.waiting[e.waitHead]
		need := q.input + q.output
		if !e.cache.canReserve(need) {
			break
		}
		if err := e.cache.reserve(need); err != nil {
			return err
		}
		q.decPrivate = need
		e.waiting[e.waitHead] = nil
		e.waitHead++
		if e.waitHead == len(e.waiting) {
			e.waiting, e.waitHead = e.waiting[:0], 0
		}
		e.transferring++
		e.r.schedule(e.r.now+e.m.transferTime(q.input), evTransfer, q.pos, 0)
	}
	return nil
}
