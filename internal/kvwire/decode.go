// Package kvwire decodes the KV-event messages vLLM and SGLang publish: the ZMQ framing
// [topic, sequence, msgpack payload] (ParseMessage) and the payload in every encoding the engines
// have published (Decoder: tagged arrays of any length and tagged maps; signed, unsigned and bytes
// block hashes). Package kvindex/kvevents uses it to follow publishers, and its package
// documentation ("Wire format") describes the messages.
package kvwire

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"strconv"

	"github.com/vmihailenco/msgpack/v5"
	"github.com/vmihailenco/msgpack/v5/msgpcode"
)

// Sentinel errors, returned wrapped in a *DecodeError; test with errors.Is.
var (
	// ErrFrames: a message does not have the three frames [topic, sequence, payload], or its
	// sequence frame is not 8 bytes (vllm-project/vllm vllm/distributed/kv_events.py,
	// ZmqEventPublisher._publisher_thread). A replay reply that is neither a batch nor the end
	// marker is also ErrFrames.
	ErrFrames = errors.New("kvevents: malformed message frames")
	// ErrPayload: the msgpack payload is not a batch: garbage or truncated msgpack, a value of the
	// wrong type, a token ID outside [0, 2^32), a block hash that is neither an integer nor
	// non-empty bytes, or a BlockStored / BlockRemoved without its block_hashes (or token_ids).
	ErrPayload = errors.New("kvevents: malformed KV-event payload")
)

// DecodeError is a malformed message or payload. Err is ErrFrames or ErrPayload, possibly with
// the msgpack library's error joined for detail; Path names the element at fault, such as
// "events[2].token_ids[17]".
type DecodeError struct {
	// Path is the element being decoded when the error was found; empty for frame errors.
	Path string
	// Err wraps ErrFrames or ErrPayload.
	Err error
}

// Error implements error.
func (e *DecodeError) Error() string {
	if e.Path == "" {
		return e.Err.Error()
	}
	return fmt.Sprintf("%v at %s", e.Err, e.Path)
}

// Unwrap returns Err.
func (e *DecodeError) Unwrap() error { return e.Err }

// Message is one KV-event message as a publisher sends it: three ZMQ frames, [topic, sequence as
// 8 bytes big-endian, msgpack payload] (vllm-project/vllm vllm/distributed/kv_events.py,
// ZmqEventPublisher._publisher_thread; sgl-project/sglang
// python/sglang/srt/disaggregation/kv_events.py is the same). The slices alias the frames.
type Message struct {
	// Topic is the publisher's topic (vLLM's KVEventsConfig.topic, "" by default).
	Topic []byte
	// Seq is the batch sequence number: 0 for the publisher's first batch, one more per batch,
	// back to 0 when the publisher restarts.
	Seq uint64
	// Payload is the msgpack-encoded batch; decode it with a Decoder.
	Payload []byte
}

// ParseMessage splits a received message into its frames. A frame count other than 3 or a
// sequence frame that is not 8 bytes returns a *DecodeError wrapping ErrFrames.
func ParseMessage(frames [][]byte) (Message, error) {
	if len(frames) != 3 {
		return Message{}, &DecodeError{Err: fmt.Errorf("%w: %d frames, want 3 (topic, sequence, payload)", ErrFrames, len(frames))}
	}
	if len(frames[1]) != 8 {
		return Message{}, &DecodeError{Err: fmt.Errorf("%w: sequence frame of %d bytes, want 8", ErrFrames, len(frames[1]))}
	}
	return Message{Topic: frames[0], Seq: binary.BigEndian.Uint64(frames[1]), Payload: frames[2]}, nil
}

// EventKind is the type of a KV event.
type EventKind uint8

// The event kinds (vllm-project/vllm vllm/distributed/kv_events.py: BlockStored, BlockRemoved,
// AllBlocksCleared). KindUnknown is an event whose type tag this package does not know; it is
// decoded (so the rest of the batch is kept) and ignored.
const (
	KindUnknown EventKind = iota
	KindStored
	KindRemoved
	KindCleared
)

