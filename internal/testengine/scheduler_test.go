package testengine

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/loadmon/loadsource"
)

// At most MaxNumSeqs requests run; the others wait and are admitted in arrival order.
func TestMaxNumSeqsAndFIFOQueue(t *testing.T) {
	e := start(t, Options{MaxNumSeqs: 2, DecodePerToken: 10 * time.Millisecond, KVEvents: KVEventsOptions{Disabled: true}})
	var mu sync.Mutex
	var done []int
	var wg sync.WaitGroup
	for i := range 5 {
		wg.Go(func() {
			var got completion
			assert.Equal(t, http.StatusOK, postJSON(t, e.URL()+"/v1/completions", idsPrompt(seqIDs(100*i, 20), 5+10*i), nil, &got))
			mu.Lock()
			done = append(done, i)
			mu.Unlock()
		})
		// Each request arrives after the previous one has been queued or admitted.
		require.Eventually(t, func() bool { st := e.Stats(0); return st.Running+st.Waiting == i+1 }, 10*time.Second, time.Millisecond)
	}
	st := e.Stats(0)
	assert.Equal(t, 2, st.Running)
	assert.Equal(t, 3, st.Waiting)
	wg.Wait()
	// Request i generates 5 + 10i tokens, so with 2 running at a time and FIFO admission they end
	// in order.
	assert.Equal(t, []int{0, 1, 2, 3, 4}, done)
	st = e.Stats(0)
	assert.Equal(t, 0, st.Running+st.Waiting)
	assert.Equal(t, 0, st.UsedBlocks)
}

// The prefill takes PrefillPerToken per prompt token not in the cache, so a repeat comes sooner;
// every output token after the first takes DecodePerToken.
func TestPrefillAndDecodeTimes(t *testing.T) {
	e := start(t, Options{PrefillPerToken: 300 * time.Microsecond, DecodePerToken: 20 * time.Millisecond, KVEvents: KVEventsOptions{Disabled: true}})
	body := idsPrompt(seqIDs(1, 1001), 1) // 1001 tokens: 62 full blocks, 992 tokens hit on a repeat
	timed := func(body string) time.Duration {
		began := time.Now()
		require.Equal(t, http.StatusOK, postJSON(t, e.URL()+"/v1/completions", body, nil, nil))
		return time.Since(began)
	}
	cold := timed(body)
	warm := timed(body)
	assert.GreaterOrEqual(t, cold, 1001*300*time.Microsecond)
	assert.GreaterOrEqual(t, warm, 9*300*time.Microsecond)
	assert.Less(t, warm, cold/2, "the cached prefix is not prefilled again")
	decode := timed(idsPrompt(seqIDs(5000, 4), 11))
	assert.GreaterOrEqual(t, decode, 10*20*time.Millisecond)
}

// rankBlocks returns the hashes the rank's cache holds and their copies.
func rankBlocks(e *Engine, rank int) map[uint64]int {
	out := map[uint64]int{}
	for _, b := range e.Blocks(rank) {
		out[b.Hash] = b.Copies
	}
	return out
}

// The pool evicts the least recently used free blocks first, a request's last block before its
// first; a cache hit makes the blocks recent again. Each eviction publishes a BlockRemoved in the
// batch of the request whose allocation evicted it.
func TestEvictionOrder(t *testing.T) {
	// 6 blocks of 4 tokens; each request takes 3: 2 full prompt blocks and one for its output.
	e := start(t, Options{BlockSize: 4, NumBlocks: 6, MaxModelLen: 24})
	r1, r2, r3 := seqIDs(1, 9), seqIDs(101, 9), seqIDs(201, 9)
	h1, h2, h3 := BlockHashes(r1, 4), BlockHashes(r2, 4), BlockHashes(r3, 4)
	var cached []int
	for i, p := range [][]uint32{r1, r2, r1, r3} {
		var got completion
		require.Equal(t, http.StatusOK, postJSON(t, e.URL()+"/v1/completions", idsPrompt(p, 1), nil, &got), "request %d", i)
		cached = append(cached, got.Usage.PromptTokensDetails.CachedTokens)
	}
	assert.Equal(t, []int{0, 0, 8, 0}, cached)
	assert.Equal(t, map[uint64]int{h1[0]: 1, h1[1]: 1, h3[0]: 1, h3[1]: 1}, rankBlocks(e, 0),
		"r2's blocks were the least recently used: r1's repeat refreshed r1's")
	batches := replayBatches(t, e, 0)
	require.Len(t, batches, 3, "the repeat stores nothing")
	assert.Equal(t, []wireEvent{removed(h2[1]), removed(h2[0]), stored(h3, nil, r3[:8], 4)}, batches[2].Events,
		"the last block first")
	assert.Equal(t, 6, e.Options().NumBlocks)
	assert.Equal(t, 0, e.Stats(0).UsedBlocks)
	assert.Equal(t, 4, e.Stats(0).CachedBlocks)
}

