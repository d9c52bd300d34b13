package kvindex

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/state"
)

// sourceFixture is an index with three engines on prompt 1 and one on prompt 2.
func sourceFixture(t *testing.T) *fixture {
	f := newFixture(t, Options{})
	f.store("http://a", 0, 1, 0, 5, 0, TierDevice)
	f.store("http://b", 0, 1, 0, 3, 100, TierDevice)
	f.store("http://b", 1, 1, 0, 4, 200, TierHost)
	f.store("http://c", 0, 2, 0, 2, 300, TierDevice)
	return f
}

// indexerFunc adapts a function to RemoteIndexer.
type indexerFunc func(ctx context.Context, q RemoteQuery) ([]EngineMatch, error)

func (f indexerFunc) MatchPrefix(ctx context.Context, q RemoteQuery) ([]EngineMatch, error) {
	return f(ctx, q)
}

// indexBacked is a RemoteIndexer answering from an Index through the query's keys.
func indexBacked(x *Index) RemoteIndexer {
	return indexerFunc(func(ctx context.Context, q RemoteQuery) ([]EngineMatch, error) {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		return x.Match(q.Keys).Engines, nil
	})
}

// TestSourceConformance runs the Source contract against every implementation.
func TestSourceConformance(t *testing.T) {
	t.Parallel()
	impls := []struct {
		name string
		new  func(t *testing.T, x *Index) Source
	}{
		{"local", func(t *testing.T, x *Index) Source {
			s, err := NewLocalSource(x)
			require.NoError(t, err)
			return s
		}},
		{"remote", func(t *testing.T, x *Index) Source {
			s, err := NewRemoteSource(indexBacked(x), x.Hasher(), RemoteOptions{})
			require.NoError(t, err)
			return s
		}},
	}
	for _, impl := range impls {
		t.Run(impl.name, func(t *testing.T) {
			t.Parallel()
			f := sourceFixture(t)
			src := impl.new(t, f.x)
			ctx := context.Background()
			cases := []struct {
				name        string
				tokens      []uint32
				want        Outcome
				engines     []EngineMatch
				queryBlocks int
				explanation string
			}{
				{"hit", prompt(1, 6), OutcomeHit, []EngineMatch{{"http://a", 5}, {"http://b", 4}}, 6,
					"per engine, deepest first, ranks folded by maximum"},
				{"hit with a partial block", append(prompt(2, 3), 1, 2), OutcomeHit, []EngineMatch{{"http://c", 2}}, 3,
					"the trailing partial block is ignored"},
				{"miss", prompt(3, 4), OutcomeMiss, nil, 4, "nobody holds the first block"},
				{"short prompt", []uint32{1, 2, 3}, OutcomeMiss, nil, 0, "no full block is a valid, empty query"},
				{"empty prompt", nil, OutcomeMiss, nil, 0, "no tokens is a valid, empty query"},
			}
			for _, c := range cases {
				r, err := src.Lookup(ctx, Query{TokenIDs: c.tokens})
				require.NoError(t, err, c.name)
				assert.Equal(t, c.want, r.Outcome, "%s: %s", c.name, c.explanation)
				assert.Equal(t, c.engines, r.Engines, "%s: %s", c.name, c.explanation)
				assert.Equal(t, c.queryBlocks, r.QueryBlocks, c.name)
				assert.Equal(t, testBlock, r.BlockTokens, "%s: block size is reported for every outcome", c.name)
				assert.Empty(t, r.Reason, c.name)
			}

			canceled, cancel := context.WithCancel(ctx)
			cancel()
			r, err := src.Lookup(canceled, Query{TokenIDs: prompt(1, 2)})
			require.NoError(t, err, "unavailability is not an error")
			assert.Equal(t, OutcomeUnavailable, r.Outcome)
			assert.Equal(t, reasonCanceled, r.Reason)
			assert.Equal(t, testBlock, r.BlockTokens)
			expired, cancel2 := context.WithDeadline(ctx, time.Unix(0, 0))
			defer cancel2()
			r, err = src.Lookup(expired, Query{TokenIDs: prompt(1, 2)})
			require.NoError(t, err)
			assert.Equal(t, reasonTimeout, r.Reason)

			var wg sync.WaitGroup
			for i := range 16 {
				wg.Go(func() {
					r, err := src.Lookup(ctx, Query{TokenIDs: prompt(1, 1+i%6)})
					assert.NoError(t, err)
					assert.Equal(t, OutcomeHit, r.Outcome)
					assert.Equal(t, min(5, 1+i%6), r.Blocks("http://a"))
				})
			}
			wg.Wait()
		})
	}
}