var kindNames = [...]string{"unknown", "BlockStored", "BlockRemoved", "AllBlocksCleared"}

// String returns the wire tag ("BlockStored", …) or "unknown".
func (k EventKind) String() string {
	if int(k) < len(kindNames) {
		return kindNames[k]
	}
	return "EventKind(" + strconv.Itoa(int(k)) + ")"
}

// Batch is one decoded payload: vLLM's KVEventBatch / SGLang's KVEventBatch,
// [ts, events, data_parallel_rank] as a msgpack array (vLLM before PR #42892, SGLang), the older
// two-element [ts, events], or a map with those keys (newer vLLM, whose EventBatch is not
// array_like). A Batch is reused by Decoder.Decode: its slices stay valid until the next Decode
// into the same Batch.
type Batch struct {
	// Timestamp is the publisher's clock when the batch was made, in seconds since the Unix epoch;
	// 0 when absent or nil. Informational only.
	Timestamp float64
	// DPRank is the batch's data-parallel rank (vLLM data_parallel_rank, SGLang attn_dp_rank),
	// valid when HasDPRank; absent or nil in older publishers.
	DPRank    int
	HasDPRank bool
	// Events are the batch's events in publication order.
	Events []Event
}

// Event is one decoded KV event. Fields a given kind does not carry are zero. Absent and nil
// fields are zero with their Has flag false; unknown fields (extra_keys,
// kv_cache_spec_sliding_window, locality, …) are skipped.
type Event struct {
	Kind EventKind
	// BlockHashes are the engine's block hashes (BlockStored, BlockRemoved), as opaque 64-bit
	// IDs: a signed integer (SGLang) is bit-cast, an unsigned one (vLLM's low 64 bits) kept, and
	// raw bytes (vLLM with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0) reduced to their last 8 bytes
	// read big-endian, which is the integer vLLM would have published.
	BlockHashes []uint64
	// ParentHash is the hash of the block before the first stored block, when HasParent
	// (BlockStored parent_block_hash; nil at the start of a prompt).
	ParentHash uint64
	HasParent  bool
	// TokenIDs are the stored blocks' tokens, all blocks concatenated (BlockStored token_ids).
	// SGLang's bigram cells ([t, t+1] pairs, EAGLE speculative decoding) are reduced to their
	// first token, which is the unigram sequence.
	TokenIDs []uint32
	// BlockSize is the publisher's block size in tokens (BlockStored block_size); 0 when absent
	// or nil.
	BlockSize int
	// Medium is the storage medium ("GPU", "CPU", "CPU_PINNED", "DISK", …); "" when absent or nil.
	Medium string
	// LoRAName is the adapter's name (vLLM lora_name); "" when absent or nil.
	LoRAName string
	// LoRAID is the adapter's integer ID (vLLM's deprecated lora_id, SGLang's lora_id), valid
	// when HasLoRAID.
	LoRAID    int64
	HasLoRAID bool
	// GroupIdx is the KV-cache group (vLLM group_idx), valid when HasGroupIdx.
	GroupIdx    int
	HasGroupIdx bool
	// SpecKind is the group's kind (vLLM kv_cache_spec_kind: "full_attention", "sliding_window",
	// "mamba", …); "" when absent or nil.
	SpecKind string
}

// MainGroup reports whether the event belongs to the main attention group, the only one the index
// follows: no group index or group 0, and no spec kind or a full-attention kind (full_attention,
// mla_attention, sink_full_attention), as ai-dynamo/dynamo lib/kv-router/src/zmq_wire.rs filters.
// Sliding-window, Mamba and other hybrid groups publish hashes for only part of their tokens.
func (e *Event) MainGroup() bool {
	switch e.SpecKind {
	case "", "full_attention", "mla_attention", "sink_full_attention":
	default:
		return false
	}
	return !e.HasGroupIdx || e.GroupIdx == 0
}