// Like vLLM, the pool keeps a second copy of a block computed while one is cached, and evicting a
// copy publishes a BlockRemoved of its hash: the stream then removes a parent whose child stays
// stored (and that the engine still holds). A prompt that ends on a block boundary recomputes its
// last block, which makes such a copy.
func TestCopyOfAParentEvictedWhileItsChildStays(t *testing.T) {
	e := start(t, Options{BlockSize: 4, NumBlocks: 10, MaxModelLen: 40, DecodePerToken: 20 * time.Millisecond})
	long, short, other := seqIDs(1, 8), seqIDs(1, 4), seqIDs(100, 20)
	h := BlockHashes(long, 4) // p, c
	var wg sync.WaitGroup
	wg.Go(func() { // [p c] running for 7 decode steps
		assert.Equal(t, http.StatusOK, postJSON(t, e.URL()+"/v1/completions", idsPrompt(long, 8), nil, nil))
	})
	require.Eventually(t, func() bool { return e.Stats(0).Running == 1 }, 10*time.Second, time.Millisecond)
	// [p] alone: its only block holds its last token, so nothing hits and p is computed again.
	var got completion
	require.Equal(t, http.StatusOK, postJSON(t, e.URL()+"/v1/completions", idsPrompt(short, 1), nil, &got))
	assert.Equal(t, 0, got.Usage.PromptTokensDetails.CachedTokens)
	wg.Wait()
	assert.Equal(t, 2, rankBlocks(e, 0)[h[0]], "two copies of p")
	// The copy freed first (the short request's) is evicted first.
	require.Equal(t, http.StatusOK, postJSON(t, e.URL()+"/v1/completions", idsPrompt(other, 1), nil, nil))
	held := rankBlocks(e, 0)
	assert.Equal(t, 1, held[h[0]], "one copy of p stays")
	assert.Equal(t, 1, held[h[1]], "c stays")

	out := Tokenize(strings.Join(Generate(long, 8), ""))
	all := append(long, out...)
	ha := BlockHashes(all, 4)
	batches := replayBatches(t, e, 0)
	var evs [][]wireEvent
	for _, b := range batches {
		evs = append(evs, b.Events)
	}
	assert.Equal(t, [][]wireEvent{
		{stored(h, nil, long, 4)},
		{stored(h[:1], nil, short, 4)},
		{stored(ha[2:3], h[1], all[8:12], 4)},
		{removed(h[0]), stored(BlockHashes(other, 4), nil, other, 4)},
	}, evs)
}

// Restart cuts the requests in flight off and brings the engine back empty, its publisher
// numbering from FirstSeq again on the same endpoints.
func TestRestart(t *testing.T) {
	e := start(t, Options{BlockSize: 4, DecodePerToken: 50 * time.Millisecond, KVEvents: KVEventsOptions{FirstSeq: 1}})
	kv, replay := e.KVEndpoint(0), e.ReplayEndpoint(0)
	require.Equal(t, http.StatusOK, postJSON(t, e.URL()+"/v1/completions", idsPrompt(seqIDs(1, 9), 1), nil, nil))
	resp := post(t, context.Background(), e.URL()+"/v1/completions", `{"prompt":[1,2,3,4,5,6,7,8,9],"max_tokens":100,"stream":true}`, nil)
	defer resp.Body.Close()
	require.Eventually(t, func() bool { return e.Stats(0).Running == 1 }, 10*time.Second, time.Millisecond)
	require.NotEmpty(t, e.Blocks(0))
	require.Equal(t, uint64(2), e.Stats(0).NextSeq)

	e.Restart()
	_, err := io.ReadAll(resp.Body)
	assert.Error(t, err, "the stream is cut off")
	assert.Empty(t, e.Blocks(0))
	assert.Equal(t, RankStats{NextSeq: 1}, e.Stats(0))
	assert.Equal(t, kv, e.KVEndpoint(0))
	assert.Equal(t, replay, e.ReplayEndpoint(0))
	assert.Empty(t, replayBatches(t, e, 0), "the replay buffer is empty")

	var got completion
	require.Equal(t, http.StatusOK, postJSON(t, e.URL()+"/v1/completions", idsPrompt(seqIDs(1, 9), 1), nil, &got))
	assert.Equal(t, 0, got.Usage.PromptTokensDetails.CachedTokens, "the cache was emptied")
	batches := replayBatches(t, e, 0)
	require.Len(t, batches, 1)
	assert.Equal(t, uint64(1), batches[0].Seq)
}

