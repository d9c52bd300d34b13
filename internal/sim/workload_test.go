package sim

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/state"
)

// tokenLCP returns the number of equal leading token IDs of a and b.
func tokenLCP(a, b []uint32) int {
	n := 0
	for n < min(len(a), len(b)) && a[n] == b[n] {
		n++
	}
	return n
}

// generate returns w's trace for seed, failing the test on error.
func generate(t *testing.T, w Workload, seed uint64) *Trace {
	t.Helper()
	tr, err := w.Generate(seed)
	require.NoError(t, err)
	require.NotEmpty(t, tr.Requests)
	return tr
}

// conversations groups a chats trace's requests by Session, each in arrival (turn) order.
func conversations(t *testing.T, tr *Trace) map[string][]*Request {
	t.Helper()
	convs := map[string][]*Request{}
	for i := range tr.Requests {
		r := &tr.Requests[i]
		require.NotEmpty(t, r.Session, "request %d", i)
		convs[r.Session] = append(convs[r.Session], r)
	}
	return convs
}

func TestWorkloadDeterministicBySeed(t *testing.T) {
	t.Parallel()
	for _, w := range []Workload{
		Chats{Conversations: 40, Turns: 3},
		Chats{Conversations: 40, Turns: 3, SharedSystemPrompt: true},
		PrefixGroups{Groups: 4, PromptsPerGroup: 3, PrefixTokens: 700, QuestionTokens: 90, Requests: 30},
		Tenants{Tenants: 3, Rate: 2, Heavy: 5, Critical: 1, Duration: 5 * time.Second},
		LoRA{Adapters: 5, Zipf: 1.2, Base: 0.3, Requests: 40},
	} {
		t.Run(w.String(), func(t *testing.T) {
			t.Parallel()
			a, b, c := generate(t, w, 7), generate(t, w, 7), generate(t, w, 8)
			assert.Equal(t, a, b, "same seed, same trace")
			assert.Equal(t, w.String()+" (seed 7)", a.Name)
			assert.Equal(t, Format(""), a.Format)
			assert.NotEqual(t, a.Requests, c.Requests, "another seed, another trace")
			assert.NotEqual(t, a.Requests[0].TokenIDs(), c.Requests[0].TokenIDs(), "another seed, other tokens")
			for i := range a.Requests {
				assert.Equal(t, i, a.Requests[i].Index)
				assert.Equal(t, a.Requests[i].TokenIDs(), b.Requests[i].TokenIDs())
			}
		})
	}
}

// TestChatsPrefixStructure: turn k's prompt is turn k−1's prompt, its reply and a new user
// message, token for token; conversations share nothing, or exactly the shared system prompt.
func TestChatsPrefixStructure(t *testing.T) {
	t.Parallel()
	for _, shared := range []bool{false, true} {
		t.Run(fmt.Sprint("shared=", shared), func(t *testing.T) {
			t.Parallel()
			const n, turns = 60, 6
			tr := generate(t, Chats{Conversations: n, Turns: turns, SharedSystemPrompt: shared}, 3)
			require.Len(t, tr.Requests, n*turns)
			require.True(t, slices.IsSortedFunc(tr.Requests, func(a, b Request) int { return cmp.Compare(a.Arrival, b.Arrival) }))
			convs := conversations(t, tr)
			require.Len(t, convs, n)
			var firsts [][]uint32
			for key, reqs := range convs {
				require.Len(t, reqs, turns, key)
				prev := reqs[0].TokenIDs()
				firsts = append(firsts, prev)
				for k := 1; k < turns; k++ {
					cur := reqs[k].TokenIDs()
					require.Len(t, cur, reqs[k].InputTokens)
					assert.Equal(t, prev, cur[:len(prev)], "%s turn %d starts with turn %d's prompt", key, k, k-1)
					user := len(cur) - len(prev) - reqs[k-1].OutputTokens
					assert.GreaterOrEqual(t, user, ChatMessageMinTokens, "%s turn %d user message", key, k)
					assert.LessOrEqual(t, user, ChatMessageMaxTokens, "%s turn %d user message", key, k)
					prev = cur
				}
			}
			// The longest prefix two conversations share: 0, or the shared system prompt.
			shares := map[int]int{}
			for i := range firsts {
				for j := range i {
					shares[tokenLCP(firsts[i], firsts[j])]++
				}
			}
			require.Len(t, shares, 1, "every pair shares the same prefix: %v", shares)
			sys := tr.Requests[0].Segments[0].Tokens
			if shared {
				assert.Equal(t, map[int]int{sys: n * (n - 1) / 2}, shares)
				assert.Positive(t, sys)
			} else {
				assert.Equal(t, map[int]int{0: n * (n - 1) / 2}, shares)
			}
		})
	}
}