func (e *Event) reset() {
	*e = Event{BlockHashes: e.BlockHashes[:0], TokenIDs: e.TokenIDs[:0]}
}

// Decoder decodes KV-event payloads into Batches with github.com/vmihailenco/msgpack/v5. It
// reuses its buffers and those of the Batch it decodes into, so a steady stream decodes without
// allocating. Not safe for concurrent use; the zero Decoder is not usable, call NewDecoder.
type Decoder struct {
	raw    []byte // the payload being decoded
	r      bytes.Reader
	d      *msgpack.Decoder
	str    []byte            // scratch for strings
	intern map[string]string // interned short strings (media, kinds, adapter names)
	path   pathInfo
	NoFast bool // tests: decode every token through the library (fastTokens' oracle)
}

// maxInterned bounds the interned strings, so garbage input cannot grow the table.
const maxInterned = 256

// NewDecoder returns a Decoder.
func NewDecoder() *Decoder {
	d := &Decoder{intern: make(map[string]string)}
	d.d = msgpack.NewDecoder(&d.r)
	return d
}

// pathInfo locates an error without building strings on the success path.
type pathInfo struct {
	event int // -1 outside events
	field string
	elem  int // -1 when not inside a list
}

func (p pathInfo) String() string {
	s := p.field
	if p.event >= 0 {
		s = fmt.Sprintf("events[%d].%s", p.event, p.field)
	}
	if p.elem >= 0 {
		s += fmt.Sprintf("[%d]", p.elem)
	}
	return s
}

func (d *Decoder) fail(format string, args ...any) error {
	return &DecodeError{Path: d.path.String(), Err: fmt.Errorf("%w: "+format, append([]any{ErrPayload}, args...)...)}
}

func (d *Decoder) wrap(err error) error {
	var de *DecodeError
	if errors.As(err, &de) {
		return err
	}
	return &DecodeError{Path: d.path.String(), Err: errors.Join(ErrPayload, err)}
}

// Decode decodes payload into b, replacing its contents. On error b holds a partial batch that
// must not be applied; the error is a *DecodeError wrapping ErrPayload. Trailing bytes after the
// batch are an error.
func (d *Decoder) Decode(payload []byte, b *Batch) error {
	d.raw = payload
	d.r.Reset(payload)
	d.d.Reset(&d.r)
	b.Timestamp, b.DPRank, b.HasDPRank = 0, 0, false
	b.Events = b.Events[:0]
	d.path = pathInfo{event: -1, field: "batch", elem: -1}
	c, err := d.d.PeekCode()
	if err != nil {
		d.dropScratch()
		return d.wrap(err)
	}
	switch {
	case isArray(c):
		err = d.batchArray(b)
	case isMap(c):
		err = d.batchMap(b)
	default:
		err = d.fail("batch is msgpack code %#x, want an array or a map", c)
	}
	if err != nil {
		d.dropScratch()
		return err
	}
	if d.r.Len() != 0 {
		d.path = pathInfo{event: -1, field: "batch", elem: -1}
		return d.fail("%d trailing bytes", d.r.Len())
	}
	return nil
}

// dropScratch replaces the msgpack decoder after a failed Decode. A string, binary or extension
// header claiming more bytes than the payload holds makes the library grow its scratch buffer by
// its allocation step (1 MiB) before the read fails, and keep the grown buffer
// (vmihailenco/msgpack v5 decode.go, readNGrow): a Decoder reused for a stream's lifetime would
// grow by that much per such payload, without bound (TestDecoderKeepsNoMemoryFromHugeLengthClaims).
// A successful Decode only grows it to the longest value actually present, which the payload
// bounds.
func (d *Decoder) dropScratch() {
	d.d = msgpack.NewDecoder(&d.r)
}