// POST /sleep waits for the running requests, empties the cache and publishes AllBlocksCleared;
// requests wait until POST /wake_up.
func TestSleepAndWakeUp(t *testing.T) {
	e := start(t, Options{BlockSize: 4, DecodePerToken: 5 * time.Millisecond})
	require.Equal(t, http.StatusOK, postJSON(t, e.URL()+"/v1/completions", idsPrompt(seqIDs(1, 9), 1), nil, nil))
	var wg sync.WaitGroup
	wg.Go(func() { // running when the engine is told to sleep
		assert.Equal(t, http.StatusOK, postJSON(t, e.URL()+"/v1/completions", idsPrompt(seqIDs(50, 9), 20), nil, nil))
	})
	require.Eventually(t, func() bool { return e.Stats(0).Running == 1 }, 10*time.Second, time.Millisecond)
	require.Equal(t, http.StatusOK, postJSON(t, e.URL()+"/sleep", ``, nil, nil))
	wg.Wait()
	assert.Empty(t, e.Blocks(0))
	_, body := get(t, e.URL()+"/is_sleeping")
	assert.JSONEq(t, `{"is_sleeping":true}`, body)
	batches := replayBatches(t, e, 0)
	assert.Equal(t, []wireEvent{{Type: "AllBlocksCleared"}}, batches[len(batches)-1].Events)

	var got completion
	wg.Go(func() {
		assert.Equal(t, http.StatusOK, postJSON(t, e.URL()+"/v1/completions", idsPrompt(seqIDs(1, 9), 1), nil, &got))
	})
	require.Eventually(t, func() bool { return e.Stats(0).Waiting == 1 }, 10*time.Second, time.Millisecond)
	time.Sleep(20 * time.Millisecond)
	assert.Equal(t, 1, e.Stats(0).Waiting, "asleep: not admitted")
	require.Equal(t, http.StatusOK, postJSON(t, e.URL()+"/wake_up", ``, nil, nil))
	wg.Wait()
	assert.Equal(t, 0, got.Usage.PromptTokensDetails.CachedTokens, "the cache was emptied")
	_, body = get(t, e.URL()+"/is_sleeping")
	assert.JSONEq(t, `{"is_sleeping":false}`, body)
}

// Close cuts the requests in flight off and returns once everything has stopped (TestMain checks
// that no goroutine is left).
func TestCloseCutsRequestsOff(t *testing.T) {
	e, err := Start(Options{DecodePerToken: time.Second})
	require.NoError(t, err)
	resp := post(t, context.Background(), e.URL()+"/v1/completions", `{"prompt":"hi","max_tokens":100,"stream":true}`, nil)
	defer resp.Body.Close()
	other := make(chan error)
	go func() {
		resp, err := client.Post(e.URL()+"/v1/completions", "application/json", strings.NewReader(`{"prompt":"x"}`))
		if err == nil {
			resp.Body.Close()
		}
		other <- err
	}()
	require.Eventually(t, func() bool { return e.Stats(0).Running == 2 }, 10*time.Second, time.Millisecond)
	require.NoError(t, e.Close())
	_, err = io.ReadAll(resp.Body)
	assert.Error(t, err, "the stream is cut off")
	assert.Error(t, <-other, "the answer never comes")
	require.NoError(t, e.Close(), "Close after Close")
	_, err = client.Get(e.URL() + "/health")
	assert.Error(t, err, "nothing listens any more")
}