// TestChatsLengthBounds: over many conversations the lengths fill their documented ranges and
// never leave them.
func TestChatsLengthBounds(t *testing.T) {
	t.Parallel()
	tr := generate(t, Chats{Conversations: 2000, Turns: 2}, 1)
	minFirst, maxFirst := math.MaxInt, 0
	minOut, maxOut := math.MaxInt, 0
	for _, reqs := range conversations(t, tr) {
		first := reqs[0]
		require.Len(t, first.Segments, 1)
		minFirst, maxFirst = min(minFirst, first.InputTokens), max(maxFirst, first.InputTokens)
		for _, r := range reqs {
			minOut, maxOut = min(minOut, r.OutputTokens), max(maxOut, r.OutputTokens)
		}
	}
	// A first prompt is a system prompt in [0, 1100] and a message in [50, 300].
	assert.GreaterOrEqual(t, minFirst, ChatMessageMinTokens)
	assert.Less(t, minFirst, ChatMessageMinTokens+50, "short system prompts and messages occur")
	assert.LessOrEqual(t, maxFirst, ChatSystemPromptMaxTokens+ChatMessageMaxTokens)
	assert.Greater(t, maxFirst, ChatSystemPromptMaxTokens+ChatMessageMaxTokens-60, "long ones too")
	assert.Equal(t, ChatMessageMinTokens, minOut)
	assert.Equal(t, ChatMessageMaxTokens, maxOut)
}

// TestChatsArrivals: conversation starts are Poisson at Rate, and each later turn arrives the
// idle service estimate of the previous turn plus an exponential think time of mean Think later.
func TestChatsArrivals(t *testing.T) {
	t.Parallel()
	c := Chats{Conversations: 20000, Turns: 2, Rate: 8, Think: 3 * time.Second}
	tr := generate(t, c, 11)
	m := DefaultEngineModel()
	var starts []float64
	var thinks []float64
	for key, reqs := range conversations(t, tr) {
		starts = append(starts, reqs[0].Arrival.Seconds())
		est := idleServiceSeconds(&m, reqs[0].InputTokens, 0, reqs[0].OutputTokens)
		think := (reqs[1].Arrival - reqs[0].Arrival).Seconds() - est
		require.GreaterOrEqual(t, think, -1e-9, key)
		thinks = append(thinks, think)
	}
	slices.Sort(starts)
	var gaps float64
	prev := 0.0
	for _, s := range starts {
		gaps += s - prev
		prev = s
	}
	assert.InDelta(t, 1/c.Rate, gaps/float64(len(starts)), 0.03/c.Rate, "mean gap between conversation starts")
	var sum float64
	for _, th := range thinks {
		sum += th
	}
	assert.InDelta(t, c.Think.Seconds(), sum/float64(len(thinks)), 0.03*c.Think.Seconds(), "mean think time")
}

func TestIdleServiceSeconds(t *testing.T) {
	t.Parallel()
	m := DefaultEngineModel()
	// 1,000 uncached tokens, then 9 decode steps alone over 1,001…1,009 tokens of context.
	want := 1000/m.PrefillLinearTokensPerSecond + 1000.0*1001/2/m.PrefillAttentionPairsPerSecond +
		9*m.DecodeStepBase.Seconds() + (9*1000+9*10/2.0)*m.kvTokenSeconds()
	assert.InDelta(t, want, idleServiceSeconds(&m, 1000, 0, 10), 1e-12)
	assert.InDelta(t, m.prefillSeconds(200, 800), idleServiceSeconds(&m, 1000, 800, 1), 1e-12, "one token: prefill only")
}

