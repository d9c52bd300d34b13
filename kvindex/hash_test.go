package kvindex

import (
	"encoding/binary"
	"fmt"
	"math/bits"
	"math/rand/v2"
	"testing"

	"github.com/cespare/xxhash/v2"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/state"
)

// referenceKeys recomputes the Hasher definition from scratch: bytes built by hand, one
// xxhash.Sum64 per block, the chaining step written out with literal XXH64 primes.
func referenceKeys(blockTokens int, seed uint64, namespace string, tokens []uint32) []uint64 {
	root := seed
	if namespace != "" {
		b := []byte("enginepick/kvindex namespace\x00")
		b = binary.LittleEndian.AppendUint64(b, seed)
		b = append(b, namespace...)
		root = xxhash.Sum64(b)
	}
	var keys []uint64
	key := root
	for i := 0; i+blockTokens <= len(tokens); i += blockTokens {
		var b []byte
		for _, t := range tokens[i : i+blockTokens] {
			b = binary.LittleEndian.AppendUint32(b, t)
		}
		r := bits.RotateLeft64(xxhash.Sum64(b)*0xC2B2AE3D27D4EB4F, 31) * 0x9E3779B185EBCA87
		key = (key^r)*0x9E3779B185EBCA87 + 0x85EBCA77C2B2AE63
		keys = append(keys, key)
	}
	return keys
}

func seq(from, n int) []uint32 {
	s := make([]uint32, n)
	for i := range s {
		s[i] = uint32(from + i)
	}
	return s
}

// TestHasherGolden pins exact key values: changing them silently would split every deployed
// router's keys from its peers' (the values were computed once and then hard-coded).
func TestHasherGolden(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name      string
		cfg       HasherConfig
		tokens    []uint32
		want      []uint64
		rationale string
	}{
		{"block=4,seed=0", HasherConfig{BlockTokens: 4}, seq(0, 12),
			[]uint64{0xb0a4b9f3664e5337, 0x01b4604d0218a5bd, 0x27eb5cff24b98052}, "three full blocks"},
		{"block=16,partial", HasherConfig{BlockTokens: 16}, seq(1, 40),
			[]uint64{0xd49b54883dce2a16, 0x1f6aa5747369bdff}, "the trailing 8 tokens have no key"},
		{"block=4,seed=1337", HasherConfig{BlockTokens: 4, Seed: 1337}, seq(0, 12),
			[]uint64{0xf226bfc43e1d1fd6, 0x4ac32c1464b976e4, 0x336fe22f808e3263}, "the seed changes every key"},
		{"block=4,namespace", HasherConfig{BlockTokens: 4, Namespace: "lora-a"}, seq(0, 12),
			[]uint64{0xff10c7ff672e22ba, 0xa3788f6c4bbcb4e0, 0x7141f889ced12a7f}, "a namespace changes every key"},
		{"block=1,extremes", HasherConfig{BlockTokens: 1}, []uint32{0xFFFFFFFF, 0},
			[]uint64{0xea34d97a730c190f, 0x1ff4ba24d7d3c712}, "token IDs are hashed as little-endian uint32"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			h, err := NewHasher(c.cfg)
			require.NoError(t, err)
			assert.Equal(t, c.want, h.Keys(c.tokens), "Keys: %s", c.rationale)
			assert.Equal(t, c.want, referenceKeys(c.cfg.BlockTokens, c.cfg.Seed, c.cfg.Namespace, c.tokens),
				"from-scratch computation: %s", c.rationale)
			assert.Equal(t, c.want, appendPortable(nil, h.root, c.tokens, c.cfg.BlockTokens), "portable path")
		})
	}
}

