package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/enginepick/enginepick/examples/gateway/internal/fakeengine"
	"github.com/enginepick/enginepick/examples/gateway/internal/gw"
	"github.com/enginepick/enginepick/state"
)

// consecutivePorts returns the first of n consecutive free loopback ports: rank r of an engine
// publishes KV events on the rank-0 port + r.
func consecutivePorts(t *testing.T, n int) int {
	t.Helper()
	for range 100 {
		base := freePort(t)
		ok := true
		var ls []net.Listener
		for r := range n {
			l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", base+r))
			if err != nil {
				ok = false
				break
			}
			ls = append(ls, l)
		}
		for _, l := range ls {
			l.Close()
		}
		if ok {
			return base
		}
	}
	t.Fatal("no consecutive free ports")
	return 0
}

// publishRank is publish for a publisher of DP rank rank: the batch names its rank, as vLLM's
// data_parallel_rank does (a batch naming another rank than its stream's is malformed).
func (p *publisher) publishRank(t *testing.T, rank int, events ...any) {
	raw, err := msgpack.Marshal([]any{float64(time.Now().UnixNano()) / 1e9, events, rank})
	require.NoError(t, err)
	p.mu.Lock()
	seq := uint64(len(p.batches))
	p.batches = append(p.batches, raw)
	p.mu.Unlock()
	require.NoError(t, p.pub.SendMulti(zmq4.NewMsgFrom([]byte(""), be64(seq), raw)))
}

// vllmRankLoad is a vLLM /metrics page with one series per DP rank (the engine label).
func vllmRankLoad(waiting ...int) string {
	var b strings.Builder
	for r, w := range waiting {
		fmt.Fprintf(&b, "vllm:num_requests_running{engine=\"%d\"} 1\nvllm:num_requests_waiting{engine=\"%d\"} %d\n", r, r, w)
	}
	return b.String()
}

func waitLoad(t *testing.T, g *gateway, engines ...*fakeengine.Engine) {
	t.Helper()
	require.Eventually(t, func() bool {
		for _, e := range engines {
			if _, ok := g.table.Snapshot().Load(state.EngineID(e.URL())); !ok {
				return false
			}
		}
		return true
	}, 20*time.Second, 5*time.Millisecond, "every rank's load polled")
}

// End to end, the rank a pick names reaches the engine the way it accepts one: vLLM the
// X-data-parallel-rank header, SGLang the routed_dp_rank field. With load per rank and no cache
// hit, the rank is the least pressured one.
func TestLeastPressuredRankReachesTheEngine(t *testing.T) {
	t.Parallel()
	v, s := newEngine(t), newEngine(t)
	v.SetLoad(vllmRankLoad(5, 3, 0, 2))
	s.SetLoad(`{"loads":[{"dp_rank":0,"num_running_reqs":1,"num_waiting_reqs":4},{"dp_rank":1,"num_running_reqs":1,"num_waiting_reqs":1}]}`)
	g, gwSrv := startGateway(t, "--policy=least_load",
		"--engine=url="+v.URL()+",model=v,kind=vllm,dp_ranks=4",
		"--engine=url="+s.URL()+",model=s,kind=sglang,dp_ranks=2", "--load-interval=200ms", "--load-timeout=200ms")
	waitLoad(t, g, v, s)
	for _, model := range []string{"v", "s"} {
		resp := post(t, context.Background(), gwSrv.URL+"/v1/completions", `{"model":"`+model+`","prompt":"hello"}`,
			map[string]string{gw.VLLMRankHeader: "3"})
		_, _ = io.ReadAll(resp.Body)
		resp.Body.Close()
		require.Equal(t, http.StatusOK, resp.StatusCode)
	}
	require.Len(t, v.Requests(), 1)
	assert.Equal(t, "2", v.Requests()[0].Header.Get(gw.VLLMRankHeader), "rank 2 queues nothing; the client's header is replaced")
	require.Len(t, s.Requests(), 1)
	assert.JSONEq(t, `1`, string(s.Requests()[0].Body["routed_dp_rank"]))
	assert.Empty(t, s.Requests()[0].Header.Get(gw.VLLMRankHeader))
}