// With DP ranks, the header picks the rank, else the least loaded one does; each rank has its own
// cache, publisher (on consecutive ports) and /metrics series.
func TestDPRanks(t *testing.T) {
	e := start(t, Options{DPRanks: 3, BlockSize: 4, DecodePerToken: 20 * time.Millisecond})
	prompt := seqIDs(1, 9)
	var got completion
	require.Equal(t, http.StatusOK, postJSON(t, e.URL()+"/v1/completions", idsPrompt(prompt, 1), map[string]string{RankHeader: "2"}, &got))
	require.Equal(t, http.StatusOK, postJSON(t, e.URL()+"/v1/completions", idsPrompt(prompt, 1), map[string]string{RankHeader: "2"}, &got))
	assert.Equal(t, 8, got.Usage.PromptTokensDetails.CachedTokens, "rank 2's cache")
	require.Equal(t, http.StatusOK, postJSON(t, e.URL()+"/v1/completions", idsPrompt(prompt, 1), map[string]string{RankHeader: "1"}, &got))
	assert.Equal(t, 0, got.Usage.PromptTokensDetails.CachedTokens, "rank 1 has its own cache")
	assert.Empty(t, e.Blocks(0))
	assert.Len(t, e.Blocks(2), 2)

	// No header: the least loaded rank, the lowest on a tie.
	var wg sync.WaitGroup
	for i := range 4 {
		wg.Go(func() {
			assert.Equal(t, http.StatusOK, postJSON(t, e.URL()+"/v1/completions", idsPrompt(seqIDs(500+20*i, 9), 10), nil, nil))
		})
		require.Eventually(t, func() bool {
			n := 0
			for r := range 3 {
				n += e.Stats(r).Running
			}
			return n == i+1
		}, 10*time.Second, time.Millisecond)
	}
	wg.Wait()
	var ranks []int
	for _, r := range e.Requests()[3:] {
		ranks = append(ranks, r.Rank)
	}
	assert.Equal(t, []int{0, 1, 2, 0}, ranks)
	for r := range 3 {
		b := replayBatches(t, e, r)
		require.NotEmpty(t, b)
		assert.Equal(t, r, b[0].Rank, "each rank's batches carry its rank")
	}
	port := func(addr string) int {
		u, err := url.Parse(addr)
		require.NoError(t, err)
		p, err := strconv.Atoi(u.Port())
		require.NoError(t, err)
		return p
	}
	assert.Equal(t, port(e.KVEndpoint(0))+1, port(e.KVEndpoint(1)))
	assert.Equal(t, port(e.KVEndpoint(0))+2, port(e.KVEndpoint(2)))
	assert.Equal(t, port(e.ReplayEndpoint(0))+2, port(e.ReplayEndpoint(2)))
}

// Requests records what each inference request carried and how it was served.
func TestRequestsAreRecorded(t *testing.T) {
	e := start(t, Options{DPRanks: 2, KVEvents: KVEventsOptions{Disabled: true}})
	require.Equal(t, http.StatusOK, postJSON(t, e.URL()+"/v1/chat/completions", chatBody("hello", 3, false), map[string]string{RankHeader: "1", "X-Test": "a"}, nil))
	reqs := e.Requests()
	require.Len(t, reqs, 1)
	r := reqs[0]
	assert.Equal(t, "/v1/chat/completions", r.Path)
	assert.Equal(t, "a", r.Header.Get("X-Test"))
	assert.Equal(t, 1, r.Rank)
	assert.Equal(t, len(chatTokens("hello")), r.PromptTokens)
	assert.Equal(t, 3, r.CompletionTokens)
	assert.True(t, r.Completed)
	var n int
	require.NoError(t, json.Unmarshal(r.Body["max_tokens"], &n))
	assert.Equal(t, 3, n)
}