// TestHasherMatchesReference crosses block sizes, seeds, namespaces and lengths (including 0,
// short, exact and partial) against the from-scratch computation, and checks the portable
// big-endian path, the chained-from-parent form and AppendKeys' append semantics.
func TestHasherMatchesReference(t *testing.T) {
	t.Parallel()
	rng := rand.New(rand.NewPCG(1, 2))
	for _, b := range []int{1, 2, 3, 16, 64, 255, 256, 257, 600} {
		for _, seed := range []uint64{0, 1337, 1 << 63} {
			for _, ns := range []string{"", "ns", "lora/adapter-7"} {
				for _, n := range []int{0, 1, b - 1, b, b + 1, 3 * b, 3*b + b/2} {
					if n < 0 {
						continue
					}
					name := fmt.Sprintf("block=%d,seed=%d,ns=%q,tokens=%d", b, seed, ns, n)
					tokens := make([]uint32, n)
					for i := range tokens {
						tokens[i] = rng.Uint32()
					}
					h, err := NewHasher(HasherConfig{BlockTokens: b, Seed: seed, Namespace: ns})
					require.NoError(t, err, name)
					want := referenceKeys(b, seed, ns, tokens)
					got := h.Keys(tokens)
					if len(want) == 0 {
						assert.Nil(t, got, name)
					} else {
						assert.Equal(t, want, got, name)
					}
					assert.Equal(t, len(want), h.blocks(n), name)
					assert.Equal(t, want, appendPortable(nil, h.root, tokens, b), "portable "+name)
					prefix := []uint64{42}
					assert.Equal(t, append([]uint64{42}, want...), h.AppendKeys(prefix, tokens), "append "+name)
					if len(want) >= 2 {
						// Chaining from block 0's key over the rest gives the rest's keys.
						assert.Equal(t, want[1:], h.appendFrom(nil, want[0], tokens[b:]), "chained "+name)
					}
				}
			}
		}
	}
}

func TestHasherProperties(t *testing.T) {
	t.Parallel()
	h, err := NewHasher(HasherConfig{BlockTokens: 4})
	require.NoError(t, err)
	a := h.Keys([]uint32{1, 2, 3, 4, 5, 6, 7, 8})
	b := h.Keys([]uint32{1, 2, 3, 4, 5, 6, 7, 9})
	c := h.Keys([]uint32{9, 2, 3, 4, 5, 6, 7, 8})
	assert.Equal(t, a[0], b[0], "same first block, same first key")
	assert.NotEqual(t, a[1], b[1], "a different second block changes the second key")
	assert.NotEqual(t, a[1], c[1], "a different first block changes every later key (chaining)")
	swapped := h.Keys([]uint32{5, 6, 7, 8, 1, 2, 3, 4})
	assert.NotEqual(t, a[1], swapped[1], "block order matters")

	other, err := NewHasher(HasherConfig{BlockTokens: 4, Namespace: "x"})
	require.NoError(t, err)
	assert.NotEqual(t, a[0], other.Keys([]uint32{1, 2, 3, 4})[0], "namespaces never share keys")
	zeroNS, err := NewHasher(HasherConfig{BlockTokens: 4, Seed: 0, Namespace: ""})
	require.NoError(t, err)
	assert.Equal(t, h, zeroNS, "an empty namespace is no namespace")

	var zero Hasher
	assert.Nil(t, zero.Keys(seq(0, 100)), "the zero Hasher has no keys")
	assert.Equal(t, 0, zero.blocks(100))
	assert.Equal(t, 0, h.blocks(-5), "negative token counts have no blocks")
	assert.Equal(t, []uint64{7}, zero.AppendKeys([]uint64{7}, seq(0, 100)))
}

func TestNewHasherRejectsBlockSize(t *testing.T) {
	t.Parallel()
	for _, b := range []int{0, -1, -16, maxBlockTokens + 1} {
		_, err := NewHasher(HasherConfig{BlockTokens: b})
		assert.ErrorIs(t, err, state.ErrInvalidConfiguration, "NewHasher(BlockTokens=%d)", b)
	}
	_, err := NewHasher(HasherConfig{BlockTokens: maxBlockTokens})
	assert.NoError(t, err, "the cap itself is valid")
}

func TestAppendKeysDoesNotAllocate(t *testing.T) {
	h, err := NewHasher(HasherConfig{BlockTokens: 16})
	require.NoError(t, err)
	tokens := seq(0, 8192)
	dst := make([]uint64, 0, 512)
	allocs := testing.AllocsPerRun(50, func() { dst = h.AppendKeys(dst[:0], tokens) })
	assert.Zero(t, allocs, "AppendKeys into a buffer with room")
	allocs = testing.AllocsPerRun(50, func() { dst = appendPortable(dst[:0], h.root, tokens, 16) })
	assert.Zero(t, allocs, "portable path")
}
