package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/internal/testengine"
	"github.com/enginepick/enginepick/kvindex/kvevents"
	"github.com/enginepick/enginepick/state"
)

// The burst of TestRealEnginesEndToEnd: families of conversations, each family sharing a system
// prompt; the families run concurrently, the conversations of one family take turns.
const (
	e2eEngines   = 4
	e2eFamilies  = 4
	e2eConvs     = 3 // conversations per family
	e2eTurns     = 4
	e2eBlock     = 16 // KV block size in tokens, vLLM's default
	e2eMaxTokens = 16 // output tokens per turn
	e2eModel     = "m"
)

// Four vLLM-like test engines behind the gateway (cache_aware, load polled from their /metrics,
// KV events followed with their replay sockets), in both event encodings and both publisher
// conventions (vLLM: root parent nil, sequence from 0; llm-d: root parent 0, sequence from 1, a
// topic per engine, replay replies with a topic frame). After a burst of multi-turn chats through
// the gateway's HTTP server:
//
//   - the index holds, for every engine, exactly the blocks the engine's prefix cache holds: each
//     engine block's whole prefix matches as many leading blocks for that engine as the block's
//     depth, and the index holds no other block for it (its block count equals the engine's,
//     none of them an unconfirmed placement);
//   - each engine prefilled exactly the prompt tokens the cache-aware policy predicted for the
//     requests it was sent (policy.Pick.PrefillTokens, which the Router records with each
//     dispatch in loadmon.InFlight), so the engines' own cached_tokens give the hit rate the
//     policy predicted. An engine serves from its cache whole blocks only, and never the block
//     holding the last prompt token, which it computes again for its logits: holding b leading
//     blocks of an n-token prompt, it serves min(b, ⌊(n − 1) ÷ 16⌋) × 16 tokens (docs/design.md
//     §9.1);
//   - every answer's usage reports the cached tokens of an engine that holds its family's earlier
//     prompts (chatBurst): each request went to the engine holding its prefix.
//
// The prediction is exact only if the index, when a request is picked, holds what its engine
// holds when it admits the request. The burst keeps that true without any wait: the families
// share no block, so no engine stores a block another pick could be looking up meanwhile; the
// turns of one family are sequential; and the policy records each pick's prompt on its engine
// (route-time placement, docs/design.md §9.10), so the next turn finds the previous one's blocks
// before their BlockStored arrives. A conversation's next prompt shares the previous prompt but
// for its last token (the chat template's "\n" after <|assistant|> becomes "\n " before the
// reply), so the previous reply's blocks are never matched. The engines never evict.
//
// One more case gives each engine a cache of 32 blocks, fewer than a family's prompts need, so
// that engines evict blocks (the hit rate falls from 61 % to about 45 %, or 32 % where two
// families share an engine): the index still holds exactly the engines' blocks once the feed has
// caught up. The predictions are then not checked: a pick may read a block its engine is evicting
// for another family's request at that moment, since nothing orders the two.
func TestRealEnginesEndToEnd(t *testing.T) {
	t.Parallel()
	llmd := func(enc testengine.Encoding) testengine.KVEventsOptions {
		return testengine.KVEventsOptions{Encoding: enc, RootParentZero: true, FirstSeq: 1, ReplayFormat: testengine.ReplayTopic,
			Topic: "kv@{addr}@" + e2eModel}
	}
	for _, tc := range []struct {
		name string
		kv   testengine.KVEventsOptions
		// numBlocks is each engine's KV capacity in blocks (0: the default, 4,096, never full).
		numBlocks int
	}{
		{"array vllm", testengine.KVEventsOptions{Encoding: testengine.EncodingArray}, 0},
		{"map vllm", testengine.KVEventsOptions{Encoding: testengine.EncodingMap}, 0},
		{"array llm-d", llmd(testengine.EncodingArray), 0},
		{"map llm-d", llmd(testengine.EncodingMap), 0},
		{"map llm-d evicting", llmd(testengine.EncodingMap), 32},
	} {
		t.Run(tc.name, func(t *testing.T) {
			engines := make([]*testengine.Engine, e2eEngines)
			args := []string{"--block-tokens=16", "--min-matched-tokens=16", "--load-interval=100ms", "--load-timeout=100ms"}
			for i := range engines {
				e, err := testengine.Start(testengine.Options{Model: e2eModel, BlockSize: e2eBlock, NumBlocks: tc.numBlocks, KVEvents: tc.kv})
				require.NoError(t, err)
				t.Cleanup(func() { assert.NoError(t, e.Close()) }) // after the gateway's cleanup
				engines[i] = e
				args = append(args, fmt.Sprintf("--engine=url=%s,model=%s,kind=vllm,kv_events=%s,kv_replay=%s,kv_topic=%s",
					e.URL(), e2eModel, e.KVEndpoint(0), e.ReplayEndpoint(0), e.Topic(0)))
			}
			g, srv := startGateway(t, args...)
			warmUp(t, g, engines)

			start := time.Now()
			evicting := tc.numBlocks > 0
			usage := chatBurst(t, srv.URL, !evicting)
			require.Eventually(t, func() bool { return caughtUp(g, engines) }, 20*time.Second, 5*time.Millisecond,
				"the gateway applies every batch the engines published")

			// The index holds exactly the engines' blocks.
			h := g.index.Hasher()
			ranks := map[string]kvDebugRank{}
			d := debugKV(t, srv.URL)
			require.NotNil(t, d.Index)
			for _, r := range d.Index.Ranks {
				ranks[r.Engine] = r
			}
			var engineBlocks int
			for i, e := range engines {
				id := state.EngineID(e.URL())
				blocks := e.Blocks(0)
				engineBlocks += len(blocks)
				for _, b := range blocks {
					if !evicting {
						require.Equal(t, 1, b.Copies, "engine %d: a prompt never repeats, so no block is computed twice", i)
					}
					depth := len(b.Prefix) / e2eBlock
					if !assert.Equal(t, depth, g.index.Match(h.Keys(b.Prefix)).Blocks(id), "engine %d: the block at depth %d", i, depth) {
						break
					}
				}
				r := ranks[e.URL()]
				assert.Equal(t, len(blocks), r.DeviceBlocks, "engine %d: the index holds no other block", i)
				assert.Zero(t, r.ApproximateBlocks, "engine %d: every placement was confirmed by the engine", i)
				if len(blocks) > 0 {
					assert.True(t, r.Trusted, "engine %d", i)
				}
			}

			// Each engine prefilled what the policy predicted.
			var prompt, cached, predicted int
			var served []int
			for i, e := range engines {
				var n, ePrompt, eCached int
				for _, r := range e.Requests() {
					if r.Path != "/v1/chat/completions" {
						continue // the warm-up's
					}
					require.True(t, r.Completed, "engine %d", i)
					n++
					ePrompt += r.PromptTokens
					eCached += r.CachedTokens
				}
				served = append(served, n)
				prompt, cached = prompt+ePrompt, cached+eCached
				dispatched, predictedPrefill := g.inflight.DispatchedSince(state.EngineID(e.URL()), -1, start)
				require.EqualValues(t, n, dispatched, "engine %d: the gateway records each dispatch to it (at most 64)", i)
				if !evicting {
					assert.EqualValues(t, ePrompt-eCached, predictedPrefill, "engine %d: prefilled tokens against the policy's prediction", i)
				}
				predicted += ePrompt - int(predictedPrefill)
			}
			if evicting {
				var removed uint64
				for _, st := range g.kv.sub.Stats().Streams {
					removed += st.RemovedBlocks
				}
				require.Positive(t, removed, "the engines evicted blocks")
			}
			assert.Equal(t, e2eFamilies*e2eConvs*e2eTurns, len(usage))
			var clientPrompt, clientCached int
			for _, u := range usage {
				clientPrompt += u.PromptTokens
				clientCached += u.PromptTokensDetails.CachedTokens
			}
			assert.Equal(t, prompt, clientPrompt, "usage.prompt_tokens relayed to the clients")
			assert.Equal(t, cached, clientCached, "usage.prompt_tokens_details.cached_tokens relayed to the clients")
			t.Logf("%d requests (per engine %v), %d prompt tokens: hit rate %.1f%% observed by the engines (%d cached), %.1f%% predicted (%d); %d blocks in the engines' caches",
				len(usage), served, prompt, 100*float64(cached)/float64(prompt), cached, 100*float64(predicted)/float64(prompt), predicted, engineBlocks)
		})
	}
}