func isArray(c byte) bool {
	return msgpcode.IsFixedArray(c) || c == msgpcode.Array16 || c == msgpcode.Array32
}

func isMap(c byte) bool {
	return msgpcode.IsFixedMap(c) || c == msgpcode.Map16 || c == msgpcode.Map32
}

func isInt(c byte) bool {
	if msgpcode.IsFixedNum(c) {
		return true
	}
	switch c {
	case msgpcode.Uint8, msgpcode.Uint16, msgpcode.Uint32, msgpcode.Uint64,
		msgpcode.Int8, msgpcode.Int16, msgpcode.Int32, msgpcode.Int64:
		return true
	}
	return false
}

func isBytes(c byte) bool {
	return msgpcode.IsString(c) || msgpcode.IsBin(c)
}

// listLen reads an array header; nil is -1. A length larger than the bytes left is an error, so
// garbage cannot make the decoder allocate.
func (d *Decoder) listLen() (int, error) {
	n, err := d.d.DecodeArrayLen()
	if err != nil {
		return 0, d.wrap(err)
	}
	if n > d.r.Len() {
		return 0, d.fail("array of %d elements in %d bytes", n, d.r.Len())
	}
	return n, nil
}

func (d *Decoder) mapLen() (int, error) {
	n, err := d.d.DecodeMapLen()
	if err != nil {
		return 0, d.wrap(err)
	}
	if n > d.r.Len()/2 {
		return 0, d.fail("map of %d entries in %d bytes", n, d.r.Len())
	}
	return n, nil
}

// bytesVal reads a str or bin into the scratch buffer; nil is (nil, false).
func (d *Decoder) bytesVal() ([]byte, bool, error) {
	n, err := d.d.DecodeBytesLen()
	if err != nil {
		return nil, false, d.wrap(err)
	}
	if n < 0 {
		return nil, false, nil
	}
	if n > d.r.Len() {
		return nil, false, d.fail("string of %d bytes in %d bytes", n, d.r.Len())
	}
	if cap(d.str) < n {
		d.str = make([]byte, n)
	}
	d.str = d.str[:n]
	if err := d.d.ReadFull(d.str); err != nil {
		return nil, false, d.wrap(err)
	}
	return d.str, true, nil
}

// stringVal reads an optional string, interning it.
func (d *Decoder) stringVal() (string, error) {
	c, err := d.d.PeekCode()
	if err != nil {
		return "", d.wrap(err)
	}
	if c == msgpcode.Nil {
		_ = d.d.Skip()
		return "", nil
	}
	if !msgpcode.IsString(c) {
		return "", d.fail("msgpack code %#x, want a string", c)
	}
	b, _, err := d.bytesVal()
	if err != nil {
		return "", err
	}
	if s, ok := d.intern[string(b)]; ok {
		return s, nil
	}
	s := string(b)
	if len(d.intern) < maxInterned && len(s) <= 64 {
		d.intern[s] = s
	}
	return s, nil
}

// optInt reads an optional integer; nil is (0, false).
func (d *Decoder) optInt() (int64, bool, error) {
	c, err := d.d.PeekCode()
	if err != nil {
		return 0, false, d.wrap(err)
	}
	if c == msgpcode.Nil {
		_ = d.d.Skip()
		return 0, false, nil
	}
	if !isInt(c) {
		return 0, false, d.fail("msgpack code %#x, want an integer", c)
	}
	if c == msgpcode.Uint64 {
		v, err := d.d.DecodeUint64()
		if err != nil {
			return 0, false, d.wrap(err)
		}
		if v > math.MaxInt64 {
			return 0, false, d.fail("integer %d out of range", v)
		}
		return int64(v), true, nil
	}
	v, err := d.d.DecodeInt64()
	if err != nil {
		return 0, false, d.wrap(err)
	}
	return v, true, nil
}

