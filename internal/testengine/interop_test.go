package testengine

import (
	"context"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/kvindex"
	"github.com/enginepick/enginepick/kvindex/kvevents"
	"github.com/enginepick/enginepick/state"
)

// The router's index, fed by the engine's KV events through kvevents.Subscriber, ends up holding
// exactly what the engine's cache holds, through stores, evictions (the cache holds a sixth of the
// blocks the prompts need), a restart and a batch lost on the PUB socket (refilled from the
// replay socket). Every prompt and its output is checked: the index matches as many leading
// blocks as the engine holds. The prompts never end on a block boundary and never repeat, so the
// cache holds no second copies (TestCopyOfAParentEvictedWhileItsChildStays shows what those do).
// It holds with vLLM's conventions and llm-d's (root parent 0, sequence from 1, per-rank topics,
// replay replies with a topic frame).
func TestIndexFollowsTheEngine(t *testing.T) {
	for _, tc := range []struct {
		name string
		kv   KVEventsOptions
	}{
		{"vllm", KVEventsOptions{}},
		{"vllm arrays", KVEventsOptions{Encoding: EncodingArray}},
		{"llm-d", KVEventsOptions{RootParentZero: true, FirstSeq: 1, ReplayFormat: ReplayTopic, Topic: "kv@{addr}@test-model"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const bs = 16
			e := start(t, Options{BlockSize: bs, NumBlocks: 40, MaxModelLen: 640, DecodePerToken: -1, PrefillPerToken: -1, KVEvents: tc.kv})
			h, err := kvindex.NewHasher(kvindex.HasherConfig{BlockTokens: bs})
			require.NoError(t, err)
			index, err := kvindex.NewIndex(h, kvindex.Options{})
			require.NoError(t, err)
			sub, err := kvevents.New(kvevents.Options{Index: index})
			require.NoError(t, err)
			engine := state.EngineID(e.URL())
			require.NoError(t, sub.Add(kvevents.Endpoint{Engine: engine, Address: e.KVEndpoint(0), ReplayAddress: e.ReplayEndpoint(0), Topic: e.Topic(0)}))
			require.NoError(t, sub.Start(context.Background()))
			defer sub.Close()

			// Batches published before the subscriber is connected are lost for good: send
			// requests until one arrives, then restart the engine, which empties its cache and
			// makes the subscriber clear the rank when the sequence starts again.
			for i := 0; sub.Stats().Streams[0].Batches == 0; i++ {
				require.Less(t, i, 500, "no batch reached the subscriber")
				require.Equal(t, http.StatusOK, postJSON(t, e.URL()+"/v1/completions", idsPrompt(seqIDs(50_000+20*i, 17), 1), nil, nil))
				time.Sleep(5 * time.Millisecond)
			}
			e.Restart()

			var sequences [][]uint32 // every prompt followed by its output
			for i := range 40 {
				if i == 20 {
					e.DropBatches(0, 1)
				}
				family := seqIDs(1000*(i%5), 40) // 5 families sharing 2 full blocks
				prompt := append(family, seqIDs(100_000+100*i, 7+i%9)...)
				if len(prompt)%bs == 0 {
					prompt = append(prompt, 1)
				}
				require.Equal(t, http.StatusOK, postJSON(t, e.URL()+"/v1/completions", idsPrompt(prompt, 20), nil, nil))
				sequences = append(sequences, append(prompt, Tokenize(strings.Join(Generate(prompt, 20), ""))...))
			}
			last := e.Stats(0).NextSeq - 1
			require.Eventually(t, func() bool {
				st := sub.Stats().Streams[0]
				return st.LastSeq == last && st.Trusted
			}, 10*time.Second, 5*time.Millisecond, "the subscriber catches up")

			held := map[uint64]bool{}
			for _, b := range e.Blocks(0) {
				require.Equal(t, 1, b.Copies)
				held[b.Hash] = true
			}
			require.Less(t, len(held), 40, "the cache evicted blocks")
			for i, seq := range sequences {
				engineBlocks := 0
				for _, hash := range BlockHashes(seq, bs) {
					if !held[hash] {
						break
					}
					engineBlocks++
				}
				assert.Equal(t, engineBlocks, index.Match(h.Keys(seq)).Blocks(engine), "sequence %d", i)
			}
			st := sub.Stats().Streams[0]
			assert.Positive(t, st.RemovedBlocks)
			assert.Positive(t, st.Regressions, "the restart was seen")
			assert.Positive(t, st.Replays, "the dropped batch was replayed")
			assert.Zero(t, st.Rejected)
		})
	}
}