func TestNewSourcesValidate(t *testing.T) {
	t.Parallel()
	h, err := NewHasher(HasherConfig{BlockTokens: 16})
	require.NoError(t, err)
	ri := indexerFunc(func(context.Context, RemoteQuery) ([]EngineMatch, error) { return nil, nil })
	_, err = NewLocalSource(nil)
	assert.ErrorIs(t, err, state.ErrInvalidConfiguration, "nil index")
	cases := []struct {
		name string
		ri   RemoteIndexer
		h    Hasher
		opts RemoteOptions
	}{
		{"nil indexer", nil, h, RemoteOptions{}},
		{"zero hasher", ri, Hasher{}, RemoteOptions{}},
		{"negative timeout", ri, h, RemoteOptions{Timeout: -1}},
		{"negative concurrency", ri, h, RemoteOptions{MaxConcurrent: -1}},
	}
	for _, c := range cases {
		_, err := NewRemoteSource(c.ri, c.h, c.opts)
		assert.ErrorIs(t, err, state.ErrInvalidConfiguration, c.name)
	}
	s, err := NewRemoteSource(ri, h, RemoteOptions{})
	require.NoError(t, err)
	assert.Equal(t, defaultRemoteTimeout, s.timeout)
	assert.Equal(t, defaultRemoteMaxConcurrent, cap(s.sem))
}

func remote(t *testing.T, fn indexerFunc, opts RemoteOptions) *RemoteSource {
	t.Helper()
	h, err := NewHasher(HasherConfig{BlockTokens: testBlock})
	require.NoError(t, err)
	s, err := NewRemoteSource(fn, h, opts)
	require.NoError(t, err)
	return s
}

func TestRemoteSourceMapsAnswers(t *testing.T) {
	t.Parallel()
	reject := fmt.Errorf("indexer says namespace unknown: %w", state.ErrInvalidSignal)
	boom := errors.New("connection refused")
	cases := []struct {
		name    string
		answer  []EngineMatch
		err     error
		want    Outcome
		reason  string
		engines []EngineMatch
		wantErr error
	}{
		{"hit", []EngineMatch{{"http://a", 2}}, nil, OutcomeHit, "", []EngineMatch{{"http://a", 2}}, nil},
		{"empty answer is a miss", nil, nil, OutcomeMiss, "", nil, nil},
		{"zero counts are a miss", []EngineMatch{{"http://a", 0}}, nil, OutcomeMiss, "", nil, nil},
		{"duplicate engines merge by maximum; URLs are exact", []EngineMatch{{"http://b", 1}, {"http://b/", 2}, {"http://b", 3}}, nil,
			OutcomeHit, "", []EngineMatch{{"http://b", 3}, {"http://b/", 2}}, nil},
		{"counts are capped at the query's blocks", []EngineMatch{{"http://a", math.MaxInt}, {"http://b", 4}}, nil,
			OutcomeHit, "", []EngineMatch{{"http://a", 4}, {"http://b", 4}}, nil},
		{"negative count is invalid", []EngineMatch{{"http://a", -1}}, nil, OutcomeUnavailable, reasonInvalidAnswer, nil, nil},
		{"empty engine is invalid", []EngineMatch{{"", 1}}, nil, OutcomeUnavailable, reasonInvalidAnswer, nil, nil},
		{"backend error is unavailable", nil, boom, OutcomeUnavailable, reasonUnreachable, nil, nil},
		{"rejection is an invalid signal", nil, reject, "", "", nil, state.ErrInvalidSignal},
	}
	for _, c := range cases {
		s := remote(t, func(ctx context.Context, q RemoteQuery) ([]EngineMatch, error) {
			assert.Equal(t, testBlock, q.BlockTokens)
			assert.Len(t, q.Keys, 4)
			assert.Len(t, q.TokenIDs, 4*testBlock)
			return c.answer, c.err
		}, RemoteOptions{})
		r, err := s.Lookup(context.Background(), Query{TokenIDs: prompt(1, 4)})
		if c.wantErr != nil {
			require.ErrorIs(t, err, c.wantErr, c.name)
			continue
		}
		require.NoError(t, err, c.name)
		assert.Equal(t, c.want, r.Outcome, c.name)
		assert.Equal(t, c.reason, r.Reason, c.name)
		assert.Equal(t, c.engines, r.Engines, c.name)
		if c.err != nil {
			assert.ErrorIs(t, r.Err, c.err, c.name)
		}
	}
}