// streamStats returns the KV-event stream of engine's rank 0.
func streamStats(st kvevents.Stats, engine string) (kvevents.StreamStats, bool) {
	for _, s := range st.Streams {
		if string(s.Engine) == engine && s.DPRank == 0 {
			return s, true
		}
	}
	return kvevents.StreamStats{}, false
}

// caughtUp reports whether the gateway has applied the last batch every engine published, in step.
func caughtUp(g *gateway, engines []*testengine.Engine) bool {
	st := g.kv.sub.Stats()
	for _, e := range engines {
		s, ok := streamStats(st, e.URL())
		next := e.Stats(0).NextSeq
		if !ok || !s.Trusted || next == e.Options().KVEvents.FirstSeq || s.LastSeq != next-1 {
			return false
		}
	}
	return true
}

// warmUp makes sure the gateway follows every engine's events from an empty cache. Batches
// published before its subscriber connects are lost for good (a PUB socket drops them): requests
// are sent to each engine directly until one of its batches reaches the gateway, then the engine
// sleeps and wakes up, which empties its cache and publishes AllBlocksCleared.
func warmUp(t *testing.T, g *gateway, engines []*testengine.Engine) {
	t.Helper()
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	for i, e := range engines {
		for n := 0; ; n++ {
			if s, ok := streamStats(g.kv.sub.Stats(), e.URL()); ok && s.Batches > 0 {
				break
			}
			require.Less(t, n, 1000, "engine %d: no batch reached the gateway (does it follow the engine's publisher and topic?)", i)
			ids := make([]string, e2eBlock+1)
			for j := range ids {
				ids[j] = fmt.Sprint(1_000_000 + 1000*i + 20*n + j)
			}
			body := fmt.Sprintf(`{"model":%q,"prompt":[%s],"max_tokens":1}`, e2eModel, strings.Join(ids, ","))
			resp, err := client.Post(e.URL()+"/v1/completions", "application/json", strings.NewReader(body))
			require.NoError(t, err)
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			require.Equal(t, http.StatusOK, resp.StatusCode)
			time.Sleep(5 * time.Millisecond)
		}
		require.NoError(t, e.Sleep(context.Background()))
		e.WakeUp()
		require.Empty(t, e.Blocks(0))
	}
	require.Eventually(t, func() bool {
		if !caughtUp(g, engines) {
			return false
		}
		for _, r := range g.index.Stats().Ranks {
			if r.DeviceBlocks+r.ApproximateBlocks > 0 {
				return false
			}
		}
		return true
	}, 20*time.Second, 5*time.Millisecond, "the gateway's index is empty once the engines' caches are")
}

