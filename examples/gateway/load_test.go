package main

import (
	"bufio"
	"flag"
	"fmt"
	"io"
	"net/http"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/examples/gateway/internal/fakeengine"
	"github.com/enginepick/enginepick/state"
)

// The long version of TestLoadHeld:
//
//	go test -run TestLoadHeld ./examples/gateway/ -enginepick.load=60s -enginepick.rate=1000
var (
	loadFlag = flag.Duration("enginepick.load", 0, "TestLoadHeld: how long each phase sends (default 2 s, 1.5 s under -race)")
	rateFlag = flag.Int("enginepick.rate", 0, "TestLoadHeld: requests per second (default 100, 60 under -race)")
)

// loadRun is one open-loop phase: requests sent at a fixed rate, each in its own goroutine (so a
// slow answer never delays the next send), numbered by the X-Load-Id header.
type loadRun struct {
	lat       []time.Duration // per request, until the whole answer was read
	status    []int
	complete  []bool // stream: 50 token events and [DONE]; non-stream: a JSON body
	sendLag   time.Duration
	sent      int
	transport error
}

const loadTokens = 50

// openLoop sends rate requests per second to url for d: every second request streamed (the fake
// engines send 50 token events), prompts drawn in turn from prompts.
func openLoop(t *testing.T, client *http.Client, url string, prompts []string, rate int, d time.Duration, firstID int) *loadRun {
	n := int(d.Seconds() * float64(rate))
	r := &loadRun{lat: make([]time.Duration, n), status: make([]int, n), complete: make([]bool, n), sent: n}
	interval := time.Second / time.Duration(rate)
	var wg sync.WaitGroup
	var errs atomic.Int64
	var firstErr atomic.Value
	start := time.Now()
	for i := range n {
		due := start.Add(time.Duration(i) * interval)
		if w := time.Until(due); w > 0 {
			time.Sleep(w)
		}
		r.sendLag = max(r.sendLag, time.Since(due))
		wg.Go(func() {
			stream := i%2 == 0
			body := fmt.Sprintf(`{"model":"m","stream":%v,"messages":[{"role":"user","content":%q}],"max_tokens":%d}`,
				stream, prompts[i%len(prompts)], loadTokens)
			req, err := http.NewRequest(http.MethodPost, url+"/v1/chat/completions", strings.NewReader(body))
			require.NoError(t, err)
			req.Header.Set("Content-Type", "application/json")
			req.Header.Set("X-Load-Id", strconv.Itoa(firstID+i))
			began := time.Now()
			resp, err := client.Do(req)
			if err != nil {
				if errs.Add(1) == 1 {
					firstErr.Store(err)
				}
				return
			}
			defer resp.Body.Close()
			r.status[i] = resp.StatusCode
			if stream {
				events, done := 0, false
				sc := bufio.NewScanner(resp.Body)
				for sc.Scan() {
					switch line := sc.Text(); {
					case line == "data: [DONE]":
						done = true
					case strings.HasPrefix(line, "data: "):
						events++
					}
				}
				r.complete[i] = done && events == loadTokens
			} else {
				b, err := io.ReadAll(resp.Body)
				r.complete[i] = err == nil && strings.HasPrefix(string(b), `{"id":`)
			}
			r.lat[i] = time.Since(began)
		})
	}
	wg.Wait()
	if e, ok := firstErr.Load().(error); ok {
		r.transport = fmt.Errorf("%d requests failed in transport, the first: %w", errs.Load(), e)
	}
	return r
}

func (r *loadRun) sorted() []time.Duration {
	s := slices.Clone(r.lat)
	slices.Sort(s)
	return s
}

