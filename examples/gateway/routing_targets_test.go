package main

import (
	"fmt"
	"math/rand/v2"
	"net/http"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/internal/testengine"
	"github.com/enginepick/enginepick/state"
)

// The fleet of TestRoutingTargets: four vLLM-like engines of four running requests each, a prefill
// priced per uncached prompt token (a 1,100-token prompt takes 110 ms uncached, a few ms cached)
// and 16 output tokens of 1 ms each.
const (
	rtEngines    = 4
	rtMaxNumSeqs = 4
	rtPrefill    = 100 * time.Microsecond
	rtDecode     = time.Millisecond
)

// rtPolicies are the policies compared; cache_aware is measured against the other two.
var rtPolicies = []string{"round_robin", "power_of_two", "cache_aware"}

// rtResult is what one policy achieved on one workload.
type rtResult struct {
	policy    string
	latencies []time.Duration // end-to-end, whole answer read, sorted
	prompt    int             // prompt tokens the engines received
	cached    int             // of them, served from the engines' prefix caches
	perEngine []int           // chat requests each engine served
}

// add returns r with o's requests added: latencies merged and sorted, tokens summed, per-engine
// counts summed engine by engine (every run has rtEngines engines).
func (r rtResult) add(o rtResult) rtResult {
	r.policy = o.policy
	r.latencies = slices.Concat(r.latencies, o.latencies)
	slices.Sort(r.latencies)
	r.prompt += o.prompt
	r.cached += o.cached
	sum := slices.Clone(o.perEngine)
	for i, n := range r.perEngine {
		sum[i] += n
	}
	r.perEngine = sum
	return r
}

func (r rtResult) hitRate() float64 { return float64(r.cached) / float64(r.prompt) }

func (r rtResult) String() string {
	return fmt.Sprintf("%-12s p50 %6.1f ms  p99 %6.1f ms  hit rate %5.1f%% (%d of %d tokens)  requests per engine %v",
		r.policy, ms(pct(r.latencies, 0.5)), ms(pct(r.latencies, 0.99)), 100*r.hitRate(), r.cached, r.prompt, r.perEngine)
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// rtConversation is one chat of a workload: an optional system prompt, then one user message per
// turn; each turn sends the whole conversation so far, the earlier replies included.
type rtConversation struct {
	system string
	turns  []string
}

// runFleet starts the fleet behind a gateway routing with policy (load polled every 100 ms from
// the engines' /metrics, which report running and waiting requests only; with cache_aware, the
// engines' KV events followed and the gateway's other settings at their defaults), runs every
// conversation concurrently, its turns in order, and returns the measured figures and each
// conversation's prompts in turn order (the chat template applied).
func runFleet(t *testing.T, policy string, convs []rtConversation) (rtResult, [][]string) {
	t.Helper()
	engines := make([]*testengine.Engine, rtEngines)
	args := []string{"--policy=" + policy, "--block-tokens=16", "--load-interval=100ms", "--load-timeout=100ms"}
	for i := range engines {
		e, err := testengine.Start(testengine.Options{Model: e2eModel, MaxNumSeqs: rtMaxNumSeqs,
			PrefillPerToken: rtPrefill, DecodePerToken: rtDecode})
		require.NoError(t, err)
		t.Cleanup(func() { assert.NoError(t, e.Close()) }) // after the gateway's cleanup
		engines[i] = e
		spec := fmt.Sprintf("--engine=url=%s,model=%s,kind=vllm", e.URL(), e2eModel)
		if policy == "cache_aware" {
			spec += ",kv_events=" + e.KVEndpoint(0) + ",kv_replay=" + e.ReplayEndpoint(0)
		}
		args = append(args, spec)
	}
	g, srv := startGateway(t, args...)
	if policy == "cache_aware" {
		warmUp(t, g, engines)
	}
	// Every engine's load is known before the first chat.
	require.Eventually(t, func() bool {
		snap := g.table.Snapshot()
		for _, e := range engines {
			if _, ok := snap.Load(state.EngineID(e.URL())); !ok {
				return false
			}
		}
		return true
	}, 5*time.Second, 5*time.Millisecond)

	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: len(convs)}}
	defer client.CloseIdleConnections()
	lat := make([][]time.Duration, len(convs))
	prompts := make([][]string, len(convs))
	errs := make([]error, len(convs))
	var wg sync.WaitGroup
	for c, conv := range convs {
		wg.Go(func() {
			var msgs []testengine.Message
			if conv.system != "" {
				msgs = append(msgs, testengine.Message{Role: "system", Content: conv.system})
			}
			for turn, q := range conv.turns {
				msgs = append(msgs, testengine.Message{Role: "user", Content: q})
				start := time.Now()
				answer, _, err := chatTurn(client, srv.URL, msgs, c%2 == 1)
				if err != nil {
					errs[c] = fmt.Errorf("conversation %d turn %d: %w", c, turn, err)
					return
				}
				lat[c] = append(lat[c], time.Since(start))
				prompts[c] = append(prompts[c], testengine.ChatPrompt(msgs, true))
				msgs = append(msgs, testengine.Message{Role: "assistant", Content: answer})
			}
		})
	}
	wg.Wait()
	for _, err := range errs {
		require.NoError(t, err)
	}

	r := rtResult{policy: policy, latencies: slices.Concat(lat...)}
	slices.Sort(r.latencies)
	for i, e := range engines {
		n := 0
		for _, q := range e.Requests() {
			if q.Path != "/v1/chat/completions" {
				continue // the warm-up's
			}
			require.True(t, q.Completed, "engine %d", i)
			n++
			r.prompt += q.PromptTokens
			r.cached += q.CachedTokens
		}
		r.perEngine = append(r.perEngine, n)
	}
	return r, prompts
}