// TestPrefixGroupsStructure: requests of one group share exactly the prefix, prompts are a
// shuffled list sent in turn, and every request has the configured lengths.
func TestPrefixGroupsStructure(t *testing.T) {
	t.Parallel()
	g := PrefixGroups{Groups: 5, PromptsPerGroup: 4, PrefixTokens: 1000, QuestionTokens: 37, OutputTokens: 9, Requests: 50}
	tr := generate(t, g, 2)
	require.Len(t, tr.Requests, 50)
	toks := make([][]uint32, len(tr.Requests))
	for i := range tr.Requests {
		r := &tr.Requests[i]
		assert.Equal(t, 1037, r.InputTokens)
		assert.Equal(t, 9, r.OutputTokens)
		assert.Empty(t, r.SessionKey())
		require.Len(t, r.Segments, 2)
		toks[i] = r.TokenIDs()
	}
	prompts := map[[2]uint64]int{}
	groups := map[uint64]bool{}
	for i := range tr.Requests {
		s := tr.Requests[i].Segments
		prompts[[2]uint64{s[0].Stream, s[1].Stream}]++
		groups[s[0].Stream] = true
		if i >= 20 {
			assert.Equal(t, tr.Requests[i-20].Segments, s, "request %d repeats prompt %d", i, i-20)
		}
		for j := range i {
			want := 0
			switch {
			case slices.Equal(tr.Requests[j].Segments, s):
				want = 1037
			case tr.Requests[j].Segments[0] == s[0]:
				want = 1000
			}
			assert.Equal(t, want, tokenLCP(toks[i], toks[j]), "requests %d and %d", j, i)
		}
	}
	assert.Len(t, prompts, 20, "groups × prompts distinct prompts")
	assert.Len(t, groups, 5)
	inOrder := true
	for i := 1; i < 20; i++ {
		inOrder = inOrder && tr.Requests[i].Segments[0].Stream == tr.Requests[(i/4)*4].Segments[0].Stream
	}
	assert.False(t, inOrder, "the prompts are shuffled, not sent group by group")
}

func TestPrefixGroupsArrivals(t *testing.T) {
	t.Parallel()
	g := PrefixGroups{Groups: 2, PromptsPerGroup: 2, PrefixTokens: 10, QuestionTokens: 10, Requests: 40000, Rate: 25}
	tr := generate(t, g, 5)
	last := tr.Requests[len(tr.Requests)-1].Arrival.Seconds()
	assert.InDelta(t, 1/g.Rate, last/float64(len(tr.Requests)), 0.03/g.Rate, "mean gap between arrivals")
}

// bruteForceHits returns, for every request, the longest common token prefix with any earlier
// request's prompt.
func bruteForceHits(tr *Trace) (hits, tokens int64) {
	var prompts [][]uint32
	for i := range tr.Requests {
		cur := tr.Requests[i].TokenIDs()
		best := 0
		for _, p := range prompts {
			best = max(best, tokenLCP(cur, p))
		}
		hits += int64(best)
		tokens += int64(len(cur))
		prompts = append(prompts, cur)
	}
	return hits, tokens
}

