package kvindex

import (
	"encoding/binary"
	"fmt"
	"math/bits"
	"unsafe"

	"github.com/cespare/xxhash/v2"

	"github.com/enginepick/enginepick/state"
)

// maxBlockTokens is the largest block size, in tokens, a Hasher accepts. Engines use 16 to 512
// tokens per block (vLLM 16 by default, the Mooncake traces 512; docs/traces.md); the cap only
// rejects nonsense before it can overflow a byte count.
const maxBlockTokens = 1 << 16

// XXH64 primes (the public XXH64 specification), used by the chaining step.
const (
	prime1 uint64 = 11400714785074694791
	prime2 uint64 = 14029467366897019727
	prime4 uint64 = 9650029242287828579
)

// namespaceTag separates a namespaced root from any plain seed.
const namespaceTag = "enginepick/kvindex namespace\x00"

// littleEndian reports whether the platform stores a uint32 in little-endian byte order, in which
// case a []uint32 of token IDs already is the byte string the keys are defined over.
var littleEndian = binary.NativeEndian.Uint16([]byte{1, 0}) == 1

// HasherConfig configures a Hasher. Its zero value is not valid: BlockTokens must be set.
type HasherConfig struct {
	// BlockTokens is the block size in tokens: the engine's page size (vLLM block_size, SGLang
	// page_size). It must be in [1, 65536]; 0 or negative is an error. Every engine whose
	// events feed one Index must use this block size (docs/design.md
	// §11).
	BlockTokens int
	// Seed is the root of every chain. Zero is a valid seed. Two Hashers with different seeds
	// produce unrelated keys.
	Seed uint64
	// Namespace is a cache namespace folded into the root, so that the same tokens under
	// different namespaces never share a key (docs/design.md §11). The empty string means no
	// namespace and leaves the root equal to Seed. LoRA adapters need no namespace of their own:
	// each request and event names its adapter (Query.Adapter, StoreEvent.Adapter), which is
	// folded into the root the same way (see Hasher).
	Namespace string
}

// Hasher computes the index's chained 64-bit block keys over token IDs. It is the only place keys
// are computed: request lookups and KV events are hashed by the same code, so a request's key i
// equals an engine block's key exactly when both have the same first (i+1)×BlockTokens tokens
// under the same configuration (up to 64-bit hash collisions). The engine's own block hash is
// never reproduced (docs/design.md §11).
//
// Definition. Let fold(r, s) = XXH64(namespaceTag ‖ le64(r) ‖ s) with namespaceTag
// "enginepick/kvindex namespace\x00"; root = Seed when Namespace is empty, otherwise
// root = fold(Seed, Namespace). The chain of a prompt for LoRA adapter A (A non-empty) starts at
// root_A = fold(root, A) instead of root: for a Hasher without Namespace, exactly the root of a
// Hasher whose Namespace is A; the base model (A empty) starts at root. For full block i (tokens
// [i×B, (i+1)×B)):
//
//	content[i] = XXH64(le32(token) for each token of block i)        (cespare/xxhash Sum64, seed 0)
//	key[i]     = (key[i-1] XOR round(content[i])) × prime1 + prime4  (mod 2^64), key[-1] = root_A
//	round(x)   = rotl64(x × prime2, 31) × prime1
//
// round and the merge are XXH64's own accumulator steps. The chain is a bijection in key[i-1] for a
// fixed block and in content[i] for a fixed parent, so two different blocks under one parent, or
// one block under two different parents, never share a key; equal keys imply equal prefixes up to
// a 2^-64 chance. Hashing each block's content independently lets the CPU overlap blocks, which is
// why this form is used rather than XXH64 over le64(key[i-1]) ‖ tokens (about 1.4× slower in
// BenchmarkHashAlternatives: the whole digest sits on the serial chain). A trailing partial block
// has no key.
//
// A Hasher is a small immutable value, safe for concurrent use and cheap to copy. The zero Hasher
// has block size 0 and produces no keys; build one with NewHasher.
type Hasher struct {
	blockTokens int
	root        uint64
}

// NewHasher validates cfg and returns its Hasher. A BlockTokens outside [1, 65536] returns
// an error wrapping state.ErrInvalidConfiguration that names the field and the value.
func NewHasher(cfg HasherConfig) (Hasher, error) {
	if cfg.BlockTokens <= 0 || cfg.BlockTokens > maxBlockTokens {
		return Hasher{}, fmt.Errorf("kvindex: HasherConfig.BlockTokens: %d, must be in [1, %d]: %w",
			cfg.BlockTokens, maxBlockTokens, state.ErrInvalidConfiguration)
	}
	root := cfg.Seed
	if cfg.Namespace != "" {
		root = fold(cfg.Seed, cfg.Namespace)
	}
	return Hasher{blockTokens: cfg.BlockTokens, root: root}, nil
}