// smallInt reads an optional integer in [0, MaxInt32].
func (d *Decoder) smallInt() (int, bool, error) {
	v, ok, err := d.optInt()
	if err != nil || !ok {
		return 0, ok, err
	}
	if v < 0 || v > math.MaxInt32 {
		return 0, false, d.fail("%d out of [0, %d]", v, math.MaxInt32)
	}
	return int(v), true, nil
}

// hash reads one block hash: an integer of any width and sign (bit-cast to uint64), or non-empty
// bytes (their last 8 bytes, big-endian).
func (d *Decoder) hash() (uint64, error) {
	c, err := d.d.PeekCode()
	if err != nil {
		return 0, d.wrap(err)
	}
	switch {
	case isInt(c):
		v, err := d.d.DecodeUint64() // sign-extends negative integers: a bit cast
		if err != nil {
			return 0, d.wrap(err)
		}
		return v, nil
	case isBytes(c):
		b, _, err := d.bytesVal()
		if err != nil {
			return 0, err
		}
		if len(b) == 0 {
			return 0, d.fail("empty block hash")
		}
		var v uint64
		for _, x := range b[max(0, len(b)-8):] {
			v = v<<8 | uint64(x)
		}
		return v, nil
	}
	return 0, d.fail("block hash is msgpack code %#x, want an integer or bytes", c)
}

func (d *Decoder) hashes(dst []uint64) ([]uint64, bool, error) {
	n, err := d.listLen()
	if err != nil || n < 0 {
		return dst, false, err
	}
	dst = dst[:0]
	for i := range n {
		d.path.elem = i
		h, err := d.hash()
		if err != nil {
			return dst, false, err
		}
		dst = append(dst, h)
	}
	d.path.elem = -1
	return dst, true, nil
}

func (d *Decoder) token() (uint32, error) {
	c, err := d.d.PeekCode()
	if err != nil {
		return 0, d.wrap(err)
	}
	if isArray(c) { // SGLang bigram cell [t, t+1]: keep t
		n, err := d.listLen()
		if err != nil {
			return 0, err
		}
		if n < 1 {
			return 0, d.fail("empty token pair")
		}
		t, err := d.token()
		if err != nil {
			return 0, err
		}
		for range n - 1 {
			if err := d.d.Skip(); err != nil {
				return 0, d.wrap(err)
			}
		}
		return t, nil
	}
	if !isInt(c) {
		return 0, d.fail("token ID is msgpack code %#x, want an integer", c)
	}
	if c == msgpcode.Uint64 {
		v, err := d.d.DecodeUint64()
		if err != nil {
			return 0, d.wrap(err)
		}
		if v > math.MaxUint32 {
			return 0, d.fail("token ID %d out of [0, 2^32)", v)
		}
		return uint32(v), nil
	}
	v, err := d.d.DecodeInt64()
	if err != nil {
		return 0, d.wrap(err)
	}
	if v < 0 || v > math.MaxUint32 {
		return 0, d.fail("token ID %d out of [0, 2^32)", v)
	}
	return uint32(v), nil
}

func (d *Decoder) tokens(dst []uint32) ([]uint32, bool, error) {
	n, err := d.listLen()
	if err != nil || n < 0 {
		return dst, false, err
	}
	dst = dst[:0]
	done := 0
	if !d.NoFast {
		dst, done = d.fastTokens(dst, n)
	}
	for i := done; i < n; i++ {
		d.path.elem = i
		t, err := d.token()
		if err != nil {
			return dst, false, err
		}
		dst = append(dst, t)
	}
	d.path.elem = -1
	return dst, true, nil
}