// TestInfiniteCacheGenerated: the infinite-cache limit of a generated trace is exact at token
// granularity, and the replay's report prints it.
func TestInfiniteCacheGenerated(t *testing.T) {
	t.Parallel()
	for _, w := range []Workload{
		Chats{Conversations: 25, Turns: 4},
		Chats{Conversations: 25, Turns: 4, SharedSystemPrompt: true},
		PrefixGroups{Groups: 3, PromptsPerGroup: 4, PrefixTokens: 900, QuestionTokens: 50, OutputTokens: 20, Requests: 30},
	} {
		t.Run(w.String(), func(t *testing.T) {
			t.Parallel()
			tr := generate(t, w, 4)
			hits, tokens := bruteForceHits(tr)
			require.Positive(t, hits)
			got := tr.InfiniteCache()
			assert.Equal(t, CacheStats{Tokens: tokens, HitTokens: hits}, got)

			rep, err := Replay(context.Background(), Config{Trace: tr, Fleet: Fleet{Plain: 2}, Policies: []string{NameRoundRobin},
				Model: EngineModel{BlockTokens: WorkloadBlockTokens}})
			require.NoError(t, err)
			assert.InDelta(t, float64(hits)/float64(tokens), rep.InfiniteCacheHitRate, 1e-15)
			assert.Equal(t, len(tr.Requests), rep.Results[0].Completed)
			assert.Positive(t, rep.Results[0].CachedTokens)
		})
	}
}

func TestInfiniteCacheSegmentRules(t *testing.T) {
	t.Parallel()
	seg := func(stream uint64, tokens int) Segment { return Segment{Stream: stream, Tokens: tokens} }
	req := func(in int, segs ...Segment) Request {
		if segs == nil {
			segs = []Segment{}
		}
		return Request{InputTokens: in, Segments: segs}
	}
	tests := []struct {
		name string
		reqs []Request
		hits int64
	}{
		{"first request never hits", []Request{req(10, seg(1, 10))}, 0},
		{"a shorter run of one stream hits whole", []Request{req(10, seg(1, 10)), req(6, seg(1, 6))}, 6},
		{"a longer run hits the earlier length", []Request{req(6, seg(1, 6)), req(10, seg(1, 10))}, 6},
		{"the longest earlier run counts", []Request{req(10, seg(1, 10)), req(6, seg(1, 6)), req(10, seg(1, 10))}, 6 + 10},
		{"after a whole segment the next one matches", []Request{req(15, seg(1, 10), seg(2, 5)), req(13, seg(1, 10), seg(2, 3))}, 13},
		{"after a partly matched segment nothing does", []Request{req(15, seg(1, 10), seg(2, 5)), req(13, seg(1, 8), seg(2, 5))}, 8},
		{"an earlier longer run does not continue into a new segment", []Request{req(20, seg(1, 20)), req(15, seg(1, 10), seg(2, 5))}, 10},
		{"segments match only at the same position", []Request{req(5, seg(2, 5)), req(15, seg(1, 10), seg(2, 5))}, 0},
		{"empty segments are skipped", []Request{req(15, seg(1, 10), seg(2, 5)), req(15, seg(1, 10), seg(3, 0), seg(2, 5))}, 15},
		{"segments cut to InputTokens", []Request{req(8, seg(1, 10), seg(2, 5)), req(12, seg(1, 8), seg(2, 4))}, 8},
		{"tokens past the segments never hit", []Request{req(9, seg(1, 5)), req(9, seg(1, 5))}, 5},
		{"the best of several earlier prompts", []Request{req(7, seg(1, 3), seg(4, 4)), req(9, seg(1, 3), seg(5, 6)), req(9, seg(1, 3), seg(5, 2), seg(6, 4))}, 3 + 5},
		{"requests without segments are not counted", []Request{{InputTokens: 30}, req(3, seg(1, 3))}, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			tr := &Trace{Requests: tt.reqs}
			var tokens int64
			for _, r := range tt.reqs {
				if r.Segments != nil {
					tokens += int64(r.InputTokens)
				}
			}
			assert.Equal(t, CacheStats{Tokens: tokens, HitTokens: tt.hits}, tr.InfiniteCache())
			for i := range tr.Requests {
				tr.Requests[i].Index = i
			}
			withSegments := slices.DeleteFunc(slices.Clone(tr.Requests), func(r Request) bool { return r.Segments == nil })
			hits, _ := bruteForceHits(&Trace{Requests: withSegments})
			assert.Equal(t, tt.hits, hits, "brute force over the token IDs agrees")
		})
	}
}

