package testengine

import (
	"encoding/binary"
	"slices"

	"github.com/cespare/xxhash/v2"
)

// rootHash seeds the hash chain of a prompt's first block (vLLM's NONE_HASH).
const rootHash uint64 = 0x9e3779b97f4a7c15

// chainHash is the hash of one full block: its parent's hash (rootHash for a prompt's first block)
// and its tokens, as vLLM's hash_block_tokens chains them (vllm-project/vllm
// vllm/v1/core/kv_cache_utils.py).
func chainHash(parent uint64, tokens []uint32) uint64 {
	d := xxhash.New()
	var b [8]byte
	binary.LittleEndian.PutUint64(b[:], parent)
	_, _ = d.Write(b[:])
	for _, t := range tokens {
		binary.LittleEndian.PutUint32(b[:4], t)
		_, _ = d.Write(b[:4])
	}
	return d.Sum64()
}

// BlockHashes returns the engine's hashes of the full blocks of tokens, in order: block i's hash
// covers its parent's hash and its blockSize tokens. A partial last block has no hash. These are
// the hashes the engine publishes in BlockStored and BlockRemoved events.
func BlockHashes(tokens []uint32, blockSize int) []uint64 {
	hashes := make([]uint64, len(tokens)/blockSize)
	parent := rootHash
	for i := range hashes {
		parent = chainHash(parent, tokens[i*blockSize:(i+1)*blockSize])
		hashes[i] = parent
	}
	return hashes
}

// Block is a KV block the prefix cache holds.
type Block struct {
	// Hash is the block's hash (BlockHashes).
	Hash uint64
	// Parent is the previous block's hash; HasParent is false for a prompt's first block.
	Parent    uint64
	HasParent bool
	// Tokens are the block's own tokens; Prefix every token from the start of the prompt through
	// the block (the tokens a router hashes to find it).
	Tokens, Prefix []uint32
	// Copies is how many physical blocks hold this hash: like vLLM, the engine does not
	// deduplicate a block computed again while an identical one is cached (a prompt that ends on
	// a block boundary recomputes its last block; the same prompt twice generates the same output
	// blocks twice). Each copy evicted publishes its own BlockRemoved.
	Copies int
}

// block is one physical KV block.
type block struct {
	ref    int  // requests using the block
	cached bool // has a hash and is in pool.byHash
	info   Block
	// prev and next link the free queue; -1 ends it.
	prev, next int
	free       bool
}

// pool is a rank's KV block pool, vLLM's BlockPool (vllm-project/vllm
// vllm/v1/core/block_pool.py): a fixed number of blocks, a free queue in eviction order holding
// every block no request uses (cached ones stay findable until they are reused), and the cached
// blocks by hash. A block is reused from the head of the queue; a request's blocks are freed to its
// tail last block first, so a prompt's tail is evicted before its head. Not safe for concurrent
// use: the rank's mutex guards it.
type pool struct {
	blocks     []block
	head, tail int
	nfree      int
	byHash     map[uint64][]int // hash → the block IDs holding it; the first is the one hits use
}

func newPool(n int) *pool {
	p := &pool{blocks: make([]block, n), byHash: map[uint64][]int{}, head: -1, tail: -1}
	for i := range p.blocks {
		p.pushFree(i)
	}
	return p
}

func (p *pool) pushFree(id int) {
	b := &p.blocks[id]
	b.free, b.prev, b.next = true, p.tail, -1
	if p.tail >= 0 {
		p.blocks[p.tail].next = id
	} else {
		p.head = id
	}
	p.tail = id
	p.nfree++
}

func (p *pool) removeFree(id int) {
	b := &p.blocks[id]
	if b.prev >= 0 {
		p.blocks[b.prev].next = b.next
	} else {
		p.head = b.next
	}
	if b.next >= 0 {
		p.blocks[b.next].prev = b.prev
	} else {
		p.tail = b.prev
	}
	b.free, b.prev, b.next = false, -1, -1
	p.nfree--
}

// hits returns the cached blocks of the longest prefix of hashes found, at most limit blocks: the
// walk stops at the first hash not cached, so a block whose parent was evicted is not reached.
func (p *pool) hits(hashes []uint64, limit int) []int {
	var ids []int
	for _, h := range hashes[:min(limit, len(hashes))] {
		copies := p.byHash[h]
		if len(copies) == 0 {
			break
		}
		ids = append(ids, copies[0])
	}
	return ids
}

// canAllocate reports whether n new blocks can be allocated once the hit blocks are in use: the
// hits that are free leave the queue first.
func (p *pool) canAllocate(n int, hits []int) bool {
	free := p.nfree
	for _, id := range hits {
		if p.blocks[id].ref == 0 {
			free--
		}
	}
	return n <= free
}

// use takes hit blocks for a request (vLLM's touch).
func (p *pool) use(ids []int) {
	for _, id := range ids {
		if p.blocks[id].ref == 0 {
			p.removeFree(id)
		}
		p.blocks[id].ref++
	}
}

// allocate takes n blocks from the head of the free queue, evicting the cached ones; it returns
// the blocks and the hashes evicted, in order. The caller has checked canAllocate.
func (p *pool) allocate(n int) (ids []int, evicted []uint64) {
	for range n {
		id := p.head
		p.removeFree(id)
		b := &p.blocks[id]
		if b.cached {
			evicted = append(evicted, b.info.Hash)
			p.uncache(id)
		}
		b.ref = 1
		ids = append(ids, id)
	}
	return ids, evicted
}

func (p *pool) uncache(id int) {
	b := &p.blocks[id]
	copies := slices.DeleteFunc(p.byHash[b.info.Hash], func(c int) bool { return c == id })
	if len(copies) == 0 {
		delete(p.byHash, b.info.Hash)
	} else {
		p.byHash[b.info.Hash] = copies
	}
	b.cached, b.info = false, Block{}
}

// cache makes a request's full block findable under its hash.
func (p *pool) cache(id int, info Block) {
	b := &p.blocks[id]
	b.cached, b.info = true, info
	p.byHash[info.Hash] = append(p.byHash[info.Hash], id)
}

// release frees a request's blocks, last block first, to the tail of the free queue.
func (p *pool) release(ids []int) {
	for _, id := range slices.Backward(ids) {
		b := &p.blocks[id]
		b.ref--
		if b.ref == 0 {
			p.pushFree(id)
		}
	}
}

// clear forgets every cached block. Every block must be free.
func (p *pool) clear() {
	*p = *newPool(len(p.blocks))
}

// usedBlocks is the number of blocks requests are using.
func (p *pool) usedBlocks() int { return len(p.blocks) - p.nfree }

// held returns the cached blocks, one per hash, sorted by prefix length then hash.
func (p *pool) held() []Block {
	out := make([]Block, 0, len(p.byHash))
	for _, ids := range p.byHash {
		b := p.blocks[ids[0]].info
		b.Copies = len(ids)
		out = append(out, b)
	}
	slices.SortFunc(out, func(a, b Block) int {
		if len(a.Prefix) != len(b.Prefix) {
			return len(a.Prefix) - len(b.Prefix)
		}
		switch {
		case a.Hash < b.Hash:
			return -1
		case a.Hash > b.Hash:
			return 1
		}
		return 0
	})
	return out
}