// With RankServers each rank has its own HTTP server, serving only that rank (whatever rank a
// request names) with its own /metrics and /sleep, and the topic names the rank's server.
func TestRankServers(t *testing.T) {
	e := start(t, Options{DPRanks: 2, RankServers: true, BlockSize: 4,
		KVEvents: KVEventsOptions{Topic: "kv@{addr}@{rank}", ReplayFormat: ReplayTopic}})
	require.Equal(t, e.URL(), e.RankURL(0))
	require.NotEqual(t, e.RankURL(0), e.RankURL(1))
	var got completion
	for range 2 {
		require.Equal(t, http.StatusOK, postJSON(t, e.RankURL(1)+"/v1/completions", idsPrompt(seqIDs(1, 9), 1), map[string]string{RankHeader: "0"}, &got))
	}
	assert.Equal(t, 8, got.Usage.PromptTokensDetails.CachedTokens)
	assert.Empty(t, e.Blocks(0))
	assert.Len(t, e.Blocks(1), 2)
	for _, r := range e.Requests() {
		assert.Equal(t, 1, r.Rank)
	}

	_, body := get(t, e.RankURL(1)+"/metrics")
	page, err := loadsource.Parse(loadsource.FormatVLLMMetrics, "e", []byte(body))
	require.NoError(t, err)
	require.Len(t, page.Reports, 1)
	assert.Equal(t, 1, page.Reports[0].DPRank)

	topic := "kv@" + strings.TrimPrefix(e.RankURL(1), "http://") + "@1"
	assert.Equal(t, topic, e.Topic(1))
	frames := replayFrames(t, e.ReplayEndpoint(1), 0)
	require.Len(t, frames, 2)
	assert.Equal(t, topic, string(frames[0][0]))
	assert.Equal(t, 1, decodeBatch(t, frames[0][2], EncodingMap).Rank)

	require.Equal(t, http.StatusOK, postJSON(t, e.RankURL(1)+"/sleep", ``, nil, nil))
	assert.True(t, e.Stats(1).Sleeping)
	assert.False(t, e.Stats(0).Sleeping)
	_, body = get(t, e.RankURL(0)+"/is_sleeping")
	assert.JSONEq(t, `{"is_sleeping":false}`, body)
	require.Equal(t, http.StatusOK, postJSON(t, e.RankURL(1)+"/wake_up", ``, nil, nil))
	assert.False(t, e.Stats(1).Sleeping)

	// A given address: rank r listens on its port + r.
	for try := 0; ; try++ {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		require.NoError(t, err)
		port := ln.Addr().(*net.TCPAddr).Port
		ln.Close()
		f, err := Start(Options{DPRanks: 3, RankServers: true, Addr: fmt.Sprintf("127.0.0.1:%d", port), KVEvents: KVEventsOptions{Disabled: true}})
		if err != nil && try < 5 {
			continue // a port was taken meanwhile
		}
		require.NoError(t, err)
		assert.Equal(t, []string{fmt.Sprintf("http://127.0.0.1:%d", port), fmt.Sprintf("http://127.0.0.1:%d", port+1), fmt.Sprintf("http://127.0.0.1:%d", port+2)},
			[]string{f.RankURL(0), f.RankURL(1), f.RankURL(2)})
		require.NoError(t, f.Close())
		break
	}
}

// Under SchedulingPolicy "priority" the waiting requests are admitted by their body's priority,
// lowest first, then in arrival order; under "fcfs" a priority other than 0 is vLLM's 400, and an
// unknown policy is refused.
func TestPrioritySchedulingPolicy(t *testing.T) {
	e := start(t, Options{MaxNumSeqs: 1, SchedulingPolicy: "priority", DecodePerToken: 20 * time.Millisecond, KVEvents: KVEventsOptions{Disabled: true}})
	body := func(i int, priority int) string {
		tokens := 2
		if i == 0 {
			tokens = 50 // runs 1 s, while the others arrive
		}
		return strings.Replace(idsPrompt(seqIDs(100*i, 20), tokens), "{", fmt.Sprintf(`{"priority":%d,`, priority), 1)
	}
	var mu sync.Mutex
	var done []string
	var wg sync.WaitGroup
	for i, r := range []struct {
		name     string
		priority int
	}{{"running", 0}, {"b", 0}, {"c", 5}, {"d", -1}, {"e", 0}} {
		wg.Go(func() {
			assert.Equal(t, http.StatusOK, postJSON(t, e.URL()+"/v1/completions", body(i, r.priority), nil, nil))
			mu.Lock()
			done = append(done, r.name)
			mu.Unlock()
		})
		require.Eventually(t, func() bool { st := e.Stats(0); return st.Running+st.Waiting == i+1 }, 10*time.Second, time.Millisecond)
	}
	wg.Wait()
	assert.Equal(t, []string{"running", "d", "b", "e", "c"}, done)

	fcfs := start(t, Options{KVEvents: KVEventsOptions{Disabled: true}})
	var apiErr struct {
		Error struct {
			Message string `json:"message"`
		} `json:"error"`
	}
	resp := post(t, context.Background(), fcfs.URL()+"/v1/completions", body(0, 3), nil)
	defer resp.Body.Close()
	assert.Equal(t, http.StatusBadRequest, resp.StatusCode)
	require.NoError(t, json.NewDecoder(resp.Body).Decode(&apiErr))
	assert.Equal(t, "Got priority 3 but Priority scheduling is not enabled.", apiErr.Error.Message)
	assert.Equal(t, http.StatusOK, postJSON(t, fcfs.URL()+"/v1/completions", body(1, 0), nil, nil), "priority 0 is every policy's")

	_, err := Start(Options{SchedulingPolicy: "lifo"})
	assert.ErrorIs(t, err, ErrOptions)
}