func TestSegmentTokenIDs(t *testing.T) {
	t.Parallel()
	a := (&Request{InputTokens: 700, Segments: []Segment{{Stream: 1, Tokens: 600}, {Stream: 2, Tokens: 100}}}).TokenIDs()
	b := (&Request{InputTokens: 650, Segments: []Segment{{Stream: 1, Tokens: 650}}}).TokenIDs()
	c := (&Request{InputTokens: 100, Segments: []Segment{{Stream: 2, Tokens: 100}}}).TokenIDs()
	require.Len(t, a, 700)
	assert.Equal(t, 600, tokenLCP(a, b), "one stream, one run")
	assert.Equal(t, c, a[600:], "a segment is its stream's start wherever it sits")
	mooncake := (&Request{InputTokens: 512, HashIDs: []uint64{1}}).TokenIDs()
	assert.Zero(t, tokenLCP(mooncake, b), "segment streams are not Mooncake block streams")
	for _, id := range a {
		require.Less(t, id, uint32(VocabSize))
	}
	short := (&Request{Index: 3, InputTokens: 20, Segments: []Segment{{Stream: 1, Tokens: 5}}}).TokenIDs()
	assert.Equal(t, b[:5], short[:5])
	assert.Equal(t, (&Request{Index: 3, InputTokens: 15}).TokenIDs(), short[5:], "the rest comes from the Index stream")
}

func TestReplayRejectsBadSegments(t *testing.T) {
	t.Parallel()
	for _, r := range []Request{
		{InputTokens: 10, Segments: []Segment{{Stream: 1, Tokens: 9}}},
		{InputTokens: 10, Segments: []Segment{{Stream: 1, Tokens: 11}, {Stream: 2, Tokens: -1}}},
		{InputTokens: 10, Segments: []Segment{}},
		{InputTokens: 512, Segments: []Segment{{Stream: 1, Tokens: 512}}, HashIDs: []uint64{1}},
	} {
		_, err := Replay(context.Background(), Config{Trace: &Trace{Requests: []Request{r}}, Fleet: Fleet{Plain: 1}})
		var re *RequestError
		require.ErrorAs(t, err, &re, "%+v", r)
		assert.ErrorIs(t, err, ErrSegmentMismatch)
	}
}

func TestTraceCloneSegments(t *testing.T) {
	t.Parallel()
	tr := generate(t, PrefixGroups{Groups: 2, PromptsPerGroup: 2, Requests: 6}, 1)
	tr.Requests = append(tr.Requests, Request{Index: 6, Arrival: time.Hour, InputTokens: 0, Segments: []Segment{}})
	c := tr.Clone()
	require.Equal(t, tr, c)
	assert.NotNil(t, c.Requests[6].Segments, "empty Segments stay non-nil")
	c.Requests[0].Segments[0].Tokens = 1
	assert.Equal(t, DefaultPrefixTokens, tr.Requests[0].Segments[0].Tokens)
	assert.Equal(t, DefaultPrefixTokens, tr.Requests[4].Segments[0].Tokens, "the original is untouched")
}

func TestChatsSessionKeys(t *testing.T) {
	t.Parallel()
	tr := generate(t, Chats{Conversations: 3, Turns: 2}, 1)
	keys := map[string]int{}
	for i := range tr.Requests {
		keys[tr.Requests[i].SessionKey()]++
	}
	assert.Equal(t, map[string]int{"conv-0": 2, "conv-1": 2, "conv-2": 2}, keys)
}

