package sim

import (
	"encoding/binary"
	"fmt"
	"unsafe"

	"github.com/cespare/xxhash/v2"

	"github.com/enginepick/enginepick/kvindex"
	"github.com/enginepick/enginepick/state"
)

// engineHashSeed roots the simulated engines' own block hashes. The engines hash blocks their own
// way, as vLLM and SGLang do; the kvindex never reproduces these hashes and keeps them only as
// opaque IDs (docs/design.md §11).
const engineHashSeed = 0x656e67696e65 // "engine"

// littleEndian reports whether a []uint32 is already the little-endian byte string the engine
// hash is defined over.
var littleEndian = binary.NativeEndian.Uint16([]byte{1, 0}) == 1

// adapterHashRoot returns the root of the engines' block hash chains for the LoRA adapter named
// name: an adapter's blocks never share a hash with the base model's (root engineHashSeed) or
// another adapter's, as vLLM folds the adapter into its block hashes.
func adapterHashRoot(name string) uint64 {
	return mix64(engineHashSeed ^ xxhash.Sum64String(name))
}

// appendEngineHashes appends the engine-side hash of every full block of tokens: a chain in which
// block i's hash is mix64(hash[i-1] XOR xxh64(le32 tokens of block i)), hash[-1] being root
// (engineHashSeed for the base model, adapterHashRoot for an adapter). On big-endian platforms
// scratch is reused for the little-endian encoding; it is returned for the next call.
func appendEngineHashes(dst []uint64, scratch []byte, tokens []uint32, blockTokens int, root uint64) ([]uint64, []byte) {
	h := root
	for len(tokens) >= blockTokens {
		var block []byte
		if littleEndian {
			block = unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(tokens))), 4*blockTokens)
		} else {
			if cap(scratch) < 4*blockTokens {
				scratch = make([]byte, 4*blockTokens)
			}
			block = scratch[:4*blockTokens]
			for i, t := range tokens[:blockTokens] {
				binary.LittleEndian.PutUint32(block[4*i:], t)
			}
		}
		h = mix64(h ^ xxhash.Sum64(block))
		dst = append(dst, h)
		tokens = tokens[blockTokens:]
	}
	return dst, scratch
}

// cacheBlock is one cached KV block of an engine.
type cacheBlock struct {
	hash     uint64 // the engine's own hash (opaque ID in kvindex events)
	parent   int32  // slab index of the previous block, -1 for a prompt's first block
	children int32  // cached blocks whose parent this is
	refs     int32  // running requests holding the block
	prev     int32  // evictable LRU list links (-1: none)
	next     int32
	inLRU    bool
	indexKey uint64 // kvindex key, recorded only when the replay checks the index
}

// kvCache is one engine's KV memory: a prefix cache of full blocks keyed by the engine's chained
// block hash, plus private reservations of running requests (uncached prompt tails, output
// tokens, blocks another request cached first). Unreferenced blocks are evictable; eviction takes
// the least recently released leaf first, as SGLang's radix cache does, so the cache stays
// prefix-closed: every cached block's parent is cached.
//
// Every change of the set of cached blocks is published to the index (BlockStored on insert,
// BlockRemoved on eviction), with the engine's hashes, parent hash and token IDs and
// kvindex.TierDevice: the path real KV events take; a LoRA adapter's stored blocks name the
// adapter (kvindex.StoreEvent.Adapter), as vLLM's events name their lora_name. A kvCache is used
// by one goroutine.
type kvCache struct {
	engine      state.EngineID
	blockTokens int
	capacity    int // tokens

	blocks    []cacheBlock
	freeSlots []int32
	byHash    map[uint64]int32

	lruHead, lruTail int32
	cached           int // blocks in the cache
	evictable        int // cached blocks with refs == 0
	private          int // tokens reserved outside the cache
	peak             int // most tokens ever cached or reserved at once

	indexes   []*kvindex.Index // every router replica's index; none: publish nothing (PD decode engines)
	adapters  []string         // the LoRA adapters' names, by index (resolved.adapters)
	recordKey bool             // keep each block's kvindex key for the end-of-run check
	evicted   []uint64         // scratch for one Remove event
}

// newKVCache returns an empty cache publishing to indexes (nil: nothing), naming the blocks of
// adapter a adapters[a].
func newKVCache(engine state.EngineID, m *EngineModel, indexes []*kvindex.Index, adapters []string, recordKey bool) *kvCache {
	return &kvCache{
		engine:      engine,
		blockTokens: m.BlockTokens,
		capacity:    m.KVCapacityTokens,
		byHash:      make(map[uint64]int32),
		lruHead:     -1,
		lruTail:     -1,
		indexes:     indexes,
		adapters:    adapters,
		recordKey:   recordKey,
	}
}

// free returns the tokens neither cached nor reserved.
func (c *kvCache) free() int { return c.capacity - c.cached*c.blockTokens - c.private }

// used returns the tokens held by running requests: referenced blocks and private reservations
// (SGLang's token usage: capacity minus free minus evictable).
func (c *kvCache) used() int { return (c.cached-c.evictable)*c.blockTokens + c.private }

// canReserve reports whether tokens more can be reserved, evicting if needed.
func (c *kvCache) canReserve(tokens int) bool {
	return tokens <= c.free()+c.evictable*c.blockTokens
}

