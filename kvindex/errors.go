package kvindex

import (
	"errors"
	"fmt"
	"strings"

	"github.com/enginepick/enginepick/state"
)

// Sentinel errors for events and placements the Index refuses. Every one of them is returned
// wrapped in an *EventError that names the operation, the engine, the DP rank and the offending
// hashes; test with errors.Is. A refused operation leaves the Index exactly as it was: each
// operation validates everything before it changes anything.
//
// What the caller does with them: ErrUnknownParent and ErrUnknownHash mean the index and the
// engine's event stream disagree (a lost event, a restart, or a block the index evicted under its
// cap), so an event subscriber should resynchronise that engine's DP rank (replay, or Clear and
// rebuild) (docs/design.md §11). The others mean a malformed event or a misconfigured
// publisher: log it and drop the event.
var (
	// ErrInvalidEngine: Store, Remove, Clear, RemoveEngine or a placement named the empty engine ID.
	// Every engine has a non-empty ID (state.Engine), so an empty one is a publisher or decoder
	// that lost the engine's identity: drop the event and fix the publisher.
	ErrInvalidEngine = errors.New("invalid engine ID")
	// ErrUnknownEngine: Remove, Clear or RemoveEngine named an engine, or an engine's DP rank,
	// that has never stored a block (or was removed).
	ErrUnknownEngine = errors.New("unknown engine")
	// ErrUnknownParent: a Store named a parent hash the engine's DP rank does not hold
	// (ParentBlockNotFound in ai-dynamo/dynamo `lib/kv-router/src/radix_tree.rs`).
	ErrUnknownParent = errors.New("unknown parent block hash")
	// ErrUnknownHash: a Remove named a block hash the engine's DP rank does not hold. The
	// EventError lists every unknown hash, so the caller may retry with the others.
	ErrUnknownHash = errors.New("unknown block hash")
	// ErrBlockSizeMismatch: a Store's token count is not exactly its block count × the index's
	// block size: the engine uses another block size, or the event lost tokens. The EventError's
	// Err is a *BlockSizeError that wraps it and carries the counts.
	ErrBlockSizeMismatch = errors.New("block size mismatch")
	// ErrDuplicateHash: a Store names the same block hash twice, or a hash the engine's DP rank
	// already holds for a different block.
	ErrDuplicateHash = errors.New("duplicate block hash")
	// ErrCyclicChain: a Store's parent hash is one of its own block hashes (Dynamo
	// InvalidBlockSequence), so the chain would loop.
	ErrCyclicChain = errors.New("cyclic block chain")
	// ErrKeyConflict: a block key is already in the index under a different parent block. For a
	// Store or a placement this is a 64-bit hash collision.
	ErrKeyConflict = errors.New("block key conflict")
	// ErrInvalidTier: a Store's tier is empty or has bits outside the four Tier bits, or a
	// Remove's tier has bits outside them.
	ErrInvalidTier = errors.New("invalid storage tier")
	// ErrInvalidRank: a negative DP rank.
	ErrInvalidRank = errors.New("invalid DP rank")
	// ErrTooManyHolders: one block would carry more than 2^24-1 (engine, rank, hash) entries.
	ErrTooManyHolders = errors.New("too many holders for one block")
)

// EventError reports an Index operation that was refused. Err is one of the sentinels above, or an
// error wrapping one (a *BlockSizeError for ErrBlockSizeMismatch); Unwrap returns it, so
// errors.Is(err, ErrUnknownParent) works on the *EventError.
type EventError struct {
	// Op is the Index method: "store", "remove", "clear", "remove engine" or "assume".
	Op string
	// Engine and DPRank name the holder the operation addressed.
	Engine state.EngineID
	DPRank int
	// Hashes are the offending engine block hashes (or, for "assume", block keys): every unknown
	// hash for ErrUnknownHash, the parent for ErrUnknownParent, the repeated value for
	// ErrDuplicateHash and ErrCyclicChain. Empty when no hash is at fault.
	Hashes []uint64
	// Err is the sentinel, or a *BlockSizeError wrapping ErrBlockSizeMismatch.
	Err error
}

// Error implements error.
func (e *EventError) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "kvindex: %s engine %q rank %d: %v", e.Op, e.Engine, e.DPRank, e.Err)
	const shown = 8
	for i, h := range e.Hashes {
		if i == shown {
			fmt.Fprintf(&b, " … (%d hashes)", len(e.Hashes))
			break
		}
		fmt.Fprintf(&b, " %#x", h)
	}
	return b.String()
}

// Unwrap returns Err.
func (e *EventError) Unwrap() error { return e.Err }

// BlockSizeError details ErrBlockSizeMismatch: a Store carried Tokens token IDs for Blocks block
// hashes, where the index expects exactly Blocks × BlockTokens. It is the Err of the *EventError
// Store returns; find it with errors.As. A Tokens that is a whole multiple of another block size
// (say Blocks × 16 against an index of 32-token blocks) usually means the engine and the index
// are configured with different block sizes.
type BlockSizeError struct {
	// Tokens is len(StoreEvent.TokenIDs).
	Tokens int
	// Blocks is len(StoreEvent.BlockHashes).
	Blocks int
	// BlockTokens is the index's block size (Hasher.BlockTokens), in tokens.
	BlockTokens int
}

// Error states the counts, for example "block size mismatch: 11 tokens for 3 blocks, want 12
// (3 blocks × 4 tokens per block)".
func (e *BlockSizeError) Error() string {
	return fmt.Sprintf("%v: %d tokens for %d blocks, want %d (%d blocks × %d tokens per block)",
		ErrBlockSizeMismatch, e.Tokens, e.Blocks, e.Blocks*e.BlockTokens, e.Blocks, e.BlockTokens)
}

// Unwrap returns ErrBlockSizeMismatch.
func (e *BlockSizeError) Unwrap() error { return ErrBlockSizeMismatch }