func TestParseWorkload(t *testing.T) {
	t.Parallel()
	tests := []struct {
		spec string
		want Workload
	}{
		{"chats", Chats{}.filled()},
		{"chats:turns=3", Chats{Turns: 3}.filled()},
		{"chats:conversations=10,rate=0.5,think=250ms,shared-system=true",
			Chats{Conversations: 10, Rate: 0.5, Think: 250 * time.Millisecond, SharedSystemPrompt: true}.filled()},
		{"prefix-groups", PrefixGroups{}.filled()},
		{"prefix-groups:groups=32,prompts=32,prefix=2048,question=256,output=256,requests=100,rate=1e1",
			PrefixGroups{Groups: 32, PromptsPerGroup: 32, PrefixTokens: 2048, QuestionTokens: 256, OutputTokens: 256, Requests: 100, Rate: 10}},
		{"tenants", Tenants{Heavy: DefaultTenantHeavy, Critical: DefaultTenantCritical}.filled()},
		{"tenants:heavy=0,critical=0", Tenants{}.filled()},
		{"tenants:tenants=8,rate=2.5,heavy=1,critical=0.25,duration=90s",
			Tenants{Tenants: 8, Rate: 2.5, Heavy: 1, Critical: 0.25, Duration: 90 * time.Second}},
		{"lora", LoRA{Zipf: DefaultLoRAZipf}.filled()},
		{"lora:zipf=0", LoRA{}.filled()},
		{"lora:adapters=16,zipf=0.8,base=0.5,requests=300,rate=12.5",
			LoRA{Adapters: 16, Zipf: 0.8, Base: 0.5, Requests: 300, Rate: 12.5}},
	}
	for _, tt := range tests {
		w, err := ParseWorkload(tt.spec)
		require.NoError(t, err, tt.spec)
		assert.Equal(t, tt.want, w, tt.spec)
		again, err := ParseWorkload(w.String())
		require.NoError(t, err, w.String())
		assert.Equal(t, w, again, "the canonical spec reads back")
	}
	assert.Equal(t, "chats:conversations=5000,turns=5,rate=45,think=5s,shared-system=false", Chats{}.String())
	assert.Equal(t, "prefix-groups:groups=150,prompts=5,prefix=6000,question=1200,output=1000,requests=3000,rate=20",
		PrefixGroups{}.String())
	assert.Equal(t, "tenants:tenants=4,rate=25,heavy=0,critical=0,duration=1m0s", Tenants{}.String())
	assert.Equal(t, fmt.Sprintf("lora:adapters=64,zipf=0,base=0,requests=%d,rate=%g", DefaultLoRARequests, DefaultLoRARate),
		LoRA{}.String())
}

