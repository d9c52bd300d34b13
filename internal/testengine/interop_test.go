package testengine

import (
	"context"
	"net/http"
	"slices"
	"strings"
	"sync"
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
// cache holds no second copies (TestIndexFollowsCopies has them). It holds with vLLM's conventions
// and llm-d's (root parent 0, sequence from 1, per-rank topics, replay replies with a topic
// frame).
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
			f := follow(t, e)

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
			held := f.check(t, sequences)
			for _, copies := range held {
				require.Equal(t, 1, copies)
			}
			require.Less(t, len(held), 40, "the cache evicted blocks")
			st := f.sub.Stats().Streams[0]
			assert.Positive(t, st.RemovedBlocks)
			assert.Positive(t, st.Regressions, "the restart was seen")
			assert.Positive(t, st.Replays, "the dropped batch was replayed")
			assert.Zero(t, st.Rejected)
		})
	}
}

// TestIndexFollowsCopies: like vLLM, the engine keeps a second copy of a block computed while an
// identical one is cached (two concurrent requests with the same prefix: the second one ends on a
// block boundary, so it computes its last block again), stores it again, and removes each copy when
// it evicts it. The index keeps the block, and the blocks chained to it, while the engine holds a
// copy, and drops it with the last one.
func TestIndexFollowsCopies(t *testing.T) {
	const bs = 4
	e := start(t, Options{BlockSize: bs, NumBlocks: 10, MaxModelLen: 40, DecodePerToken: 20 * time.Millisecond})
	f := follow(t, e)
	long, short := seqIDs(1, 8), seqIDs(1, 4)
	h := BlockHashes(long, bs) // p, c
	var wg sync.WaitGroup
	wg.Go(func() { // [p c] running for 7 decode steps
		assert.Equal(t, http.StatusOK, postJSON(t, e.URL()+"/v1/completions", idsPrompt(long, 8), nil, nil))
	})
	require.Eventually(t, func() bool { return e.Stats(0).Running == 1 }, 10*time.Second, time.Millisecond)
	require.Equal(t, http.StatusOK, postJSON(t, e.URL()+"/v1/completions", idsPrompt(short, 1), nil, nil))
	wg.Wait()
	sequences := [][]uint32{
		append(slices.Clone(long), Tokenize(strings.Join(Generate(long, 8), ""))...),
		append(slices.Clone(short), Tokenize(strings.Join(Generate(short, 1), ""))...),
	}
	held := f.check(t, sequences)
	require.Equal(t, 2, held[h[0]], "two copies of p")

	// Each request evicts the least recently freed blocks: first the short request's copy of p,
	// later the other copy and c.
	evictedOne, evictedAll := false, false
	for i := 0; !evictedAll; i++ {
		require.Less(t, i, 10, "p is never evicted")
		other := seqIDs(100+100*i, 13)
		require.Equal(t, http.StatusOK, postJSON(t, e.URL()+"/v1/completions", idsPrompt(other, 1), nil, nil))
		sequences = append(sequences, append(other, Tokenize(strings.Join(Generate(other, 1), ""))...))
		held = f.check(t, sequences)
		evictedOne = evictedOne || held[h[0]] == 1 && held[h[1]] == 1
		evictedAll = held[h[0]] == 0
	}
	assert.True(t, evictedOne, "one copy of p was evicted while c stayed")
	st := f.sub.Stats().Streams[0]
	assert.Zero(t, st.Rejected)
	assert.Zero(t, st.UnknownRemovals)
}

// follower is a kvindex.Index fed by one engine's rank 0 through a kvevents.Subscriber.
type follower struct {
	e      *Engine
	h      kvindex.Hasher
	index  *kvindex.Index
	sub    *kvevents.Subscriber
	engine state.EngineID
}

// follow subscribes an index to e's rank 0. Batches published before the subscriber is connected
// are lost for good: it sends requests until one arrives, then restarts the engine, which empties
// its cache and makes the subscriber clear the rank when the sequence starts again.
func follow(t *testing.T, e *Engine) *follower {
	t.Helper()
	h, err := kvindex.NewHasher(kvindex.HasherConfig{BlockTokens: e.Options().BlockSize})
	require.NoError(t, err)
	index, err := kvindex.NewIndex(h, kvindex.Options{})
	require.NoError(t, err)
	sub, err := kvevents.New(kvevents.Options{Index: index})
	require.NoError(t, err)
	engine := state.EngineID(e.URL())
	require.NoError(t, sub.Add(kvevents.Endpoint{Engine: engine, Address: e.KVEndpoint(0), ReplayAddress: e.ReplayEndpoint(0), Topic: e.Topic(0)}))
	require.NoError(t, sub.Start(context.Background()))
	t.Cleanup(func() { require.NoError(t, sub.Close()) })
	for i := 0; sub.Stats().Streams[0].Batches == 0; i++ {
		require.Less(t, i, 500, "no batch reached the subscriber")
		require.Equal(t, http.StatusOK, postJSON(t, e.URL()+"/v1/completions", idsPrompt(seqIDs(50_000+20*i, 17), 1), nil, nil))
		time.Sleep(5 * time.Millisecond)
	}
	e.Restart()
	return &follower{e: e, h: h, index: index, sub: sub, engine: engine}
}

// check waits for the subscriber to apply every batch the engine published, then checks that for
// every sequence the index matches as many leading blocks as the engine holds. It returns the
// copies the engine holds per block hash.
func (f *follower) check(t *testing.T, sequences [][]uint32) map[uint64]int {
	t.Helper()
	last := f.e.Stats(0).NextSeq - 1
	require.Eventually(t, func() bool {
		st := f.sub.Stats().Streams[0]
		return st.LastSeq == last && st.Trusted
	}, 10*time.Second, 5*time.Millisecond, "the subscriber catches up")
	held := map[uint64]int{}
	for _, b := range f.e.Blocks(0) {
		held[b.Hash] = b.Copies
	}
	bs := f.e.Options().BlockSize
	for i, seq := range sequences {
		engineBlocks := 0
		for _, hash := range BlockHashes(seq, bs) {
			if held[hash] == 0 {
				break
			}
			engineBlocks++
		}
		assert.Equal(t, engineBlocks, f.index.Match(f.h.Keys(seq)).Blocks(f.engine), "sequence %d", i)
	}
	return held
}