// End to end, a cache hit is sent to the rank that published the prompt's blocks, even though
// another rank of the engine is less pressured.
func TestCacheHitGoesToThePublishingRank(t *testing.T) {
	t.Parallel()
	a, b := newEngine(t), newEngine(t)
	base := consecutivePorts(t, 2)
	pub := newPublisherOn(t, fmt.Sprintf("tcp://127.0.0.1:%d", base+1), fmt.Sprintf("tcp://127.0.0.1:%d", freePort(t)))
	a.SetLoad(vllmRankLoad(0))
	b.SetLoad(vllmRankLoad(0, 1)) // rank 0 is idle; rank 1 holds the prompt
	const block = 4
	g, gwSrv := startGateway(t,
		"--engine=url="+a.URL()+",model=m,kind=vllm",
		"--engine=url="+b.URL()+",model=m,kind=vllm,dp_ranks=2,kv_events="+fmt.Sprintf("tcp://127.0.0.1:%d", base),
		"--block-tokens=4", "--min-matched-tokens=64", "--load-interval=200ms", "--load-timeout=200ms")
	waitLoad(t, g, a, b)
	text := strings.Repeat("the quick brown fox jumps over the lazy dog. ", 3)
	tokens := fakeengine.Tokens(text)
	full := len(tokens) / block * block
	hashes := make([]uint64, full/block)
	for i := range hashes {
		hashes[i] = uint64(1000 + i)
	}
	keys := g.index.Hasher().Keys(tokens)
	require.Eventually(t, func() bool {
		pub.publishRank(t, 1, blockStored(hashes, tokens[:full], block))
		m := g.index.Match(keys)
		return m.Blocks(state.EngineID(b.URL())) == len(hashes)
	}, 10*time.Second, 20*time.Millisecond, "the gateway's index learns rank 1's blocks from its events")
	// Publishing has stopped: wait until the subscriber is in step, so that no late batch or
	// resync changes the index during the request.
	pub.mu.Lock()
	last := uint64(len(pub.batches) - 1)
	pub.mu.Unlock()
	require.Eventually(t, func() bool {
		for _, st := range g.kv.sub.Stats().Streams {
			if st.DPRank == 1 && st.LastSeq == last && st.Trusted {
				return g.index.Match(keys).Blocks(state.EngineID(b.URL())) == len(hashes)
			}
		}
		return false
	}, 10*time.Second, 10*time.Millisecond)
	m := g.index.Match(keys)
	require.Equal(t, []int{1}, m.DPRanks)

	body := fmt.Sprintf(`{"model":"m","messages":[{"role":"user","content":%q}],"max_tokens":8}`, text)
	resp := post(t, context.Background(), gwSrv.URL+"/v1/chat/completions", body, nil)
	_, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.Len(t, b.Requests(), 1, "the holder")
	assert.Equal(t, "1", b.Requests()[0].Header.Get(gw.VLLMRankHeader), "the rank holding the prefix, not the idler rank 0")
	assert.Empty(t, a.Requests())
}

// End to end in PD, the SGLang prefill leg gets its rank and a bootstrap room whose remainder by
// the prefill DP size is that rank; the decode leg gets its own rank and the prefill's.
func TestPDRanksEndToEnd(t *testing.T) {
	t.Parallel()
	p, d := newEngine(t), newEngine(t)
	p.SetLoad(`{"loads":[{"dp_rank":0,"num_running_reqs":1,"num_waiting_reqs":3},{"dp_rank":1,"num_running_reqs":1,"num_waiting_reqs":2},{"dp_rank":2,"num_running_reqs":1,"num_waiting_reqs":0},{"dp_rank":3,"num_running_reqs":1,"num_waiting_reqs":1}]}`)
	d.SetLoad(`{"loads":[{"dp_rank":0,"num_running_reqs":5,"num_waiting_reqs":0},{"dp_rank":1,"num_running_reqs":2,"num_waiting_reqs":0}]}`)
	g, gwSrv := startGateway(t, "--policy=least_load", "--decode-policy=least_load",
		"--engine=url="+p.URL()+",model=m,kind=sglang,stage=prefill,dp_ranks=4,bootstrap_port=8998",
		"--engine=url="+d.URL()+",model=m,kind=sglang,stage=decode,dp_ranks=2", "--load-interval=200ms", "--load-timeout=200ms")
	waitLoad(t, g, p, d)
	resp := post(t, context.Background(), gwSrv.URL+"/v1/chat/completions", chatBody, nil)
	_, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	// The legs run concurrently and a stream is relayed without waiting for the prefill leg: the
	// client's answer can end before the prefill request has reached its engine.
	require.Eventually(t, func() bool { return len(p.Requests()) == 1 }, 5*time.Second, 5*time.Millisecond,
		"the prefill leg reaches the prefill engine")
	require.Len(t, p.Requests(), 1)
	require.Len(t, d.Requests(), 1)
	pr, dr := p.Requests()[0], d.Requests()[0]
	assert.JSONEq(t, `2`, string(pr.Body["routed_dp_rank"]))
	var room uint64
	require.NoError(t, json.Unmarshal(pr.Body["bootstrap_room"], &room))
	assert.Equal(t, uint64(2), room%4, "room mod the prefill DP size is the prefill rank")
	assert.JSONEq(t, string(pr.Body["bootstrap_room"]), string(dr.Body["bootstrap_room"]))
	assert.JSONEq(t, `1`, string(dr.Body["routed_dp_rank"]), "decode: the rank with fewer running requests")
	assert.JSONEq(t, `2`, string(dr.Body["disagg_prefill_dp_rank"]))
}

