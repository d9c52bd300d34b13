package kvindex_test

import (
	"hash/fnv"

	"github.com/fxamacker/cbor/v2"
)

// llmdHasher is the reference hashing scheme of BenchmarkScale/hash-llmd: the block keys of
// llm-d/llm-d-kv-cache `pkg/kvcache/kvblock/token_processor.go` (the best-known Go prefix index),
// written here from its description so that both schemes are measured in one run: the prompt is
// cut into full blocks, and key i is FNV-64a over the canonical CBOR encoding of the array
// [key i−1, block i's token IDs, extra] (extra nil for text), key −1 being FNV-64a of the hash
// seed, hashed once more with the model name as extra. Each block's array is encoded by a
// canonical-mode encoder (fxamacker/cbor), as there.
type llmdHasher struct {
	enc       cbor.EncMode
	blockSize int
	initHash  uint64
}

func newLLMDHasher(blockSize int, model string) (*llmdHasher, error) {
	enc, err := cbor.CanonicalEncOptions().EncMode()
	if err != nil {
		return nil, err
	}
	h := &llmdHasher{enc: enc, blockSize: blockSize}
	seed := fnv.New64a()
	h.initHash = seed.Sum64() // an empty hash seed, llm-d's default
	h.initHash = h.hash(h.initHash, nil, model)
	return h, nil
}

func (h *llmdHasher) hash(parent uint64, tokens []uint32, extra any) uint64 {
	b, err := h.enc.Marshal([]any{parent, tokens, extra})
	if err != nil {
		return 0
	}
	d := fnv.New64a()
	_, _ = d.Write(b)
	return d.Sum64()
}

// keys returns the chained keys of tokens' full blocks, allocating as the original does (the
// chunk list and the result).
func (h *llmdHasher) keys(tokens []uint32) []uint64 {
	var chunks [][]uint32
	for i := 0; i+h.blockSize <= len(tokens); i += h.blockSize {
		chunks = append(chunks, tokens[i:i+h.blockSize])
	}
	out := make([]uint64, len(chunks))
	prefix := h.initHash
	for i, c := range chunks {
		prefix = h.hash(prefix, c, nil)
		out[i] = prefix
	}
	return out
}
