package kvindex

import (
	"context"
	"errors"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/state"
)

// lookupEngines runs a LocalSource lookup of pattern's first blocks blocks and returns the
// outcome and the engines' block counts.
func lookupEngines(t *testing.T, f *fixture, pattern, blocks int) (Outcome, map[state.EngineID]int) {
	t.Helper()
	src := f.source()
	r, err := src.Lookup(context.Background(), Query{TokenIDs: prompt(pattern, blocks)})
	require.NoError(t, err)
	out := map[state.EngineID]int{}
	for _, e := range r.Engines {
		out[e.Engine] = e.Blocks
	}
	return r.Outcome, out
}

// TestTrustUntrustedEngineHoldsNothing: an engine with an untrusted rank is left out of
// LocalSource results until every untrusted rank is trusted again; its entries stay in the index.
func TestTrustUntrustedEngineHoldsNothing(t *testing.T) {
	t.Parallel()
	f := sourceFixture(t) // a: 5 blocks of prompt 1; b: 3 (rank 0) and 4 (rank 1); c: prompt 2

	oc, got := lookupEngines(t, f, 1, 5)
	require.Equal(t, OutcomeHit, oc)
	require.Equal(t, map[state.EngineID]int{"http://a": 5, "http://b": 4}, got)

	require.NoError(t, f.x.markUntrusted("http://b", 1))
	require.NoError(t, f.x.markUntrusted("http://b", 0))
	assert.False(t, f.x.Trusted("http://b"))
	assert.True(t, f.x.Trusted("http://a"))
	assert.True(t, f.x.Trusted("http://never-seen"))
	assert.Equal(t, []state.EngineID{"http://b"}, f.x.untrusted())

	_, got = lookupEngines(t, f, 1, 5)
	assert.Equal(t, map[state.EngineID]int{"http://a": 5}, got, "untrusted b is left out")
	assert.Equal(t, 4, f.match(1, 5)["http://b"], "Match still reports the raw entries")

	require.NoError(t, f.x.markTrusted("http://b", 1))
	assert.False(t, f.x.Trusted("http://b"), "rank 0 is still untrusted")
	_, got = lookupEngines(t, f, 1, 5)
	assert.Equal(t, map[state.EngineID]int{"http://a": 5}, got)

	require.NoError(t, f.x.markTrusted("http://b", 0))
	assert.True(t, f.x.Trusted("http://b"))
	assert.Nil(t, f.x.untrusted())
	_, got = lookupEngines(t, f, 1, 5)
	assert.Equal(t, map[state.EngineID]int{"http://a": 5, "http://b": 4}, got)
}

// TestTrustOnlyUntrustedHolderIsAMiss: when the only holders are untrusted the lookup is a miss,
// not a hit with no engines.
func TestTrustOnlyUntrustedHolderIsAMiss(t *testing.T) {
	t.Parallel()
	f := sourceFixture(t)
	require.NoError(t, f.x.markUntrusted("http://c", 0))
	oc, got := lookupEngines(t, f, 2, 2)
	assert.Equal(t, OutcomeMiss, oc)
	assert.Empty(t, got)
}

// TestTrustMarksAreIdempotentAndValidated: repeated marks are no-ops; bad arguments are typed
// errors that change nothing.
func TestTrustMarksAreIdempotentAndValidated(t *testing.T) {
	t.Parallel()
	f := sourceFixture(t)
	require.NoError(t, f.x.markUntrusted("http://a", 0))
	require.NoError(t, f.x.markUntrusted("http://a", 0))
	require.NoError(t, f.x.markTrusted("http://a", 0))
	assert.True(t, f.x.Trusted("http://a"), "one MarkTrusted undoes repeated marks of one rank")
	require.NoError(t, f.x.markTrusted("http://a", 3), "trusting an unmarked rank is a no-op")

	for _, tc := range []struct {
		name   string
		engine state.EngineID
		rank   int
		want   error
	}{
		{"empty engine", "", 0, ErrInvalidEngine},
		{"negative rank", "http://a", -1, ErrInvalidRank},
	} {
		for _, mark := range []func(state.EngineID, int) error{f.x.markUntrusted, f.x.markTrusted} {
			err := mark(tc.engine, tc.rank)
			assert.ErrorIs(t, err, tc.want, tc.name)
			var ee *EventError
			assert.True(t, errors.As(err, &ee), tc.name)
		}
	}
	assert.Nil(t, f.x.untrusted())
}

// TestTrustConcurrent: marks and lookups from several goroutines (run with -race).
func TestTrustConcurrent(t *testing.T) {
	t.Parallel()
	f := sourceFixture(t)
	src := f.source()
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 200 {
				if g%2 == 0 {
					_ = f.x.markUntrusted("http://b", g)
					_ = f.x.markTrusted("http://b", g)
					continue
				}
				r, err := src.Lookup(context.Background(), Query{TokenIDs: prompt(1, 1+i%5)})
				assert.NoError(t, err)
				assert.Equal(t, OutcomeHit, r.Outcome)
			}
		}()
	}
	wg.Wait()
	assert.True(t, f.x.Trusted("http://b"))
}