// reserve sets aside tokens of private KV, evicting unreferenced blocks first when needed. The
// caller checked canReserve. Evictions are published as one BlockRemoved event.
func (c *kvCache) reserve(tokens int) error {
	c.evicted = c.evicted[:0]
	for c.free() < tokens {
		if c.lruHead < 0 {
			return fmt.Errorf("sim: engine %q: KV cache cannot reserve %d tokens (free %d)", c.engine, tokens, c.free())
		}
		c.evictHead()
	}
	c.private += tokens
	c.peak = max(c.peak, c.cached*c.blockTokens+c.private)
	if len(c.evicted) > 0 {
		for _, x := range c.indexes {
			if err := x.Remove(c.engine, 0, c.evicted, kvindex.TierDevice); err != nil {
				return fmt.Errorf("sim: engine %q: publish BlockRemoved: %w", c.engine, err)
			}
		}
	}
	return nil
}

// unreserve returns tokens of private KV.
func (c *kvCache) unreserve(tokens int) { c.private -= tokens }

// evictHead drops the least recently released evictable leaf.
func (c *kvCache) evictHead() {
	i := c.lruHead
	b := &c.blocks[i]
	c.lruUnlink(i)
	c.evicted = append(c.evicted, b.hash)
	delete(c.byHash, b.hash)
	c.cached--
	c.evictable--
	if p := b.parent; p >= 0 {
		pb := &c.blocks[p]
		pb.children--
		if pb.children == 0 && pb.refs == 0 {
			// The parent was used when its child was: it is among the oldest now.
			c.lruPushHead(p)
		}
	}
	*b = cacheBlock{}
	c.freeSlots = append(c.freeSlots, i)
}

// match returns how many leading blocks of hashes the cache holds.
func (c *kvCache) match(hashes []uint64) int {
	for i, h := range hashes {
		if _, ok := c.byHash[h]; !ok {
			return i
		}
	}
	return len(hashes)
}

// acquire references the block with hash h (which must be cached) and returns its slot.
func (c *kvCache) acquire(h uint64) int32 {
	i := c.byHash[h]
	b := &c.blocks[i]
	if b.refs == 0 {
		c.evictable--
		if b.inLRU {
			c.lruUnlink(i)
		}
	}
	b.refs++
	return i
}

// insert caches a new block under parent (a slot the caller references, or -1), referenced once by
// the caller, and moves its tokens from the caller's private reservation into the cache.
func (c *kvCache) insert(h uint64, parent int32, key uint64) int32 {
	var i int32
	if n := len(c.freeSlots); n > 0 {
		i = c.freeSlots[n-1]
		c.freeSlots = c.freeSlots[:n-1]
	} else {
		i = int32(len(c.blocks))
		c.blocks = append(c.blocks, cacheBlock{})
	}
	c.blocks[i] = cacheBlock{hash: h, parent: parent, refs: 1, prev: -1, next: -1}
	if c.recordKey {
		c.blocks[i].indexKey = key
	}
	if parent >= 0 {
		c.blocks[parent].children++
	}
	c.byHash[h] = i
	c.cached++
	c.private -= c.blockTokens
	return i
}

// release drops one reference on each slot of chain, last block first, so that a chain's tail
// becomes the most recent eviction candidate only after its children.
func (c *kvCache) release(chain []int32) {
	for k := len(chain) - 1; k >= 0; k-- {
		i := chain[k]
		b := &c.blocks[i]
		b.refs--
		if b.refs == 0 {
			c.evictable++
			if b.children == 0 {
				c.lruPushTail(i)
			}
		}
	}
}

// publishStored sends one BlockStored event for a run of newly inserted blocks of adapter (-1:
// the base model).
func (c *kvCache) publishStored(adapter int32, parentHash uint64, hasParent bool, hashes []uint64, tokens []uint32) error {
	if len(hashes) == 0 {
		return nil
	}
	ev := kvindex.StoreEvent{
		Engine:      c.engine,
		ParentHash:  parentHash,
		HasParent:   hasParent,
		BlockHashes: hashes,
		TokenIDs:    tokens,
		Tier:        kvindex.TierDevice,
	}
	if adapter >= 0 {
		ev.Adapter = c.adapters[adapter]
	}
	for _, x := range c.indexes {
		if err := x.Store(ev); err != nil {
			return fmt.Errorf("sim: engine %q: publish BlockStored: %w", c.engine, err)
		}
	}
	return nil
}

func (c *kvCache) lruUnlink(i int32) {
	b := &c.blocks[i]
	if b.prev >= 0 {
		c.blocks[b.prev].next = b.next
	} else {
		c.lruHead = b.next
	}
	if b.next >= 0 {
		c.blocks[b.next].prev = b.prev
	} else {
		c.lruTail = b.prev
	}
	b.prev, b.next, b.inLRU = -1, -1, false
}

func (c *kvCache) lruPushTail(i int32) {
	b := &c.blocks[i]
	b.prev, b.next, b.inLRU = c.lruTail, -1, true
	if c.lruTail >= 0 {
		c.blocks[c.lruTail].next = i
	} else {
		c.lruHead = i
	}
	c.lruTail = i
}

func (c *kvCache) lruPushHead(i int32) {
	b := &c.blocks[i]
	b.prev, b.next, b.inLRU = -1, c.lruHead, true
	if c.lruHead >= 0 {
		c.blocks[c.lruHead].prev = i
	} else {
		c.lruTail = i
	}
	c.lruHead = i
}