// bestHitRate is the hit rate of a fleet that keeps each conversation on one engine with a cache
// that never evicts: each prompt is served the longest prefix it shares with the conversation's
// earlier prompts, in whole blocks, short of the block holding its last token (servedPrefix).
// Conversations share no block, so no engine could serve more.
func bestHitRate(prompts [][]string) float64 {
	var total, best int
	for _, conv := range prompts {
		var earlier [][]uint32
		for _, text := range conv {
			p := testengine.Tokenize(text)
			total += len(p)
			best += servedPrefix(earlier, p)
			earlier = append(earlier, p)
		}
	}
	return float64(best) / float64(total)
}

// sharedPromptChats is workload (a): 16 chats of 4 turns, all sharing a system prompt of 1,100
// tokens, each asking its own questions of 10 to 30 words.
func sharedPromptChats() []rtConversation {
	rng := rand.New(rand.NewPCG(20_26, 1))
	system := "You" + " " + e2eWords(rng, 1099) // 1,100 tokens: every word is one token
	convs := make([]rtConversation, 16)
	for c := range convs {
		convs[c].system = system
		for turn := range 4 {
			convs[c].turns = append(convs[c].turns, fmt.Sprintf("Chat %d, question %d: %s?", c, turn, e2eWords(rng, 10+rng.IntN(21))))
		}
	}
	return convs
}

// shortChats is workload (b): 20 chats of 5 turns without a system prompt, each user message 50 to
// 300 words (one token each).
func shortChats() []rtConversation {
	rng := rand.New(rand.NewPCG(20_26, 2))
	convs := make([]rtConversation, 20)
	for c := range convs {
		for turn := range 5 {
			convs[c].turns = append(convs[c].turns, fmt.Sprintf("Chat %d, turn %d: %s", c, turn, e2eWords(rng, 44+rng.IntN(251))))
		}
	}
	return convs
}

// rtTarget is one target of TestRoutingTargets. notMet, when set, records why today's policy
// misses the target, with the figures measured: the target's subtest is skipped, the measurement
// still runs and is logged. Clear it once the policy meets the target.
type rtTarget struct {
	name   string
	notMet string
	check  func(t *testing.T)
}