// fold returns XXH64(namespaceTag ‖ le64(root) ‖ s): the root of a chain namespaced by s (see
// Hasher).
func fold(root uint64, s string) uint64 {
	var d xxhash.Digest
	d.Reset()
	_, _ = d.WriteString(namespaceTag)
	var r [8]byte
	binary.LittleEndian.PutUint64(r[:], root)
	_, _ = d.Write(r[:])
	_, _ = d.WriteString(s)
	return d.Sum64()
}

// rootFor returns the root of adapter's chains: the Hasher's root for the base model (adapter
// empty), else fold(root, adapter) (see Hasher).
func (h Hasher) rootFor(adapter string) uint64 {
	if adapter == "" {
		return h.root
	}
	return fold(h.root, adapter)
}

// BlockTokens returns the block size in tokens; 0 for the zero Hasher.
func (h Hasher) BlockTokens() int { return h.blockTokens }

// blocks returns the number of full blocks (and so of keys) in a prompt of the given number of
// tokens: tokens / BlockTokens, rounded down. It returns 0 for the zero Hasher and for tokens ≤ 0.
func (h Hasher) blocks(tokens int) int {
	if h.blockTokens <= 0 || tokens <= 0 {
		return 0
	}
	return tokens / h.blockTokens
}

// Keys returns the chained keys of every full block of tokens, in a new slice. It returns nil when
// tokens holds no full block (including empty or nil tokens, and the zero Hasher).
func (h Hasher) Keys(tokens []uint32) []uint64 {
	n := h.blocks(len(tokens))
	if n == 0 {
		return nil
	}
	return h.AppendKeys(make([]uint64, 0, n), tokens)
}

// AppendKeys appends the chained key of every full block of tokens to dst and returns the extended
// slice, like append. It allocates only when dst lacks capacity for len(tokens)/BlockTokens more keys,
// so a caller that reuses dst hashes without allocating. tokens is only read. A trailing partial
// block, an empty tokens and the zero Hasher append nothing.
func (h Hasher) AppendKeys(dst []uint64, tokens []uint32) []uint64 {
	return h.appendFrom(dst, h.root, tokens)
}

// appendFrom appends the keys of tokens' full blocks chained from parent, the key of the block
// before tokens[0] (root for a prompt's first block).
func (h Hasher) appendFrom(dst []uint64, parent uint64, tokens []uint32) []uint64 {
	b := h.blockTokens
	if b <= 0 || len(tokens) < b {
		return dst
	}
	dst = growKeys(dst, len(tokens)/b)
	if !littleEndian {
		return appendPortable(dst, parent, tokens, b)
	}
	key := parent
	for len(tokens) >= b {
		block := unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(tokens))), 4*b)
		key = chain(key, xxhash.Sum64(block))
		dst = append(dst, key)
		tokens = tokens[b:]
	}
	return dst
}

// appendPortable is appendFrom for any byte order: it encodes tokens as little-endian uint32 into
// a stack buffer and streams them through a Digest. It yields the same keys as the fast path.
func appendPortable(dst []uint64, parent uint64, tokens []uint32, b int) []uint64 {
	var buf [4 * 256]byte
	var d xxhash.Digest
	key := parent
	for len(tokens) >= b {
		d.Reset()
		block := tokens[:b]
		for len(block) > 0 {
			n := min(len(block), 256)
			for i, t := range block[:n] {
				binary.LittleEndian.PutUint32(buf[4*i:], t)
			}
			_, _ = d.Write(buf[:4*n])
			block = block[n:]
		}
		key = chain(key, d.Sum64())
		dst = append(dst, key)
		tokens = tokens[b:]
	}
	return dst
}

// next returns the key of one full block (len(block) == BlockTokens) chained from parent; it is
// the key appendFrom would compute for that block.
func (h Hasher) next(parent uint64, block []uint32) uint64 {
	if !littleEndian {
		return appendPortable(nil, parent, block, len(block))[0]
	}
	return chain(parent, xxhash.Sum64(unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(block))), 4*len(block))))
}

// chain folds one block's content hash into its parent's key (see Hasher).
func chain(parent, content uint64) uint64 {
	r := bits.RotateLeft64(content*prime2, 31) * prime1
	return (parent^r)*prime1 + prime4
}

// growKeys makes room for n more keys in dst.
func growKeys(dst []uint64, n int) []uint64 {
	if cap(dst)-len(dst) >= n {
		return dst
	}
	out := make([]uint64, len(dst), len(dst)+n)
	copy(out, dst)
	return out
}
