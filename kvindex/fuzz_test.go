package kvindex

import (
	"encoding/binary"
	"errors"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/state"
)

// byteRand turns the fuzzer's bytes into the walk's choices: one byte per choice (two for
// choices over more than 256 values), 0 once the bytes run out.
type byteRand struct{ data []byte }

func (r *byteRand) IntN(n int) int {
	if len(r.data) == 0 {
		return 0
	}
	v := int(r.data[0])
	r.data = r.data[1:]
	if n > 256 && len(r.data) > 0 {
		v = v<<8 | int(r.data[0])
		r.data = r.data[1:]
	}
	return v % n
}

func pcgBytes(seed uint64, n int) []byte {
	rng := rand.New(rand.NewPCG(seed, 42))
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(rng.Uint32())
	}
	return b
}

// FuzzStoreRemove decodes the input into a sequence of index operations (the random walk's:
// store, remove, clear, remove engine, assume, expire, clock advance, with the walk's error
// injections) and applies each to the Index and to the reference model. After every operation
// the errors must agree (a refused operation must be refused by both, with the same sentinel),
// the internal invariants must hold, and Stats and Match on prompts drawn from the input must
// equal the model's. Each operation reads: engine (1 byte, of 4), rank (1 byte, of 2), operation
// (1 byte: < 45 store, < 65 remove, < 70 clear, < 73 remove engine, < 88 assume, < 93 expire,
// else advance the clock), then that operation's own choices.
func FuzzStoreRemove(f *testing.F) {
	// Nothing: no operation at all.
	f.Add([]byte{})
	// All zeros: e0/0 stores a one-block prompt with one token too few, over and over
	// (ErrBlockSizeMismatch every time, nothing stored).
	f.Add(make([]byte, 64))
	// A store of a 3-block prompt by e1/1, then an attempt to remove it (engine 1, rank 1).
	f.Add([]byte{1, 1, 10, 2, 0, 1, 2, 1, 1, 3, 0, 0, 9, 7, 1, 1, 50, 0, 0, 0, 0})
	// e2 assumes a prompt, the clock advances past the default TTL twice, then expire.
	f.Add([]byte{2, 0, 80, 3, 1, 1, 1, 1, 3, 0, 0, 99, 200, 250, 0, 0, 99, 200, 250, 0, 0, 90})
	// Random walks: the same operation mix as TestRandomWalkAgreesWithModel.
	for seed := range uint64(4) {
		f.Add(pcgBytes(seed, 600))
	}
	h, err := NewHasher(HasherConfig{BlockTokens: walkBlockTokens, Seed: 7})
	require.NoError(f, err)
	f.Fuzz(func(t *testing.T, data []byte) {
		r := &byteRand{data: data}
		w := newWalk(t, h, r)
		for step := 0; len(r.data) > 0 && step < 300; step++ {
			w.step()
		}
	})
}

// FuzzHasher checks the Hasher against the from-scratch definition for any tokens, block size,
// seed and namespace: equal keys, the portable path agreeing, chaining from a key continuing the
// same chain, and invalid block sizes refused with ErrInvalidConfiguration, never a panic.
func FuzzHasher(f *testing.F) {
	// Empty input: no keys whatever the block size.
	f.Add([]byte{}, 16, uint64(0), "")
	// Block size 0 and negative: refused.
	f.Add([]byte{1, 2, 3, 4}, 0, uint64(0), "")
	f.Add([]byte{1, 2, 3, 4}, -3, uint64(1), "")
	// Three one-token blocks, a trailing partial byte run, a seed and a namespace.
	f.Add([]byte{1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 9, 9}, 1, uint64(1337), "lora-a")
	// Two 16-token blocks of 0xFF tokens.
	f.Add(make([]byte, 128), 16, uint64(1<<63), "ns")
	f.Fuzz(func(t *testing.T, data []byte, blockTokens int, seed uint64, namespace string) {
		h, err := NewHasher(HasherConfig{BlockTokens: blockTokens, Seed: seed, Namespace: namespace})
		if blockTokens <= 0 || blockTokens > maxBlockTokens {
			require.ErrorIs(t, err, state.ErrInvalidConfiguration)
			return
		}
		require.NoError(t, err)
		tokens := make([]uint32, len(data)/4)
		for i := range tokens {
			tokens[i] = binary.LittleEndian.Uint32(data[4*i:])
		}
		want := referenceKeys(blockTokens, seed, namespace, tokens)
		got := h.Keys(tokens)
		require.Equal(t, len(want), len(got))
		if len(want) == 0 {
			return
		}
		require.Equal(t, want, got)
		require.Equal(t, want, appendPortable(nil, h.root, tokens, blockTokens))
		if len(want) > 1 {
			require.Equal(t, want[1:], h.appendFrom(nil, want[0], tokens[blockTokens:]))
		}
	})
}

// FuzzTable applies put/del/get operations decoded from the input to the open-addressing table
// and to a map: each operation is one op byte (mod 3: put, add, delete) and one key byte (keys
// are spread multiples of the byte, 0 included, so probe runs collide and wrap).
func FuzzTable(f *testing.F) {
	// Nothing.
	f.Add([]byte{})
	// Put keys 0..7, add key 3 again, delete them in reverse: growth, key 0, backward shifts.
	f.Add([]byte{0, 0, 0, 1, 0, 2, 0, 3, 0, 4, 0, 5, 0, 6, 0, 7, 1, 3, 2, 7, 2, 6, 2, 5, 2, 4, 2, 3, 2, 2, 2, 1, 2, 0})
	// Random operations.
	f.Add(pcgBytes(1, 512))
	f.Fuzz(func(t *testing.T, data []byte) {
		var tb table
		ref := map[uint64]uint32{}
		for i := 0; i+1 < len(data); i += 2 {
			k := uint64(data[i+1]) * 0x0101010100000000
			switch v := uint32(data[i]) + 1; data[i] % 3 {
			case 0:
				tb.put(k, v)
				ref[k] = v
			case 1:
				old, had := ref[k]
				got, present := tb.add(k, v)
				if present != had || got != old {
					t.Fatalf("add(%#x) = %d, %v; want %d, %v", k, got, present, old, had)
				}
				if !had {
					ref[k] = v
				}
			default:
				_, had := ref[k]
				if had != tb.del(k) {
					t.Fatalf("del(%#x) = %v, want %v", k, !had, had)
				}
				delete(ref, k)
			}
			if tb.len() != len(ref) {
				t.Fatalf("len %d, want %d", tb.len(), len(ref))
			}
		}
		for k, v := range ref {
			got, ok := tb.get(k)
			if !ok || got != v {
				t.Fatalf("get(%#x) = %d, %v; want %d", k, got, ok, v)
			}
		}
		if _, ok := tb.get(0xFFFF); ok != (ref[0xFFFF] != 0) {
			t.Fatal(errors.New("phantom key"))
		}
	})
}