// fastTokens reads the leading token IDs of an n-element array straight from the payload bytes:
// msgpack's integer encodings (positive fixint, uint8/16/32/64 and int8/16/32/64 holding a value
// in [0, 2^32)) are decoded inline, several times faster than one library call per token
// (BenchmarkDecode64). It stops at the first element of any other shape (a bigram pair, a
// negative or too large value, garbage, the end of the payload) and returns how many it read,
// leaving the reader there, so the library's path decodes the rest and reports any error as it
// would have for the whole array.
func (d *Decoder) fastTokens(dst []uint32, n int) ([]uint32, int) {
	start := len(d.raw) - d.r.Len()
	b := d.raw[start:]
	off, i := 0, 0
loop:
	for ; i < n; i++ {
		if off >= len(b) {
			break
		}
		c := b[off]
		var v uint64
		switch {
		case c <= 0x7f: // positive fixint
			v = uint64(c)
			off++
			dst = append(dst, uint32(v))
			continue
		case c == msgpcode.Uint8 || c == msgpcode.Int8:
			if off+2 > len(b) {
				break loop
			}
			v = uint64(b[off+1])
			if c == msgpcode.Int8 && v >= 0x80 {
				break loop
			}
			off += 2
		case c == msgpcode.Uint16 || c == msgpcode.Int16:
			if off+3 > len(b) {
				break loop
			}
			v = uint64(binary.BigEndian.Uint16(b[off+1:]))
			if c == msgpcode.Int16 && v >= 0x8000 {
				break loop
			}
			off += 3
		case c == msgpcode.Uint32 || c == msgpcode.Int32:
			if off+5 > len(b) {
				break loop
			}
			v = uint64(binary.BigEndian.Uint32(b[off+1:]))
			if c == msgpcode.Int32 && v >= 0x8000_0000 {
				break loop
			}
			off += 5
		case c == msgpcode.Uint64 || c == msgpcode.Int64:
			if off+9 > len(b) {
				break loop
			}
			v = binary.BigEndian.Uint64(b[off+1:])
			if v > math.MaxUint32 {
				break loop
			}
			off += 9
		default:
			break loop
		}
		dst = append(dst, uint32(v))
	}
	if off > 0 {
		_, _ = d.r.Seek(int64(off), io.SeekCurrent) // bytes.Reader is msgpack's reader: no buffering
	}
	return dst, i
}

func (d *Decoder) timestamp() (float64, error) {
	c, err := d.d.PeekCode()
	if err != nil {
		return 0, d.wrap(err)
	}
	if c == msgpcode.Nil {
		_ = d.d.Skip()
		return 0, nil
	}
	if c != msgpcode.Float && c != msgpcode.Double && !isInt(c) {
		return 0, d.fail("timestamp is msgpack code %#x, want a number", c)
	}
	v, err := d.d.DecodeFloat64()
	if err != nil {
		return 0, d.wrap(err)
	}
	return v, nil
}

func (d *Decoder) rank(b *Batch) error {
	v, ok, err := d.smallInt()
	b.DPRank, b.HasDPRank = v, ok
	return err
}

func (d *Decoder) batchArray(b *Batch) error {
	n, err := d.listLen()
	if err != nil {
		return err
	}
	if n < 2 {
		return d.fail("batch array of %d elements, want [ts, events] or [ts, events, dp_rank]", n)
	}
	d.path.field = "ts"
	if b.Timestamp, err = d.timestamp(); err != nil {
		return err
	}
	if err := d.events(b); err != nil {
		return err
	}
	if n >= 3 {
		d.path = pathInfo{event: -1, field: "data_parallel_rank", elem: -1}
		if err := d.rank(b); err != nil {
			return err
		}
	}
	for range n - 3 {
		if err := d.d.Skip(); err != nil {
			return d.wrap(err)
		}
	}
	return nil
}