// lose records a batch in the replay buffer under the next sequence number without sending it:
// the subscriber misses it, as when a PUB socket drops a message under its high-water mark.
func (p *publisher) lose(t *testing.T, events ...any) {
	raw, err := msgpack.Marshal([]any{float64(time.Now().UnixNano()) / 1e9, events, 0})
	require.NoError(t, err)
	p.mu.Lock()
	p.batches = append(p.batches, raw)
	p.mu.Unlock()
}

// promptBlocks returns text's tokens cut to full blocks and n fresh engine hashes from base.
func promptBlocks(text string, block int, base uint64) ([]uint32, []uint64) {
	tokens := fakeengine.Tokens(text)
	full := len(tokens) / block * block
	hashes := make([]uint64, full/block)
	for i := range hashes {
		hashes[i] = base + uint64(i)
	}
	return tokens[:full], hashes
}

// A lost batch is recovered end to end as docs/design.md §13 says: the next batch shows a gap,
// the subscriber fetches the missing batch from the publisher's replay socket, and a prompt
// whose blocks only the lost batch carried is then routed to its holder.
func TestLostBatchIsReplayedEndToEnd(t *testing.T) {
	t.Parallel()
	a, b := newEngine(t), newEngine(t)
	pub, addr, replay := newPublisher(t)
	const block = 4
	g, gwSrv := startGateway(t,
		"--engine=url="+a.URL()+",model=m,kind=vllm,load=none",
		"--engine=url="+b.URL()+",model=m,kind=vllm,load=none,kv_events="+addr+",kv_replay="+replay,
		"--block-tokens=4", "--min-matched-tokens=64")
	bID := state.EngineID(b.URL())
	warm := strings.Repeat("warming up the subscriber with a first prompt. ", 3)
	lost := strings.Repeat("only the lost batch carries this prompt's blocks! ", 3)
	next := strings.Repeat("and this one arrives right after the lost batch. ", 3)
	wt, wh := promptBlocks(warm, block, 1000)
	lt, lh := promptBlocks(lost, block, 2000)
	nt, nh := promptBlocks(next, block, 3000)
	keys := func(tokens []uint32) []uint64 { return g.index.Hasher().Keys(tokens) }

	// In step first: the first batches may be missed while the subscriber connects.
	require.Eventually(t, func() bool {
		pub.publish(t, blockStored(wh, wt, block))
		st := g.kv.sub.Stats().Streams
		return len(st) == 1 && st[0].Trusted && g.index.Match(keys(wt)).Blocks(bID) == len(wh)
	}, 10*time.Second, 20*time.Millisecond)
	pub.mu.Lock()
	last := uint64(len(pub.batches) - 1)
	pub.mu.Unlock()
	require.Eventually(t, func() bool {
		st := g.kv.sub.Stats().Streams[0]
		return st.LastSeq == last && st.Trusted
	}, 10*time.Second, 10*time.Millisecond)
	before := g.kv.sub.Stats().Streams[0]

	pub.lose(t, blockStored(lh, lt, block))
	pub.publish(t, blockStored(nh, nt, block))
	require.Eventually(t, func() bool {
		st := g.kv.sub.Stats().Streams[0]
		return st.LastSeq == last+2 && st.Trusted && st.Replays > before.Replays
	}, 10*time.Second, 10*time.Millisecond, "the gap is replayed")
	after := g.kv.sub.Stats().Streams[0]
	assert.Equal(t, before.Gaps+1, after.Gaps)
	assert.Equal(t, len(lh), g.index.Match(keys(lt)).Blocks(bID), "the lost batch's blocks came from the replay")
	assert.Equal(t, len(nh), g.index.Match(keys(nt)).Blocks(bID))

	chatOK(t, gwSrv.URL, lost, 3)
	assert.Len(t, b.Requests(), 3, "the lost prompt goes to its holder")
	assert.Empty(t, a.Requests())
	assert.Equal(t, float64(3), dispatches(t, g, b.URL(), "cache_candidate"))
}