// chatUsage is the usage of a chat answer.
type chatUsage struct {
	PromptTokens        int `json:"prompt_tokens"`
	CompletionTokens    int `json:"completion_tokens"`
	PromptTokensDetails struct {
		CachedTokens int `json:"cached_tokens"`
	} `json:"prompt_tokens_details"`
}

// chatBurst sends e2eFamilies × e2eConvs conversations of e2eTurns turns to the gateway at base
// and returns the usage of every answer. Each family has its own system prompt; its conversations
// take turns on one goroutine, the families run concurrently. Every turn sends the whole
// conversation: the system prompt, every earlier user message and reply, and a new user message.
// Odd conversations stream their answers. The content is a function of the family and
// conversation only.
//
// Each answer's usage is checked against the engine's tokenizer and chat template, and, with
// checkCached, its cached tokens against what the family's engine serves when the cache-aware
// policy sends every request to the engine holding its family's earlier prompts and that engine
// evicts nothing: the longest prefix shared with one of them, in whole blocks, short of the block
// holding the last prompt token.
func chatBurst(t *testing.T, base string, checkCached bool) []chatUsage {
	t.Helper()
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: e2eFamilies}}
	defer client.CloseIdleConnections()
	var mu sync.Mutex
	var usage []chatUsage
	var errs []error
	var wg sync.WaitGroup
	for f := range e2eFamilies {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(20_26, uint64(f)))
			system := fmt.Sprintf("You are assistant %d. %s", f, e2eWords(rng, 30))
			convs := make([][]testengine.Message, e2eConvs)
			for c := range convs {
				convs[c] = []testengine.Message{{Role: "system", Content: system}}
			}
			var sent [][]uint32 // the family's prompts so far
			for turn := range e2eTurns {
				for c := range convs {
					question := fmt.Sprintf("Conversation %d.%d, turn %d: %s?", f, c, turn, e2eWords(rng, 10+rng.IntN(40)))
					convs[c] = append(convs[c], testengine.Message{Role: "user", Content: question})
					answer, u, err := chatTurn(client, base, convs[c], c%2 == 1)
					if err == nil {
						tokens := testengine.Tokenize(testengine.ChatPrompt(convs[c], true))
						want := servedPrefix(sent, tokens)
						if u.PromptTokens != len(tokens) || checkCached && u.PromptTokensDetails.CachedTokens != want {
							err = fmt.Errorf("usage %+v, want %d prompt tokens, %d cached", u, len(tokens), want)
						}
						sent = append(sent, tokens)
					}
					mu.Lock()
					if err != nil {
						errs = append(errs, fmt.Errorf("family %d conversation %d turn %d: %w", f, c, turn, err))
					} else {
						usage = append(usage, u)
					}
					mu.Unlock()
					if err != nil {
						return
					}
					convs[c] = append(convs[c], testengine.Message{Role: "assistant", Content: answer})
				}
			}
		})
	}
	wg.Wait()
	require.Empty(t, errs)
	return usage
}