func (d *Decoder) batchMap(b *Batch) error {
	n, err := d.mapLen()
	if err != nil {
		return err
	}
	seenEvents := false
	for range n {
		d.path = pathInfo{event: -1, field: "batch key", elem: -1}
		key, ok, err := d.bytesVal()
		if err != nil {
			return err
		}
		if !ok {
			return d.fail("nil map key")
		}
		switch string(key) {
		case "ts":
			d.path.field = "ts"
			if b.Timestamp, err = d.timestamp(); err != nil {
				return err
			}
		case "events":
			if err := d.events(b); err != nil {
				return err
			}
			seenEvents = true
		case "data_parallel_rank", "attn_dp_rank", "dp_rank":
			d.path.field = "data_parallel_rank"
			if err := d.rank(b); err != nil {
				return err
			}
		default:
			if err := d.d.Skip(); err != nil {
				return d.wrap(err)
			}
		}
	}
	if !seenEvents {
		d.path = pathInfo{event: -1, field: "batch", elem: -1}
		return d.fail("batch map without events")
	}
	return nil
}

func (d *Decoder) events(b *Batch) error {
	d.path = pathInfo{event: -1, field: "events", elem: -1}
	n, err := d.listLen()
	if err != nil {
		return err
	}
	if n < 0 {
		return d.fail("events is nil")
	}
	b.Events = b.Events[:0]
	for i := range n {
		if len(b.Events) < cap(b.Events) {
			b.Events = b.Events[:i+1]
		} else {
			b.Events = append(b.Events, Event{})
		}
		ev := &b.Events[i]
		ev.reset()
		d.path = pathInfo{event: i, field: "event", elem: -1}
		c, err := d.d.PeekCode()
		if err != nil {
			return d.wrap(err)
		}
		switch {
		case isArray(c):
			err = d.eventArray(ev)
		case isMap(c):
			err = d.eventMap(ev)
		default:
			err = d.fail("event is msgpack code %#x, want an array or a map", c)
		}
		if err != nil {
			return err
		}
	}
	return nil
}

func kindOf(tag []byte) EventKind {
	switch string(tag) {
	case "BlockStored":
		return KindStored
	case "BlockRemoved":
		return KindRemoved
	case "AllBlocksCleared":
		return KindCleared
	}
	return KindUnknown
}

// eventArray decodes a tagged positional array: the tag, then the fields in declaration order
// (vllm-project/vllm vllm/distributed/kv_events.py before PR #42892; SGLang). Missing trailing
// fields are absent; extra ones are skipped.
func (d *Decoder) eventArray(ev *Event) error {
	n, err := d.listLen()
	if err != nil {
		return err
	}
	if n < 1 {
		return d.fail("empty event array")
	}
	d.path.field = "type"
	tag, ok, err := d.bytesVal()
	if err != nil {
		return err
	}
	if !ok {
		return d.fail("nil event type")
	}
	ev.Kind = kindOf(tag)
	var hasHashes, hasTokens bool
	for i := 1; i < n; i++ {
		var err error
		switch {
		case ev.Kind == KindStored:
			switch i {
			case 1:
				d.path.field = "block_hashes"
				ev.BlockHashes, hasHashes, err = d.hashes(ev.BlockHashes)
			case 2:
				d.path.field = "parent_block_hash"
				err = d.parent(ev)
			case 3:
				d.path.field = "token_ids"
				ev.TokenIDs, hasTokens, err = d.tokens(ev.TokenIDs)
			case 4:
				d.path.field = "block_size"
				ev.BlockSize, _, err = d.smallInt()
			case 5:
				d.path.field = "lora_id"
				ev.LoRAID, ev.HasLoRAID, err = d.optInt()
			case 6:
				d.path.field = "medium"
				ev.Medium, err = d.stringVal()
			case 7:
				d.path.field = "lora_name"
				ev.LoRAName, err = d.stringVal()
			case 9:
				d.path.field = "group_idx"
				ev.GroupIdx, ev.HasGroupIdx, err = d.smallInt()
			case 10:
				d.path.field = "kv_cache_spec_kind"
				ev.SpecKind, err = d.stringVal()
			default: // 8 extra_keys, 11 kv_cache_spec_sliding_window, later additions
				err = d.skip()
			}
		case ev.Kind == KindRemoved:
			switch i {
			case 1:
				d.path.field = "block_hashes"
				ev.BlockHashes, hasHashes, err = d.hashes(ev.BlockHashes)
			case 2:
				d.path.field = "medium"
				ev.Medium, err = d.stringVal()
			case 3:
				d.path.field = "group_idx"
				ev.GroupIdx, ev.HasGroupIdx, err = d.smallInt()
			default:
				err = d.skip()
			}
		default:
			err = d.skip()
		}
		if err != nil {
			return err
		}
	}
	return d.required(ev, hasHashes, hasTokens)
}