func TestParseWorkloadRejects(t *testing.T) {
	t.Parallel()
	tests := []struct {
		spec, msg string
	}{
		{"", `unknown workload ""`},
		{"chat", `unknown workload "chat" (known: chats, prefix-groups, tenants, lora)`},
		{"chats:", `parameter "" is not key=value`},
		{"chats:turns", `parameter "turns" is not key=value`},
		{"chats:turns=2,", `parameter "" is not key=value`},
		{"chats:groups=2", `unknown parameter "groups" (known: conversations, turns, rate, think, shared-system)`},
		{"chats:turns=2,turns=3", `parameter "turns" given twice`},
		{"chats:turns=0", `turns="0": must be >= 1`},
		{"chats:turns=-1", `turns="-1": want a decimal integer`},
		{"chats:turns=+1", `turns="+1": want a decimal integer`},
		{"chats:turns= 1", `turns=" 1": want a decimal integer`},
		{"chats:turns=1234567890", `want a decimal integer of at most 9 digits`},
		{"chats:turns=1001", `turns 1001: must be in [1, 1000]`},
		{"chats:conversations=1000000,turns=2", `conversations 1000000: must be in [1, 500000] with 2 turns`},
		{"chats:rate=0", `rate="0": want a positive finite number`},
		{"chats:rate=NaN", `rate="NaN": want a positive finite number`},
		{"chats:rate=inf", `rate="inf": want a positive finite number`},
		{"chats:think=0s", `think="0s": want a positive duration`},
		{"chats:think=5", `think="5": want a positive duration`},
		{"chats:think=9000h", `think 9000h0m0s: must be in (0, 8760h0m0s]`},
		{"chats:shared-system=yes", `shared-system="yes": want true or false`},
		{"prefix-groups:prefix=10000000,question=1", `prefix 10000000 + question 1 tokens`},
		{"prefix-groups:output=10000001", `output 10000001: must be in [0, 10000000]`},
		{"prefix-groups:groups=1000,prompts=1001", `prompts 1001: must be in [1, 1000] with 1000 groups`},
		{"prefix-groups:requests=1000001", `requests 1000001: must be in [1, 1000000]`},
		{"prefix-groups:prompts=0", `prompts="0": must be >= 1`},
		{"prefix-groups:rate=-2", `rate="-2": want a positive finite number`},
		{"tenants:tenants=0", `tenants="0": must be >= 1`},
		{"tenants:tenants=1001", `tenants 1001: must be in [1, 1000]`},
		{"tenants:heavy=-1", `heavy="-1": want a finite number >= 0`},
		{"tenants:critical=NaN", `critical="NaN": want a finite number >= 0`},
		{"tenants:critical=inf", `critical="inf": want a finite number >= 0`},
		{"tenants:rate=0", `rate="0": want a positive finite number`},
		{"tenants:duration=0s", `duration="0s": want a positive duration`},
		{"tenants:duration=9000h", `duration 9000h0m0s: must be in (0, 8760h0m0s]`},
		{"tenants:tenants=1,heavy=0,critical=0", `no tenant sends`},
		{"tenants:rate=1000,duration=1h", `49320000 requests expected: must be at most 500000`},
		{"tenants:users=3", `unknown parameter "users" (known: tenants, rate, heavy, critical, duration)`},
		{"lora:adapters=0", `adapters="0": must be >= 1`},
		{"lora:adapters=10001", `adapters 10001: must be in [1, 10000]`},
		{"lora:zipf=-1", `zipf="-1": want a finite number >= 0`},
		{"lora:zipf=inf", `zipf="inf": want a finite number >= 0`},
		{"lora:base=1.5", `base="1.5": want a share in [0, 1]`},
		{"lora:base=NaN", `base="NaN": want a finite number >= 0`},
		{"lora:requests=1000001", `requests 1000001: must be in [1, 1000000]`},
		{"lora:rate=0", `rate="0": want a positive finite number`},
		{"lora:loras=3", `unknown parameter "loras" (known: adapters, zipf, base, requests, rate)`},
	}
	for _, tt := range tests {
		w, err := ParseWorkload(tt.spec)
		assert.Nil(t, w, tt.spec)
		require.Error(t, err, tt.spec)
		assert.ErrorIs(t, err, ErrBadWorkload, tt.spec)
		assert.ErrorIs(t, err, state.ErrInvalidConfiguration, tt.spec)
		assert.Contains(t, err.Error(), tt.msg, tt.spec)
		assert.Equal(t, 1, countSubstr(err.Error(), "sim: "), "one prefix: %s", err)
	}
}

func countSubstr(s, sub string) int {
	n := 0
	for i := 0; i+len(sub) <= len(s); i++ {
		if s[i:i+len(sub)] == sub {
			n++
		}
	}
	return n
}

func TestWorkloadGenerateRejects(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		w    Workload
		also error
	}{
		{Chats{Turns: -1}, nil},
		{Chats{Rate: math.Inf(1)}, nil},
		{Chats{Think: -time.Second}, nil},
		{PrefixGroups{QuestionTokens: -1}, nil},
		{PrefixGroups{Rate: math.NaN()}, nil},
		{Chats{Conversations: 3, Turns: 1, Rate: 1e-8}, ErrOutOfRange},
		{PrefixGroups{Requests: 2, Rate: 1e-8}, ErrOutOfRange},
		{Tenants{Heavy: -1}, nil},
		{Tenants{Rate: math.Inf(1)}, nil},
		{Tenants{Critical: math.NaN()}, nil},
		{Tenants{Tenants: 1}, nil},
		{Tenants{Rate: 1e-9, Duration: time.Second}, nil}, // no request arrives
		{LoRA{Adapters: -1}, nil},
		{LoRA{Zipf: math.Inf(1)}, nil},
		{LoRA{Base: 1.01}, nil},
		{LoRA{Base: math.NaN()}, nil},
		{LoRA{Requests: 2, Rate: 1e-8}, ErrOutOfRange},
	} {
		tr, err := tt.w.Generate(1)
		assert.Nil(t, tr)
		assert.ErrorIs(t, err, ErrBadWorkload, "%+v", tt.w)
		if tt.also != nil {
			assert.ErrorIs(t, err, tt.also, "%+v", tt.w)
		}
		assert.False(t, errors.Is(err, ErrSegmentMismatch))
	}
}