// servedPrefix returns the tokens of prompt an engine holding the full blocks of every earlier
// prompt serves from its cache: the longest prefix prompt shares with one of them, in whole
// blocks, at most the blocks before the one holding prompt's last token.
func servedPrefix(earlier [][]uint32, prompt []uint32) int {
	shared := 0
	for _, e := range earlier {
		n := 0
		for n < len(e) && n < len(prompt) && e[n] == prompt[n] {
			n++
		}
		shared = max(shared, n)
	}
	return min(shared/e2eBlock, (len(prompt)-1)/e2eBlock) * e2eBlock
}

var e2eVocabulary = strings.Fields(`river stone cloud amber lantern orbit meadow copper signal harbor
velvet summit quartz willow ember canyon falcon glacier marble prism thunder cedar harvest beacon
compass tundra lagoon saffron cobalt mosaic`)

// e2eWords returns n words of the vocabulary drawn by rng.
func e2eWords(rng *rand.Rand, n int) string {
	w := make([]string, n)
	for i := range w {
		w[i] = e2eVocabulary[rng.IntN(len(e2eVocabulary))]
	}
	return strings.Join(w, " ")
}

// chatTurn sends one chat request through the gateway and returns the reply and its usage.
func chatTurn(client *http.Client, base string, messages []testengine.Message, stream bool) (string, chatUsage, error) {
	wire := make([]map[string]string, len(messages))
	for i, m := range messages {
		wire[i] = map[string]string{"role": m.Role, "content": m.Content}
	}
	body, err := json.Marshal(map[string]any{"model": e2eModel, "messages": wire, "max_tokens": e2eMaxTokens,
		"stream": stream, "stream_options": map[string]bool{"include_usage": true}})
	if err != nil {
		return "", chatUsage{}, err
	}
	resp, err := client.Post(base+"/v1/chat/completions", "application/json", bytes.NewReader(body))
	if err != nil {
		return "", chatUsage{}, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		raw, _ := io.ReadAll(resp.Body)
		return "", chatUsage{}, fmt.Errorf("status %d: %s", resp.StatusCode, raw)
	}
	var chunk struct {
		Choices []struct {
			Message struct {
				Content string `json:"content"`
			} `json:"message"`
			Delta struct {
				Content string `json:"content"`
			} `json:"delta"`
		} `json:"choices"`
		Usage *chatUsage `json:"usage"`
	}
	var answer strings.Builder
	var u *chatUsage
	read := func(raw []byte) error {
		chunk.Choices, chunk.Usage = nil, nil
		if err := json.Unmarshal(raw, &chunk); err != nil {
			return fmt.Errorf("%w: %s", err, raw)
		}
		for _, c := range chunk.Choices {
			answer.WriteString(c.Message.Content + c.Delta.Content)
		}
		if chunk.Usage != nil {
			u = chunk.Usage
		}
		return nil
	}
	if !stream {
		raw, err := io.ReadAll(resp.Body)
		if err == nil {
			err = read(raw)
		}
		if err != nil {
			return "", chatUsage{}, err
		}
	} else {
		sc := bufio.NewScanner(resp.Body)
		for sc.Scan() {
			data, ok := strings.CutPrefix(sc.Text(), "data: ")
			if !ok || data == "[DONE]" {
				continue
			}
			if err := read([]byte(data)); err != nil {
				return "", chatUsage{}, err
			}
		}
		if err := sc.Err(); err != nil {
			return "", chatUsage{}, err
		}
	}
	if u == nil || u.CompletionTokens != e2eMaxTokens {
		return "", chatUsage{}, fmt.Errorf("no usage, or not %d output tokens: %+v", e2eMaxTokens, u)
	}
	return answer.String(), *u, nil
}