// eventMap decodes a map with a "type" key and named fields (vLLM after PR #42892, msgspec
// omit_defaults: fields equal to their default are left out). Unknown keys are skipped.
func (d *Decoder) eventMap(ev *Event) error {
	n, err := d.mapLen()
	if err != nil {
		return err
	}
	var hasType, hasHashes, hasTokens bool
	for range n {
		d.path.field = "event key"
		key, ok, err := d.bytesVal()
		if err != nil {
			return err
		}
		if !ok {
			return d.fail("nil map key")
		}
		d.path.field = knownKey(key)
		switch d.path.field {
		case "type":
			tag, ok, e := d.bytesVal()
			if e == nil && !ok {
				e = d.fail("nil event type")
			}
			if e == nil {
				ev.Kind, hasType = kindOf(tag), true
			}
			err = e
		case "block_hashes":
			ev.BlockHashes, hasHashes, err = d.hashes(ev.BlockHashes)
		case "parent_block_hash":
			err = d.parent(ev)
		case "token_ids":
			ev.TokenIDs, hasTokens, err = d.tokens(ev.TokenIDs)
		case "block_size":
			ev.BlockSize, _, err = d.smallInt()
		case "lora_id":
			ev.LoRAID, ev.HasLoRAID, err = d.optInt()
		case "medium":
			ev.Medium, err = d.stringVal()
		case "lora_name":
			ev.LoRAName, err = d.stringVal()
		case "group_idx":
			ev.GroupIdx, ev.HasGroupIdx, err = d.smallInt()
		case "kv_cache_spec_kind":
			ev.SpecKind, err = d.stringVal()
		default:
			err = d.skip()
		}
		if err != nil {
			return err
		}
	}
	if !hasType {
		d.path.field = "type"
		return d.fail("event map without a type")
	}
	return d.required(ev, hasHashes, hasTokens)
}

// eventKeys are the event map keys the decoder reads; knownKey returns the constant for key, so
// that the error path names the field without allocating on the success path.
var eventKeys = [...]string{"type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
	"lora_id", "medium", "lora_name", "group_idx", "kv_cache_spec_kind"}

func knownKey(key []byte) string {
	for _, k := range eventKeys {
		if string(key) == k {
			return k
		}
	}
	return "unknown field"
}

func (d *Decoder) parent(ev *Event) error {
	c, err := d.d.PeekCode()
	if err != nil {
		return d.wrap(err)
	}
	if c == msgpcode.Nil {
		_ = d.d.Skip()
		ev.ParentHash, ev.HasParent = 0, false
		return nil
	}
	ev.ParentHash, err = d.hash()
	ev.HasParent = err == nil
	return err
}

func (d *Decoder) skip() error {
	if err := d.d.Skip(); err != nil {
		return d.wrap(err)
	}
	return nil
}

// required checks the fields every version of each event carries.
func (d *Decoder) required(ev *Event, hasHashes, hasTokens bool) error {
	switch ev.Kind {
	case KindStored:
		if !hasHashes {
			d.path.field = "block_hashes"
			return d.fail("BlockStored without block_hashes")
		}
		if !hasTokens {
			d.path.field = "token_ids"
			return d.fail("BlockStored without token_ids")
		}
	case KindRemoved:
		if !hasHashes {
			d.path.field = "block_hashes"
			return d.fail("BlockRemoved without block_hashes")
		}
	}
	return nil
}