// TestLoadHeld holds the gateway under a bounded open-loop load on loopback: four fake vLLM engines
// (streams of 50 token events), cache-aware routing over KV events that two of them publish all
// along (each 20 ms, stores and removals of the prompts' blocks), load polled every 100 ms. The
// same load is first sent straight to the engines (round robin, the baseline) and then through the
// gateway, in the same run. It checks that no request is lost or duplicated (each engine request
// is counted by its X-Load-Id: every ID exactly once over all engines, every answer 200 and
// complete), that every guard is released, and that the goroutine count and the live heap come
// back to their level before the load once idle connections are closed; it reports the latency
// the gateway adds (p50, p99), which it does not assert (the machine's load decides it; see
// BenchmarkGatewayAddedLatency for the targets).
// 1.5 s at 60 requests/s under -race, 2 s at 100 requests/s otherwise; -enginepick.load and
// -enginepick.rate for the long version (docs/RELIABILITY.md §7).
func TestLoadHeld(t *testing.T) {
	d, rate := 2*time.Second, 100
	if raceEnabled {
		d, rate = 1500*time.Millisecond, 60
	}
	if *loadFlag > 0 {
		d = *loadFlag
	}
	if *rateFlag > 0 {
		rate = *rateFlag
	}
	chunks := make([]string, 0, loadTokens+1)
	for i := range loadTokens {
		chunks = append(chunks, fmt.Sprintf("data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"t%d\"}}]}\n\n", i))
	}
	chunks = append(chunks, "data: [DONE]\n\n")
	engines := make([]*fakeengine.Engine, 4)
	for i := range engines {
		engines[i] = newEngine(t)
		engines[i].SetLoad(idleLoad)
		engines[i].SetChunks(chunks, nil, false)
	}
	prompts := make([]faultPrompt, 8)
	texts := make([]string, len(prompts))
	for i := range prompts {
		prompts[i] = newFaultPrompt(fmt.Sprintf("topic%d", i), uint64(10_000*(i+1)))
		texts[i] = prompts[i].text
	}
	pubs := []*restartablePublisher{newRestartablePublisher(t), newRestartablePublisher(t)}
	args := []string{"--policy=cache_aware", fmt.Sprintf("--block-tokens=%d", faultBlock), "--min-matched-tokens=16",
		"--load-interval=100ms", "--load-timeout=100ms", "--freshness=2s"}
	for i, e := range engines {
		a := "--engine=url=" + e.URL() + ",model=m,kind=vllm"
		if i < len(pubs) {
			a += ",kv_events=" + pubs[i].addr + ",kv_replay=" + pubs[i].replay
		}
		args = append(args, a)
	}
	g, gwSrv := startGateway(t, args...)
	// The publishers: engine i holds the prompts i, i+2, …; every 20 ms it stores them, or removes
	// the deepest half of one and stores it again.
	stopPub := make(chan struct{})
	var pubWG sync.WaitGroup
	var published atomic.Int64
	for i, p := range pubs {
		pubWG.Go(func() {
			tick := time.NewTicker(20 * time.Millisecond)
			defer tick.Stop()
			for k := 0; ; k++ {
				select {
				case <-stopPub:
					return
				case <-tick.C:
				}
				fp := prompts[(i+2*k)%len(prompts)]
				if k%2 == 0 {
					p.publish(fp.stored())
				} else {
					half := fp.hashes[len(fp.hashes)/2:]
					p.publish(map[string]any{"type": "BlockRemoved", "block_hashes": half, "medium": "GPU"})
				}
				published.Add(1)
			}
		})
	}
	t.Cleanup(func() { close(stopPub); pubWG.Wait() })
	require.Eventually(t, func() bool {
		for _, e := range engines {
			if _, ok := g.table.Snapshot().Load(state.EngineID(e.URL())); !ok {
				return false
			}
		}
		return g.index.Stats().Blocks > 0
	}, 10*time.Second, 10*time.Millisecond, "every engine's load known and KV events applied")

	client := &http.Client{Transport: &http.Transport{MaxIdleConns: 4096, MaxIdleConnsPerHost: 4096}, Timeout: 30 * time.Second}
	defer client.CloseIdleConnections()
	// Warm both paths' connections, then take the starting levels.
	openLoop(t, client, gwSrv.URL, texts, 100, 500*time.Millisecond, -1_000_000)
	for _, e := range engines {
		openLoop(t, client, e.URL(), texts, 100, 200*time.Millisecond, -1_000_000)
	}
	client.CloseIdleConnections()
	g.server.CloseIdleConnections()
	for _, p := range pubs {
		p.forget() // the test publishers' replay buffers are the test's memory, not the gateway's
	}
	startG, startHeap := settle(t)
	for _, e := range engines {
		e.ResetRequests()
	}

	// Baseline: the same load straight to the engines, spread round robin.
	direct := &loadRun{}
	{
		per := make([]*loadRun, len(engines))
		var wg sync.WaitGroup
		for i, e := range engines {
			wg.Go(func() { per[i] = openLoop(t, client, e.URL(), texts, rate/len(engines), d, 1_000_000*(i+1)) })
		}
		wg.Wait()
		for _, p := range per {
			require.NoError(t, p.transport)
			direct.lat = append(direct.lat, p.lat...)
		}
	}
	for _, e := range engines {
		e.ResetRequests()
	}
	events0 := published.Load()

	via := openLoop(t, client, gwSrv.URL, texts, rate, d, 0)
	eventsDuring := published.Load() - events0
	require.NoError(t, via.transport, "the gateway answered every request")

	// No request lost or duplicated: every ID reached exactly one engine once, and every answer
	// was 200 and complete.
	seen := make([]int, via.sent)
	perEngine := make([]int, len(engines))
	for k, e := range engines {
		for _, rq := range e.Requests() {
			id, err := strconv.Atoi(rq.Header.Get("X-Load-Id"))
			require.NoError(t, err)
			require.True(t, id >= 0 && id < via.sent, "unexpected request %d", id)
			seen[id]++
			perEngine[k]++
		}
	}
	bad, incomplete := 0, 0
	for i := range via.sent {
		if !assert.Equal(t, 1, seen[i], "request %d reached the engines %d times", i, seen[i]) {
			break
		}
		if via.status[i] != http.StatusOK {
			bad++
		} else if !via.complete[i] {
			incomplete++
		}
	}
	assert.Zero(t, bad, "answers other than 200")
	assert.Zero(t, incomplete, "answers cut short")
	for _, e := range engines {
		assert.Eventually(t, func() bool { return g.inflight.Count(state.EngineID(e.URL())) == 0 }, 5*time.Second, time.Millisecond,
			"every guard on %s released", e.URL())
	}

	dl, vl := slices.Sorted(slices.Values(direct.lat)), via.sorted()
	t.Logf("%d requests at %d/s for %v (half streams of %d events), %d KV-event batches during the run; per engine %v; max send lag %v",
		via.sent, rate, d, loadTokens, eventsDuring, perEngine, via.sendLag.Round(time.Microsecond))
	t.Logf("latency direct p50 %v p99 %v; through the gateway p50 %v p99 %v; added p50 %v p99 %v",
		pct(dl, .5).Round(time.Microsecond), pct(dl, .99).Round(time.Microsecond), pct(vl, .5).Round(time.Microsecond), pct(vl, .99).Round(time.Microsecond),
		(pct(vl, .5) - pct(dl, .5)).Round(time.Microsecond), (pct(vl, .99) - pct(dl, .99)).Round(time.Microsecond))

	// Back to the starting level once the load is over and the idle connections (the client's,
	// and the gateway's to the engines, which it closes itself after gw.DefaultIdleConnTimeout)
	// are closed.
	client.CloseIdleConnections()
	g.server.CloseIdleConnections()
	for _, e := range engines {
		e.ResetRequests() // the fake engines' record of every request is the test's, not the gateway's
	}
	for _, p := range pubs {
		p.forget()
	}
	via, direct, dl, vl = nil, nil, nil, nil
	var endG int
	var endHeap uint64
	assert.Eventually(t, func() bool {
		endG, endHeap = settle(t)
		return endG <= startG+2
	}, 10*time.Second, 100*time.Millisecond, "goroutines back to their starting level")
	t.Logf("goroutines %d before, %d after; live heap %.1f MiB before, %.1f MiB after", startG, endG,
		float64(startHeap)/(1<<20), float64(endHeap)/(1<<20))
	assert.LessOrEqual(t, endHeap, startHeap+startHeap/2+2<<20, "live heap back to its starting level")
}

// settle waits for idle connections' goroutines to end and returns the goroutine count and the
// live heap after a GC.
func settle(t *testing.T) (int, uint64) {
	t.Helper()
	time.Sleep(50 * time.Millisecond)
	runtime.GC()
	runtime.GC() // sync.Pool contents survive one GC in its victim cache

	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return runtime.NumGoroutine(), ms.HeapAlloc
}
