package kvindex

import (
	"context"
	"encoding/binary"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/cespare/xxhash/v2"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/state"
)

// adapterFixture is one index holding prompt 1 three times over: the base model's blocks on
// http://base, adapter A's on http://a (3 blocks, the last through a parent link), adapter B's on
// http://b (2 blocks).
func adapterFixture(t *testing.T) *fixture {
	f := newFixture(t, Options{})
	f.store("http://base", 0, 1, 0, 3, 0, TierDevice)
	ev := f.event("http://a", 0, 1, 0, 2, 100, TierDevice)
	ev.Adapter = "A"
	require.NoError(t, f.x.Store(ev))
	ev = f.event("http://a", 0, 1, 2, 1, 100, TierDevice) // continues A's chain from its parent
	require.NoError(t, f.x.Store(ev))
	ev = f.event("http://b", 0, 1, 0, 2, 200, TierDevice)
	ev.Adapter = "B"
	require.NoError(t, f.x.Store(ev))
	require.NoError(t, checkInvariants(f.x))
	return f
}

// TestAdapterKeySpaces: one index holds every adapter's blocks, each in its own key space. A
// query for adapter A matches only A's blocks, a base-model query only the base model's, an
// unknown adapter nothing, through the local and the remote source alike.
func TestAdapterKeySpaces(t *testing.T) {
	t.Parallel()
	f := adapterFixture(t)
	local := f.source()
	remoteSrc, err := NewRemoteSource(indexBacked(f.x), f.x.Hasher(), RemoteOptions{})
	require.NoError(t, err)
	cases := []struct {
		adapter string
		want    []EngineMatch
	}{
		{"", []EngineMatch{{"http://base", 3}}},
		{"A", []EngineMatch{{"http://a", 3}}},
		{"B", []EngineMatch{{"http://b", 2}}},
		{"C", nil},
	}
	for _, src := range []struct {
		name string
		s    Source
	}{{"local", local}, {"remote", remoteSrc}} {
		for _, tc := range cases {
			r, err := src.s.Lookup(context.Background(), Query{TokenIDs: prompt(1, 4), Adapter: tc.adapter})
			require.NoError(t, err)
			assert.Equal(t, tc.want, r.Engines, "%s lookup, adapter %q", src.name, tc.adapter)
			assert.Equal(t, 4, r.QueryBlocks, "%s lookup, adapter %q", src.name, tc.adapter)
		}
	}
}

// TestAdapterRootIsTheNamespaceRoot: an adapter's chain starts where a Hasher namespaced by the
// adapter starts (hash.go), so a host can compute an adapter's keys for Index.Match with such a
// Hasher; a Hasher with a namespace folds the adapter into its own root.
func TestAdapterRootIsTheNamespaceRoot(t *testing.T) {
	t.Parallel()
	f := adapterFixture(t)
	hA, err := NewHasher(HasherConfig{BlockTokens: testBlock, Namespace: "A"})
	require.NoError(t, err)
	assert.Equal(t, []EngineMatch{{"http://a", 3}}, f.x.Match(hA.Keys(prompt(1, 3))).Engines)
	assert.Equal(t, referenceKeys(testBlock, 0, "A", prompt(1, 3)), hA.appendFrom(nil, f.h.rootFor("A"), prompt(1, 3)))

	ns, err := NewHasher(HasherConfig{BlockTokens: testBlock, Seed: 7, Namespace: "tenant"})
	require.NoError(t, err)
	b := []byte("enginepick/kvindex namespace\x00")
	b = binary.LittleEndian.AppendUint64(b, ns.root)
	b = append(b, "A"...)
	assert.Equal(t, xxhash.Sum64(b), ns.rootFor("A"), "fold(root, adapter)")
	assert.Equal(t, ns.root, ns.rootFor(""), "the base model keeps the root")
}