// runTargets runs each target as a subtest.
func runTargets(t *testing.T, targets []rtTarget) {
	t.Helper()
	for _, tg := range targets {
		t.Run(tg.name, func(t *testing.T) {
			if tg.notMet != "" {
				t.Skip("target not met yet: " + tg.notMet)
			}
			tg.check(t)
		})
	}
}

// TestRoutingTargets measures round_robin, power_of_two and cache_aware through the gateway (its
// default settings but a 100 ms load poll) on the fleet above, logs each policy's figures and
// checks cache_aware's targets:
//
//   - shared system prompt (16 concurrent chats of 4 turns, a 1,100-token system prompt):
//     cache_aware's p50 and p99 end-to-end latencies at most 1.1 × the better of the other two
//     policies', and its hit rate (the engines' own cached tokens over prompt tokens) at least
//     theirs; each policy runs three times, the runs of the policies interleaved, and its
//     figures are over the three runs' 192 requests (one run's p99 is its slowest request, and a
//     busy moment of the machine would land on one policy alone);
//   - short chats (20 concurrent chats of 5 turns, 50 to 300 tokens a turn, no system prompt):
//     cache_aware's hit rate at least 90 % of the best possible, that of keeping each chat on one
//     engine whose cache never evicts.
//
// The policies run one after the other, on fresh engines, and the test runs alone (not parallel),
// so that their latencies are comparable. Under the race detector the fleet is CPU-bound and the
// latency and short-chat hit-rate targets are skipped; the others still hold.
func TestRoutingTargets(t *testing.T) {
	if testing.Short() && raceEnabled {
		t.Skip("six fleet runs take 20 to 30 s under the race detector")
	}
	t.Run("shared system prompt", func(t *testing.T) {
		convs := sharedPromptChats()
		res := map[string]rtResult{}
		rounds := 3
		if raceEnabled {
			rounds = 1 // its latency targets are skipped under the race detector
		}
		for range rounds {
			for _, p := range rtPolicies {
				r, _ := runFleet(t, p, convs)
				t.Log(r)
				res[p] = res[p].add(r)
			}
		}
		for _, p := range rtPolicies {
			t.Logf("over %d runs: %v", rounds, res[p])
		}
		ca, rr, p2 := res["cache_aware"], res["round_robin"], res["power_of_two"]
		latency := func(q float64) func(t *testing.T) {
			return func(t *testing.T) {
				if raceEnabled {
					t.Skip("the race detector makes the fleet CPU-bound: latencies measure the CPU, not the routing")
				}
				best := min(pct(rr.latencies, q), pct(p2.latencies, q))
				assert.LessOrEqual(t, pct(ca.latencies, q), best*11/10, "cache_aware p%.0f against 1.1 × the better of the others", 100*q)
			}
		}
		runTargets(t, []rtTarget{
			{name: "p50", check: latency(0.5)},
			{name: "p99", check: latency(0.99)},
			{name: "hit rate", check: func(t *testing.T) {
				assert.GreaterOrEqual(t, ca.hitRate(), max(rr.hitRate(), p2.hitRate()), "cache_aware hit rate against the others'")
			}},
		})
	})
	t.Run("short chats", func(t *testing.T) {
		convs := shortChats()
		var ca rtResult
		var prompts [][]string
		for _, p := range rtPolicies {
			r, sent := runFleet(t, p, convs)
			t.Log(r)
			if prompts != nil {
				require.Equal(t, prompts, sent, "every policy sends the same prompts: a reply is a function of its prompt")
			}
			prompts = sent
			if p == "cache_aware" {
				ca = r
			}
		}
		best := bestHitRate(prompts)
		t.Logf("best possible hit rate %.1f%%", 100*best)
		runTargets(t, []rtTarget{{name: "hit rate", check: func(t *testing.T) {
			if raceEnabled {
				t.Skip("the race detector makes the fleet CPU-bound: KV events reach the router after the next turn is routed (58-65 % measured); .ci/run checks this target without it")
			}
			assert.GreaterOrEqual(t, ca.hitRate(), 0.9*best, "cache_aware hit rate against 90%% of the best possible")
		}}})
	})
}
