package kvevents

import (
	"slices"
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/enginepick/enginepick/kvindex"
	"github.com/enginepick/enginepick/state"
)

const testBlock = 4 // tokens per block in these tests

// prompt returns n blocks of tokens of prompt p: token i of block b is p<<20 | b<<8 | i.
func prompt(p, n int) []uint32 {
	out := make([]uint32, n*testBlock)
	for i := range out {
		out[i] = uint32(p<<20 | (i/testBlock)<<8 | i%testBlock)
	}
	return out
}

// hashRange returns n engine hashes base+1 … base+n.
func hashRange(base uint64, n int) []uint64 {
	out := make([]uint64, n)
	for i := range out {
		out[i] = base + uint64(i) + 1
	}
	return out
}

func newIndex(t testing.TB, namespace string) *kvindex.Index {
	t.Helper()
	h, err := kvindex.NewHasher(kvindex.HasherConfig{BlockTokens: testBlock, Namespace: namespace})
	require.NoError(t, err)
	x, err := kvindex.NewIndex(h, kvindex.Options{})
	require.NoError(t, err)
	return x
}

// held returns how many leading blocks of prompt p (n blocks) engine holds, by raw Match.
func held(x *kvindex.Index, engine state.EngineID, p, n int) int {
	return x.Match(x.Hasher().Keys(prompt(p, n))).Blocks(engine)
}

// heldUnder returns how many leading blocks of prompt p (n blocks) engine holds under adapter
// ("" the base model), by raw Match on keys from the adapter's root: for an index without a
// namespace, the root of a Hasher namespaced by the adapter (kvindex/hash.go).
func heldUnder(t testing.TB, x *kvindex.Index, adapter string, engine state.EngineID, p, n int) int {
	t.Helper()
	h, err := kvindex.NewHasher(kvindex.HasherConfig{BlockTokens: x.Hasher().BlockTokens(), Namespace: adapter})
	require.NoError(t, err)
	return x.Match(h.Keys(prompt(p, n))).Blocks(engine)
}

// storedArray is a BlockStored in vLLM's legacy positional form with every current field
// (trailing nils, as msgspec writes them for array_like structs).
func storedArray(hashes []uint64, parent any, tokens []uint32, medium any) []any {
	return []any{"BlockStored", hashes, parent, tokens, testBlock, nil, medium, nil, nil, nil, nil, nil}
}

// storedMap is a BlockStored in vLLM's current map form (omit_defaults: defaults left out).
func storedMap(hashes []uint64, parent any, tokens []uint32, medium any) map[string]any {
	return map[string]any{"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
		"token_ids": tokens, "block_size": testBlock, "lora_id": nil, "medium": medium, "lora_name": nil}
}

func removedArray(hashes []uint64, medium any) []any {
	return []any{"BlockRemoved", hashes, medium, nil}
}

func clearedArray() []any { return []any{"AllBlocksCleared"} }

// payload encodes [ts, events, rank] (rank nil: the two-element form).
func payload(t testing.TB, rank any, events ...any) []byte {
	t.Helper()
	b := []any{1789095808.83, events}
	if rank != nil {
		b = append(b, rank)
	}
	out, err := msgpack.Marshal(b)
	require.NoError(t, err)
	return out
}

func mustMarshal(t testing.TB, v any) []byte {
	t.Helper()
	out, err := msgpack.Marshal(v)
	require.NoError(t, err)
	return out
}

// engineStats sums engine's blocks over its ranks in x (Engine set, DPRank 0).
func engineStats(x *kvindex.Index, engine state.EngineID) kvindex.RankStats {
	sum := kvindex.RankStats{Engine: engine}
	for _, r := range x.Stats().Ranks {
		if r.Engine == engine {
			sum.DeviceBlocks += r.DeviceBlocks
			sum.HostBlocks += r.HostBlocks
			sum.DiskBlocks += r.DiskBlocks
			sum.ExternalBlocks += r.ExternalBlocks
			sum.ApproximateBlocks += r.ApproximateBlocks
		}
	}
	return sum
}

// trusted reports whether x marks no DP rank of engine untrusted.
func trusted(x *kvindex.Index, engine state.EngineID) bool {
	return !slices.Contains(x.Stats().Untrusted, engine)
}
