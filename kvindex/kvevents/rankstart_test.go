package kvevents

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/state"
)

// TestStreamRankStart: an engine owning global DP ranks 4..7 publishes data_parallel_rank 5 for its
// rank 1; with RankStart 4 the stream of rank 1 applies those batches (live and replayed) to rank 1
// of the index, and refuses the local number 1 as another rank.
func TestStreamRankStart(t *testing.T) {
	t.Parallel()
	rep := &fakeReplayer{payloads: map[uint64][]byte{}, seqs: []uint64{1}}
	f := &streamFixture{t: t, x: newIndex(t, "")}
	sub, err := New(Options{Index: f.x})
	require.NoError(t, err)
	f.s = newStream(Endpoint{Engine: eng, DPRank: 1, RankStart: 4, Address: "tcp://127.0.0.1:1"}, &sub.opts, rep,
		func(e *StreamError) { f.errs = append(f.errs, e) })
	rep.payloads[1] = payload(t, 5, block(1, 1))

	f.s.handle(context.Background(), item{seq: 0, payload: payload(t, 5, block(1, 0))})
	f.s.handle(context.Background(), item{seq: 2, payload: payload(t, 5, block(1, 2))}) // 1 is replayed
	f.s.publish()
	require.Empty(t, f.errs)
	m := f.x.Match(f.x.Hasher().Keys(prompt(1, 3)))
	require.Len(t, m.Engines, 1)
	assert.Equal(t, 3, m.Engines[0].Blocks)
	assert.Equal(t, []int{1}, m.DPRanks, "global rank 5 is the engine's rank 1")

	f.s.handle(context.Background(), item{seq: 3, payload: payload(t, 1, block(1, 3))})
	require.Len(t, f.errs, 1)
	assert.ErrorIs(t, f.errs[0], ErrRankMismatch, "the local number is not the rank the engine publishes")
}

func TestAddRefusesNegativeRankStart(t *testing.T) {
	t.Parallel()
	sub, err := New(Options{Index: newIndex(t, "")})
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Close() })
	err = sub.Add(Endpoint{Engine: eng, RankStart: -1, Address: "tcp://127.0.0.1:1"})
	assert.ErrorIs(t, err, state.ErrInvalidConfiguration)
}