// TestPlaceUnderAdapter: a route-time placement for an adapter is found only by that adapter's
// queries.
func TestPlaceUnderAdapter(t *testing.T) {
	t.Parallel()
	f := newFixture(t, Options{})
	src := f.source()
	q := Query{TokenIDs: prompt(3, 2), Adapter: "A"}
	r, err := src.Lookup(context.Background(), q)
	require.NoError(t, err)
	require.Equal(t, OutcomeMiss, r.Outcome)
	require.NoError(t, src.Place("http://x", 0, q, &r))
	for _, tc := range []struct {
		adapter string
		want    []EngineMatch
	}{{"A", []EngineMatch{{"http://x", 2}}}, {"", nil}, {"B", nil}} {
		got, err := src.Lookup(context.Background(), Query{TokenIDs: prompt(3, 2), Adapter: tc.adapter})
		require.NoError(t, err)
		assert.Equal(t, tc.want, got.Engines, "adapter %q", tc.adapter)
	}
	// A result for another adapter is not reused: the placement is hashed under q's adapter.
	base, err := src.Lookup(context.Background(), Query{TokenIDs: prompt(4, 2)})
	require.NoError(t, err)
	require.NoError(t, src.Place("http://y", 0, Query{TokenIDs: prompt(4, 2), Adapter: "B"}, &base))
	got, err := src.Lookup(context.Background(), Query{TokenIDs: prompt(4, 2), Adapter: "B"})
	require.NoError(t, err)
	assert.Equal(t, []EngineMatch{{"http://y", 2}}, got.Engines)
	got, err = src.Lookup(context.Background(), Query{TokenIDs: prompt(4, 2)})
	require.NoError(t, err)
	assert.Nil(t, got.Engines)
}

// TestMemoKeysOnAdapter: a Memo answers a second lookup of one source for the same adapter from
// memory, and looks up again for another adapter.
func TestMemoKeysOnAdapter(t *testing.T) {
	t.Parallel()
	f := adapterFixture(t)
	cs := &countingLocal{inner: f.source()}
	var m Memo
	for _, tc := range []struct {
		adapter string
		want    []EngineMatch
		calls   int32
	}{
		{"A", []EngineMatch{{"http://a", 3}}, 1},
		{"A", []EngineMatch{{"http://a", 3}}, 1},
		{"", []EngineMatch{{"http://base", 3}}, 2},
		{"B", []EngineMatch{{"http://b", 2}}, 3},
		{"", []EngineMatch{{"http://base", 3}}, 3},
	} {
		r, err := m.Lookup(context.Background(), cs, Query{TokenIDs: prompt(1, 3), Adapter: tc.adapter})
		require.NoError(t, err)
		assert.Equal(t, tc.want, r.Engines, "adapter %q", tc.adapter)
		assert.Equal(t, tc.calls, cs.calls.Load(), "lookups after adapter %q", tc.adapter)
	}
}

// TestRemoteQueryCarriesAdapter: the remote indexer receives the adapter and the keys chained
// from its root.
func TestRemoteQueryCarriesAdapter(t *testing.T) {
	t.Parallel()
	h, err := NewHasher(HasherConfig{BlockTokens: testBlock})
	require.NoError(t, err)
	var got RemoteQuery
	src := remote(t, func(_ context.Context, q RemoteQuery) ([]EngineMatch, error) {
		got = RemoteQuery{TokenIDs: q.TokenIDs, Keys: append([]uint64(nil), q.Keys...), BlockTokens: q.BlockTokens, Adapter: q.Adapter}
		return []EngineMatch{{Engine: state.EngineID("http://a"), Blocks: 1}}, nil
	}, RemoteOptions{})
	_, err = src.Lookup(context.Background(), Query{TokenIDs: prompt(1, 2), Adapter: "A"})
	require.NoError(t, err)
	assert.Equal(t, "A", got.Adapter)
	assert.Equal(t, referenceKeys(testBlock, 0, "A", prompt(1, 2)), got.Keys)
	assert.NotEqual(t, h.Keys(prompt(1, 2)), got.Keys)
}

// countingLocal counts the lookups it passes to a LocalSource.
type countingLocal struct {
	inner *LocalSource
	calls atomic.Int32
}

func (c *countingLocal) Lookup(ctx context.Context, q Query) (Result, error) {
	c.calls.Add(1)
	return c.inner.Lookup(ctx, q)
}

// TestMemoAdaptersConcurrently: concurrent lookups of one source for two adapters run one lookup
// per adapter, each caller getting its adapter's answer.
func TestMemoAdaptersConcurrently(t *testing.T) {
	t.Parallel()
	f := adapterFixture(t)
	cs := &countingLocal{inner: f.source()}
	var m Memo
	want := map[string][]EngineMatch{"A": {{"http://a", 3}}, "B": {{"http://b", 2}}}
	var wg sync.WaitGroup
	for i := range 16 {
		adapter := []string{"A", "B"}[i%2]
		wg.Go(func() {
			r, err := m.Lookup(context.Background(), cs, Query{TokenIDs: prompt(1, 3), Adapter: adapter})
			assert.NoError(t, err)
			assert.Equal(t, want[adapter], r.Engines, "adapter %q", adapter)
		})
	}
	wg.Wait()
	assert.EqualValues(t, 2, cs.calls.Load())
}
