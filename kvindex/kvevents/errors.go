package kvevents

import (
	"errors"
	"fmt"

	"github.com/enginepick/enginepick/internal/kvwire"
	"github.com/enginepick/enginepick/kvindex"
	"github.com/enginepick/enginepick/state"
)

// Sentinel errors. Decoding errors are returned wrapped in a *DecodeError, event refusals in a
// *StreamError (through Options.OnError); test with errors.Is.
var (
	// ErrFrames: a message does not have the three frames [topic, sequence, payload], or its
	// sequence frame is not 8 bytes (vllm-project/vllm vllm/distributed/kv_events.py,
	// ZmqEventPublisher._publisher_thread). A replay reply that is neither a batch nor the end
	// marker is also ErrFrames.
	ErrFrames = kvwire.ErrFrames
	// ErrPayload: the msgpack payload is not a batch: garbage or truncated msgpack, a value of the
	// wrong type, a token ID outside [0, 2^32), a block hash that is neither an integer nor
	// non-empty bytes, or a BlockStored / BlockRemoved without its block_hashes (or token_ids).
	ErrPayload = kvwire.ErrPayload
	// ErrUnknownMedium: a BlockStored named a medium that Options.Media does not map to a tier.
	// The event is dropped (SGLang's experimental router drops such stores too).
	ErrUnknownMedium = errors.New("kvevents: unknown medium")
	// ErrUnknownAdapter: a BlockStored named a LoRA adapter by a lora_id without a lora_name,
	// and Options.AdapterNames does not name that ID. The event is dropped: its blocks could not
	// be matched by any request.
	ErrUnknownAdapter = errors.New("kvevents: unknown LoRA adapter")
	// ErrRankMismatch: a batch carries a DP rank other than the one its Endpoint was configured
	// with (RankStart + DPRank). The batch is dropped; the endpoint is misconfigured.
	ErrRankMismatch = errors.New("kvevents: batch DP rank differs from the endpoint's")
)

// DecodeError is a malformed message or payload: its Err wraps ErrFrames or ErrPayload (with the
// msgpack library's error joined for detail), and its Path names the element at fault, such as
// "events[2].token_ids[17]" (empty for frame errors).
type DecodeError = kvwire.DecodeError

// BlockSizeMismatchError: a BlockStored's block_size differs from the index's block size
// (kvindex.Hasher.BlockTokens), so its blocks could never match a request: the engine and the
// index are configured differently (docs/design.md §13.1). It unwraps to
// kvindex.ErrBlockSizeMismatch, the sentinel the index uses for a token count that is not
// blocks × block size.
type BlockSizeMismatchError struct {
	// EventBlockSize is the event's block_size field, in tokens.
	EventBlockSize int
	// IndexBlockSize is the index's block size, in tokens.
	IndexBlockSize int
}

// Error states both sizes.
func (e *BlockSizeMismatchError) Error() string {
	return fmt.Sprintf("kvevents: event block_size %d tokens, index block size %d tokens: %v",
		e.EventBlockSize, e.IndexBlockSize, kvindex.ErrBlockSizeMismatch)
}

// Unwrap returns kvindex.ErrBlockSizeMismatch.
func (e *BlockSizeMismatchError) Unwrap() error { return kvindex.ErrBlockSizeMismatch }

// StreamError reports a batch or event of one (engine, DP rank) stream that was refused, passed
// to Options.OnError. The stream goes on: a refused event is counted and dropped; a refused batch
// is counted, and the loss is recovered by the stream's sequence rules (docs/design.md §13).
type StreamError struct {
	// Engine and DPRank name the stream.
	Engine state.EngineID
	DPRank int
	// Seq is the batch's sequence number (0 for errors outside a batch, such as a failed replay).
	Seq uint64
	// Err is a *DecodeError, a *BlockSizeMismatchError, ErrUnknownMedium, ErrUnknownAdapter,
	// ErrRankMismatch, an index *kvindex.EventError, or a replay failure.
	Err error
}

// Error implements error.
func (e *StreamError) Error() string {
	return fmt.Sprintf("kvevents: engine %q rank %d seq %d: %v", e.Engine, e.DPRank, e.Seq, e.Err)
}

// Unwrap returns Err.
func (e *StreamError) Unwrap() error { return e.Err }

// refusal is why an event was refused: one per error the applier meets, for StreamStats.Refused
// and the warnings' "reason" (refusalNames has the labels).
type refusal int

// The refusals, by the error the event got.
const (
	// refusedUnknownParent: kvindex.ErrUnknownParent (a store chained to a block the rank does
	// not hold: lost events, or a block the index evicted under its cap).
	refusedUnknownParent refusal = iota
	// refusedBlockSize: a *BlockSizeMismatchError or kvindex.ErrBlockSizeMismatch (the engine's
	// block size differs from the index's, or tokens are missing).
	refusedBlockSize
	refusedUnknownMedium  // ErrUnknownMedium
	refusedUnknownAdapter // ErrUnknownAdapter
	refusedDuplicateHash  // kvindex.ErrDuplicateHash
	refusedKeyConflict    // kvindex.ErrKeyConflict (a 64-bit key collision)
	// refusedOther: any other index error (kvindex.ErrCyclicChain, kvindex.ErrTooManyHolders, …).
	refusedOther
	numRefusals
)

// refusalNames are the labels of StreamStats.Refused, by refusal.
var refusalNames = [numRefusals]string{"unknown_parent", "block_size", "unknown_medium", "unknown_adapter",
	"duplicate_hash", "key_conflict", "other"}

func (r refusal) String() string { return refusalNames[r] }

// refusalOf classifies an event's error; refusedOther for anything unlisted.
func refusalOf(err error) refusal {
	switch {
	case errors.Is(err, kvindex.ErrUnknownParent):
		return refusedUnknownParent
	case errors.Is(err, kvindex.ErrBlockSizeMismatch):
		return refusedBlockSize
	case errors.Is(err, ErrUnknownMedium):
		return refusedUnknownMedium
	case errors.Is(err, ErrUnknownAdapter):
		return refusedUnknownAdapter
	case errors.Is(err, kvindex.ErrDuplicateHash):
		return refusedDuplicateHash
	case errors.Is(err, kvindex.ErrKeyConflict):
		return refusedKeyConflict
	}
	return refusedOther
}