func TestRemoteSourceSkipsIOForShortPrompts(t *testing.T) {
	t.Parallel()
	var calls atomic.Int32
	s := remote(t, func(context.Context, RemoteQuery) ([]EngineMatch, error) {
		calls.Add(1)
		return nil, nil
	}, RemoteOptions{})
	r, err := s.Lookup(context.Background(), Query{TokenIDs: []uint32{1, 2}})
	require.NoError(t, err)
	assert.Equal(t, OutcomeMiss, r.Outcome)
	assert.Zero(t, calls.Load())
}

// TestRemoteSourceHonoursDeadlinesAndLimit: a backend that hangs and ignores its context cannot
// hold a request past the timeout, and hung calls count against the concurrency limit.
func TestRemoteSourceHonoursDeadlinesAndLimit(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	var started atomic.Int32
	s := remote(t, func(ctx context.Context, q RemoteQuery) ([]EngineMatch, error) {
		started.Add(1)
		<-release // ignores ctx on purpose
		return []EngineMatch{{"http://a", 1}}, nil
	}, RemoteOptions{Timeout: 20 * time.Millisecond, MaxConcurrent: 1})

	begin := time.Now()
	r, err := s.Lookup(context.Background(), Query{TokenIDs: prompt(1, 2)})
	require.NoError(t, err)
	assert.Equal(t, OutcomeUnavailable, r.Outcome)
	assert.Equal(t, reasonTimeout, r.Reason)
	assert.ErrorIs(t, r.Err, context.DeadlineExceeded)
	assert.Less(t, time.Since(begin), 2*time.Second, "returned at the deadline, not when the backend did")

	r, err = s.Lookup(context.Background(), Query{TokenIDs: prompt(1, 2)})
	require.NoError(t, err)
	assert.Equal(t, reasonOverloaded, r.Reason, "the hung call still holds the only slot")
	assert.Equal(t, int32(1), started.Load(), "an overloaded lookup is not attempted")

	close(release)
	require.Eventually(t, func() bool {
		r, err := s.Lookup(context.Background(), Query{TokenIDs: prompt(1, 2)})
		return err == nil && r.Outcome == OutcomeHit
	}, 5*time.Second, time.Millisecond, "the slot frees when the hung call returns")

	// The caller's own, shorter deadline applies too.
	slow := remote(t, func(ctx context.Context, q RemoteQuery) ([]EngineMatch, error) {
		<-ctx.Done()
		return nil, ctx.Err()
	}, RemoteOptions{Timeout: time.Hour})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Millisecond)
	defer cancel()
	r, err = slow.Lookup(ctx, Query{TokenIDs: prompt(1, 2)})
	require.NoError(t, err)
	assert.Equal(t, reasonTimeout, r.Reason)
	ctx2, cancel2 := context.WithCancel(context.Background())
	time.AfterFunc(5*time.Millisecond, cancel2)
	r, err = slow.Lookup(ctx2, Query{TokenIDs: prompt(1, 2)})
	require.NoError(t, err)
	assert.Equal(t, reasonCanceled, r.Reason)
}

// countingSource counts lookups and answers with a fixed result after an optional gate.
type countingSource struct {
	calls atomic.Int32
	gate  chan struct{}
	res   Result
	err   error
}

func (c *countingSource) Lookup(ctx context.Context, q Query) (Result, error) {
	c.calls.Add(1)
	if c.gate != nil {
		<-c.gate
	}
	return c.res, c.err
}

type sliceSource []int

func (sliceSource) Lookup(context.Context, Query) (Result, error) { return Result{}, nil }