// FuzzParseWorkload: any spec either parses into a workload whose canonical spec reads back to
// the same workload, or fails with ErrBadWorkload and a nil workload.
func FuzzParseWorkload(f *testing.F) {
	for _, s := range []string{"chats", "prefix-groups", "chats:turns=3,rate=2.5,think=1m30s,shared-system=1",
		"prefix-groups:groups=32,prompts=32,prefix=2048,question=256,output=256", "chats:", "chats:turns",
		"chats:turns=0", "chats:rate=1e309", "chats:think=-1s", "prefix-groups:prefix=9999999,question=2",
		"chats:conversations=999999999", "prefix-groups:rate=0x1p-3", "tenants", "tenants:tenants=2,rate=3,heavy=0,critical=0.5,duration=2s",
		"tenants:heavy=-0", "tenants:tenants=1,heavy=0,critical=0", "lora", "lora:adapters=3,zipf=2,base=1,requests=9,rate=0.5",
		"lora:base=1.0000001", ":", ",", "=", ""} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, spec string) {
		w, err := ParseWorkload(spec)
		if err != nil {
			if !errors.Is(err, ErrBadWorkload) || !errors.Is(err, state.ErrInvalidConfiguration) {
				t.Fatalf("ParseWorkload(%q) error %v does not wrap ErrBadWorkload", spec, err)
			}
			if w != nil {
				t.Fatalf("ParseWorkload(%q) = %v with an error", spec, w)
			}
			return
		}
		back, err := ParseWorkload(w.String())
		if err != nil || back != w {
			t.Fatalf("round trip of %q via %q: %v, %v", spec, w.String(), back, err)
		}
		switch w := w.(type) {
		case Chats:
			if w.validate() != nil || w.Conversations*w.Turns > MaxWorkloadRequests {
				t.Fatalf("ParseWorkload(%q) = %+v out of range", spec, w)
			}
		case PrefixGroups:
			if w.validate() != nil {
				t.Fatalf("ParseWorkload(%q) = %+v out of range", spec, w)
			}
		case Tenants:
			if w.validate() != nil {
				t.Fatalf("ParseWorkload(%q) = %+v out of range", spec, w)
			}
		case LoRA:
			if w.validate() != nil {
				t.Fatalf("ParseWorkload(%q) = %+v out of range", spec, w)
			}
		default:
			t.Fatalf("ParseWorkload(%q) returned a %T", spec, w)
		}
	})
}

// TestDefaultWorkloadLimits pins the default workloads at seed 1, the figures docs/traces.md
// gives: requests, prompt tokens and the infinite-cache hit limit.
func TestDefaultWorkloadLimits(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		w        Workload
		requests int
		want     CacheStats
	}{
		{Chats{}, 25000, CacheStats{Tokens: 35477989, HitTokens: 24879950}},
		{Chats{SharedSystemPrompt: true}, 25000, CacheStats{Tokens: 39749586, HitTokens: 31896835}},
		// The first pass over the 750 prompts hits the prefix of all but each group's first
		// request; the three passes after it hit whole prompts.
		{PrefixGroups{}, 3000, CacheStats{Tokens: 3000 * 7200, HitTokens: 600*6000 + 2250*7200}},
		{Tenants{Heavy: DefaultTenantHeavy, Critical: DefaultTenantCritical}, 20683, CacheStats{Tokens: 19351345, HitTokens: 15714006}},
	} {
		tr := generate(t, tt.w, 1)
		assert.Len(t, tr.Requests, tt.requests, tt.w.String())
		assert.Equal(t, tt.want, tr.InfiniteCache(), tt.w.String())
	}
}