func TestMemoLooksUpEachSourceOncePerRequest(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	outcomes := []struct {
		name string
		res  Result
		err  error
	}{
		{"hit", Result{Outcome: OutcomeHit, Engines: []EngineMatch{{"a", 1}}, QueryBlocks: 1, BlockTokens: 16}, nil},
		{"miss", Result{Outcome: OutcomeMiss, QueryBlocks: 1, BlockTokens: 16}, nil},
		{"unavailable", Result{Outcome: OutcomeUnavailable, Reason: reasonTimeout, BlockTokens: 16}, nil},
		{"rejected", Result{}, fmt.Errorf("bad: %w", state.ErrInvalidSignal)},
	}
	for _, o := range outcomes {
		src := &countingSource{res: o.res, err: o.err}
		other := &countingSource{res: Result{Outcome: OutcomeMiss}}
		memo := new(Memo)
		for range 3 { // three picks over different groups of one request
			r, err := memo.Lookup(ctx, src, Query{TokenIDs: prompt(1, 1)})
			assert.Equal(t, o.res, r, o.name)
			if o.err != nil {
				assert.ErrorIs(t, err, state.ErrInvalidSignal, o.name)
			} else {
				assert.NoError(t, err, o.name)
			}
			_, _ = memo.Lookup(ctx, other, Query{})
		}
		assert.Equal(t, int32(1), src.calls.Load(), "%s is memoized", o.name)
		assert.Equal(t, int32(1), other.calls.Load(), "each source once")
		_, _ = new(Memo).Lookup(ctx, src, Query{})
		assert.Equal(t, int32(2), src.calls.Load(), "a new request queries again")
	}

	var zero Memo
	_, err := zero.Lookup(ctx, nil, Query{})
	assert.ErrorIs(t, err, state.ErrInvalidConfiguration, "nil source")
	_, err = zero.Lookup(ctx, sliceSource{1}, Query{})
	assert.ErrorIs(t, err, state.ErrInvalidConfiguration, "a non-comparable source cannot be a memo key")
}

func TestMemoSharesOneLookupAcrossConcurrentPicks(t *testing.T) {
	t.Parallel()
	src := &countingSource{gate: make(chan struct{}), res: Result{Outcome: OutcomeHit, Engines: []EngineMatch{{"a", 2}}}}
	memo := new(Memo)
	var wg sync.WaitGroup
	results := make([]Result, 32)
	for i := range results {
		wg.Go(func() {
			r, err := memo.Lookup(context.Background(), src, Query{TokenIDs: prompt(1, 2)})
			assert.NoError(t, err)
			results[i] = r
		})
	}
	require.Eventually(t, func() bool { return src.calls.Load() == 1 }, 5*time.Second, time.Millisecond)

	// A waiter whose own context ends stops waiting; that is not memoized.
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	r, err := memo.Lookup(ctx, src, Query{})
	require.NoError(t, err)
	assert.Equal(t, OutcomeUnavailable, r.Outcome)
	assert.Equal(t, reasonCanceled, r.Reason)

	close(src.gate)
	wg.Wait()
	assert.Equal(t, int32(1), src.calls.Load())
	for _, r := range results {
		assert.Equal(t, 2, r.Blocks("a"))
	}
	r, err = memo.Lookup(context.Background(), src, Query{})
	require.NoError(t, err)
	assert.Equal(t, OutcomeHit, r.Outcome, "the leader's result stays memoized")
}

type panicSource struct{}

func (*panicSource) Lookup(context.Context, Query) (Result, error) { panic("boom") }

func TestMemoSurvivesAPanickingSource(t *testing.T) {
	t.Parallel()
	memo := new(Memo)
	src := &panicSource{}
	assert.Panics(t, func() { _, _ = memo.Lookup(context.Background(), src, Query{}) })
	r, err := memo.Lookup(context.Background(), src, Query{})
	require.NoError(t, err)
	assert.Equal(t, OutcomeUnavailable, r.Outcome)
	assert.Equal(t, reasonUnreachable, r.Reason)
}

func TestMemoHitDoesNotAllocate(t *testing.T) {
	f := sourceFixture(t)
	src := f.source()
	memo := new(Memo)
	q := Query{TokenIDs: prompt(1, 6)}
	ctx := context.Background()
	_, err := memo.Lookup(ctx, src, q)
	require.NoError(t, err)
	allocs := testing.AllocsPerRun(100, func() { _, _ = memo.Lookup(ctx, src, q) })
	assert.Zero(t, allocs)
}

func TestOutcomeString(t *testing.T) {
	t.Parallel()
	for o, want := range map[Outcome]string{OutcomeHit: "hit", OutcomeMiss: "miss", OutcomeUnavailable: "unavailable"} {
		assert.Equal(t, want, fmt.Sprint(o))
	}
	for tier, want := range map[Tier]string{0: "none", TierDevice: "device", TierHost | TierDisk: "host|disk", allTiers | 0x20: "device|host|disk|external|0x20"} {
		assert.Equal(t, want, tier.String())
	}
}
