package sim

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"encoding/csv"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"
)

// MooncakeBlockTokens is the size, in tokens, of the prompt block one Mooncake hash_id names.
// Every block of a request is full except the last, which holds the remainder of input_length
// (docs/traces.md; kvcache-ai/Mooncake `FAST25-release/README.md`).
const MooncakeBlockTokens = 512

// MaxTraceTokens is the largest input or output length, in tokens, that the readers accept. Larger
// values are rejected with ErrOutOfRange so that a corrupt trace cannot overflow block arithmetic
// or make [Request.AppendTokenIDs] allocate gigabytes. The public traces peak at 126,195 input
// tokens (docs/traces.md).
const MaxTraceTokens = 10_000_000

// MaxArrival is the largest arrival offset the readers accept: one year after the trace's first
// instant. Later arrivals are rejected with ErrOutOfRange. The public traces span about one hour.
const MaxArrival = 365 * 24 * time.Hour

// MaxMooncakeLineBytes bounds the length of one Mooncake JSONL line, in bytes. A longer line is
// rejected with ErrOutOfRange before it is decoded. A request at MaxTraceTokens needs 19,532
// hash_ids, about 430 KiB even with 20-digit IDs.
const MaxMooncakeLineBytes = 1 << 20

// VocabSize bounds the synthetic token IDs: every ID that [Request.AppendTokenIDs] produces is in
// [0, VocabSize). 2^17 = 131,072 is the order of a modern LLM vocabulary (Llama 3: 128,256).
const VocabSize = 1 << 17

// Format names the file format a [Trace] was read from.
type Format string

// The trace formats the readers understand (docs/traces.md).
const (
	// FormatMooncake is Mooncake JSONL: one {"timestamp", "input_length", "output_length",
	// "hash_ids"} object a line; read by [ReadMooncake].
	FormatMooncake Format = "mooncake"
	// FormatAzure is the Azure LLM inference 2023 CSV: header
	// TIMESTAMP,ContextTokens,GeneratedTokens; read by [ReadAzure].
	FormatAzure Format = "azure"
)

// Sentinel errors for trace input that the readers reject. Each is returned wrapped in a
// [*TraceError] that names the 1-based line and, where one field is at fault, the field; test
// them with errors.Is. On any of them the reader returns a nil *Trace: there is no partial result.
var (
	// ErrEmptyTrace reports input without a single request (an empty file, or a CSV header alone).
	ErrEmptyTrace = errors.New("trace has no requests")
	// ErrUnsorted reports an arrival earlier than the previous request's. Equal arrivals are
	// allowed and keep file order (docs/traces.md).
	ErrUnsorted = errors.New("timestamp decreases")
	// ErrNegative reports a negative timestamp, length or hash ID.
	ErrNegative = errors.New("negative value")
	// ErrOutOfRange reports a value above a documented bound: MaxTraceTokens, MaxArrival,
	// MaxMooncakeLineBytes, or an integer that does not fit in 64 bits.
	ErrOutOfRange = errors.New("value out of range")
	// ErrHashIDMismatch reports a Mooncake record whose hash_ids do not number
	// ceil(input_length / MooncakeBlockTokens); input_length 0 requires an empty list.
	ErrHashIDMismatch = errors.New("hash_ids do not match input_length")
	// ErrMalformed reports a line that is not valid JSON or CSV, a JSON line that is not an
	// object, a value of the wrong type (a float, string or array where an integer belongs), a
	// CSV row without exactly three fields, or an unparsable timestamp.
	ErrMalformed = errors.New("malformed record")
	// ErrMissingField reports a required Mooncake field that is absent or null. Unknown fields
	// are ignored.
	ErrMissingField = errors.New("missing field")
	// ErrHeaderMismatch reports an Azure CSV whose first record is not exactly
	// TIMESTAMP,ContextTokens,GeneratedTokens.
	ErrHeaderMismatch = errors.New("unexpected CSV header")
	// ErrSegmentMismatch reports a hand-built request whose Segments do not spell exactly
	// InputTokens tokens (a negative Tokens, or a sum that differs), or that has both Segments and
	// HashIDs.
	ErrSegmentMismatch = errors.New("segments do not match input length")
	// ErrUnknownFormat reports a file that [ReadTraceFile] can attribute to no format, neither by
	// extension nor by content. It is not wrapped in a *TraceError.
	ErrUnknownFormat = errors.New("unknown trace format")
)

// TraceError is the error every reader returns for rejected input. It carries the 1-based line
// of the record at fault (for an empty trace: the line where the first request was expected; for
// an error of the underlying io.Reader: the line being read) and wraps one of the package's
// sentinel errors, or the io.Reader's own error, so errors.Is and errors.As see through it.
type TraceError struct {
	// Line is the 1-based line number in the input; always at least 1.
	Line int
	// Field is the JSON key (Mooncake) or CSV column (Azure) at fault, or "" when the whole
	// line or file is.
	Field string
	// Err is the cause; never nil.
	Err error
}

// Error returns "sim: trace line N: field: cause", without the field when Field is empty.
func (e *TraceError) Error() string {
	if e.Field == "" {
		return fmt.Sprintf("sim: trace line %d: %v", e.Line, e.Err)
	}
	return fmt.Sprintf("sim: trace line %d: %s: %v", e.Line, e.Field, e.Err)
}

// Unwrap returns Err.
func (e *TraceError) Unwrap() error { return e.Err }

// Request is one request of a trace. Values produced by the readers satisfy every invariant
// stated here; a hand-built Request need not, and the methods say what they do then.
type Request struct {
	// Index is the request's 0-based position in its trace. It seeds the token IDs of a request
	// without hash IDs (see AppendTokenIDs).
	Index int
	// Line is the 1-based line of the request in its source file; 0 for a hand-built request.
	Line int
	// Arrival is the time from the trace's start to this request: the Mooncake timestamp (ms)
	// as written, or the Azure TIMESTAMP minus the first row's. In [0, MaxArrival] and
	// non-decreasing along the trace.
	Arrival time.Duration
	// InputTokens is the prompt length in tokens, in [0, MaxTraceTokens].
	InputTokens int
	// OutputTokens is the number of generated tokens, in [0, MaxTraceTokens].
	OutputTokens int
	// HashIDs are the Mooncake prefix-block IDs, one per MooncakeBlockTokens-token block of the
	// prompt: ceil(InputTokens / MooncakeBlockTokens) of them, chained so that equal IDs at
	// equal positions mean an equal prompt prefix (docs/traces.md). Non-nil (possibly empty)
	// for a Mooncake request; nil for an Azure request, which has no prefix information. The
	// slice shares memory with other requests of its trace: do not append to it.
	HashIDs []uint64
	// Segments, when non-nil, spell the prompt instead of HashIDs: the concatenation, in order, of
	// each segment's run of Tokens token IDs, whose Tokens sum to InputTokens (see
	// AppendTokenIDs). The workload generators set it, which share prefixes at token granularity
	// (docs/traces.md "Generated workloads"); the readers leave it nil. A request has Segments or
	// HashIDs, never both. The slice may share memory with other requests: do not append to it.
	Segments []Segment
	// Session is the request's conversation key when its source names one (a generated chat);
	// "" otherwise. See SessionKey.
	Session string
	// Tenant names the tenant that sent the request when its source names one (the tenants
	// workload); "" otherwise. Trace.Tenants gives its weight. The report accounts each tenant
	// and priority band apart (PolicyResult.Tenants, PolicyResult.Bands); the router gets it as
	// bucket.Request.Flow (Config.FlowControl).
	Tenant string
	// Priority is the request's priority band: a higher value is more urgent; 0 is the default
	// band. Every request of a trace without bands has 0. The router gets it as
	// bucket.Request.Priority.
	Priority int
	// Adapter names the LoRA adapter the request asks for when its source names one (the lora
	// workload); "" means the base model. The router gets it as bucket.Request.Adapter; the
	// simulated engines serve it from one of their adapter slots (EngineModel.MaxLoRAs) and cache
	// its KV blocks apart from the base model's and every other adapter's, so that prompts of
	// different adapters never share a cached block, whatever their tokens.
	Adapter string
}

// Tenant is one tenant of a trace: the name its requests carry in Request.Tenant, and its weight.
type Tenant struct {
	// Name is the tenant's name, unique in its trace and not "".
	Name string
	// Weight is the tenant's share of its priority band's service relative to the band's other
	// tenants: two tenants of weights 1 and 2, both asking for more than they get, are owed
	// service in the ratio 1 : 2. Finite and > 0.
	Weight float64
}

// Segment is a run of synthetic prompt tokens: the first Tokens token IDs of the stream that
// Stream names. Runs of one stream agree on their common length, so two prompts whose segments
// agree share exactly those tokens; different streams give unrelated runs.
type Segment struct {
	// Stream names the token stream.
	Stream uint64
	// Tokens is the length of the run, in tokens.
	Tokens int
}

// Splitmix64 constants (Steele, Lea and Flood, "Fast splittable pseudorandom number generators",
// OOPSLA 2014), and salts that keep block streams and per-request streams apart.
const (
	splitmixGamma = 0x9e3779b97f4a7c15
	blockSalt     = 0x6d6f6f6e63616b65 // "mooncake"
	requestSalt   = 0x7265717565737421 // "request!"
	segmentSalt   = 0x7365676d656e7473 // "segments"
	vocabShift    = 64 - 17            // keeps the top 17 bits: IDs < VocabSize
)

func mix64(z uint64) uint64 {
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
	z = (z ^ (z >> 27)) * 0x94d049bb133111eb
	return z ^ (z >> 31)
}

// fillStream writes the first len(out) token IDs of the splitmix64 stream seeded by seed.
func fillStream(out []uint32, seed uint64) {
	state := mix64(seed)
	for i := range out {
		state += splitmixGamma
		out[i] = uint32(mix64(state) >> vocabShift)
	}
}

// AppendTokenIDs appends the request's InputTokens synthetic prompt token IDs to dst and returns
// the extended slice; it allocates only when dst lacks capacity for InputTokens more IDs. Every
// ID is in [0, VocabSize).
//
// Block i (tokens [512·i, min(512·(i+1), InputTokens))) is the start of a fixed run of 512 IDs
// that depends on HashIDs[i] alone: a splitmix64 stream seeded by the hash ID. Two Mooncake
// requests that share their first k hash IDs therefore share exactly their first 512·k token IDs
// (the last block cut to InputTokens), as docs/traces.md describes; different hash IDs give
// unrelated runs. A request with Segments takes its tokens from them instead: segment k's Tokens
// IDs are the start of a splitmix64 stream seeded by its Stream, so prompts share exactly the
// tokens their segments share, at any length. Tokens that no hash ID or segment covers — all of
// them for an Azure request — come from a stream seeded by Index, so requests with different Index
// values share no block. Surplus hash IDs and segments are ignored. InputTokens ≤ 0 appends
// nothing.
//
// The mapping is part of the package contract: it never changes between releases, so replay
// results stay comparable.
func (r *Request) AppendTokenIDs(dst []uint32) []uint32 {
	n := r.InputTokens
	if n <= 0 {
		return dst
	}
	start := len(dst)
	dst = slices.Grow(dst, n)[:start+n]
	out := dst[start:]
	pos := 0
	for _, h := range r.HashIDs {
		if pos >= n {
			break
		}
		end := min(pos+MooncakeBlockTokens, n)
		fillStream(out[pos:end], h^blockSalt)
		pos = end
	}
	for _, s := range r.Segments {
		if pos >= n {
			break
		}
		end := min(pos+max(s.Tokens, 0), n)
		fillStream(out[pos:end], s.Stream^segmentSalt)
		pos = end
	}
	if pos < n {
		fillStream(out[pos:], uint64(r.Index)^requestSalt)
	}
	return dst
}

// TokenIDs returns the request's synthetic prompt token IDs in a new slice of length InputTokens
// (nil when InputTokens ≤ 0). See AppendTokenIDs.
func (r *Request) TokenIDs() []uint32 { return r.AppendTokenIDs(nil) }

// Trace is a parsed request trace. The readers return a fresh Trace that the caller owns; a
// Trace is not safe for concurrent modification, but concurrent reads are safe.
type Trace struct {
	// Name identifies the trace, e.g. "mooncake_conversation": the file's base name without
	// extensions for ReadTraceFile, "" for ReadMooncake and ReadAzure.
	Name string
	// Format is the format the trace was read from; "" for a generated trace (Workload).
	Format Format
	// Start is the wall-clock time of Arrival 0: the first row's TIMESTAMP (UTC) for an Azure
	// trace; the zero time.Time for a Mooncake trace, whose timestamps are already offsets.
	Start time.Time
	// Requests are the requests in file order, which is arrival order. Never empty for a Trace a
	// reader returns.
	Requests []Request
	// Tenants lists the tenants the requests name (Request.Tenant), with their weights; nil when
	// they name none. A tenant its requests name that is not listed has weight 1. Names must be
	// unique and not "", weights finite and > 0 (Replay checks it).
	Tenants []Tenant
}

// CacheStats counts how much of a trace's prompts an infinite prefix cache would already hold.
// Blocks are Mooncake hash_id blocks; tokens are the prompt tokens those blocks cover (a last,
// partial block counts its actual size) plus the prompt tokens of requests with Segments, which
// hit token by token. All zero for a trace without hash IDs or segments (Azure).
type CacheStats struct {
	// Blocks is the number of prompt blocks: the sum of len(HashIDs).
	Blocks int64
	// HitBlocks is the number of those blocks that were cache hits.
	HitBlocks int64
	// Tokens is the number of prompt tokens the blocks and segments cover; equal to the sum of
	// InputTokens for a trace from ReadMooncake or a workload generator.
	Tokens int64
	// HitTokens is the number of prompt tokens in hit blocks, plus the hit tokens of requests
	// with Segments.
	HitTokens int64
}

// BlockHitRatio returns HitBlocks / Blocks, or 0 when Blocks is 0.
func (s CacheStats) BlockHitRatio() float64 {
	if s.Blocks == 0 {
		return 0
	}
	return float64(s.HitBlocks) / float64(s.Blocks)
}

// TokenHitRatio returns HitTokens / Tokens, or 0 when Tokens is 0.
func (s CacheStats) TokenHitRatio() float64 {
	if s.Tokens == 0 {
		return 0
	}
	return float64(s.HitTokens) / float64(s.Tokens)
}

// InfiniteCache replays the trace's hash IDs through a cache that never evicts and counts hits.
// Block i of a request hits when its hash ID appeared in an earlier request (earlier in trace
// order; blocks of the same request never hit each other) and blocks 0..i-1 of the request hit
// too: prefix semantics, the only reuse a prefix cache can exploit. Because Mooncake hash IDs
// are chained, an ID seen earlier always had the same prefix before it, so on the real traces
// this equals counting every earlier occurrence; on the conversation trace both give
// 105,710 of 288,500 blocks = 36.64 %, the figure in docs/traces.md.
//
// A request with Segments hits, token by token, its longest common prefix with any earlier
// request's segments (see segmentCache): exact, whatever the block size. Either way a request
// hits only earlier requests of the same Adapter.
func (t *Trace) InfiniteCache() CacheStats {
	var s CacheStats
	var sc segmentCache
	var adapters map[string]*segmentCache // one cache per adapter; sc holds the base model's
	for i := range t.Requests {
		r := &t.Requests[i]
		if r.Segments == nil {
			continue
		}
		c := &sc
		if r.Adapter != "" {
			if adapters == nil {
				adapters = map[string]*segmentCache{}
			}
			if c = adapters[r.Adapter]; c == nil {
				c = &segmentCache{}
				adapters[r.Adapter] = c
			}
		}
		s.Tokens += int64(max(r.InputTokens, 0))
		s.HitTokens += int64(c.add(r))
	}
	total := 0
	for i := range t.Requests {
		total += len(t.Requests[i].HashIDs)
	}
	seen := make(map[uint64]struct{}, total)
	var seenBy map[string]map[uint64]struct{} // per adapter; seen holds the base model's
	for i := range t.Requests {
		r := &t.Requests[i]
		seen := seen
		if r.Adapter != "" && r.HashIDs != nil {
			if seenBy == nil {
				seenBy = map[string]map[uint64]struct{}{}
			}
			if seen = seenBy[r.Adapter]; seen == nil {
				seen = map[uint64]struct{}{}
				seenBy[r.Adapter] = seen
			}
		}
		prefix := true
		for b, h := range r.HashIDs {
			size := int64(max(0, min(MooncakeBlockTokens, r.InputTokens-b*MooncakeBlockTokens)))
			s.Blocks++
			s.Tokens += size
			if !prefix {
				continue
			}
			if _, ok := seen[h]; ok {
				s.HitBlocks++
				s.HitTokens += size
			} else {
				prefix = false
			}
		}
		for _, h := range r.HashIDs {
			seen[h] = struct{}{}
		}
	}
	return s
}

// segmentCache is an infinite prefix cache over prompts spelled by segments: a trie whose edges
// are whole segments (stream and length, as cut to the prompt's InputTokens; empty segments
// skipped), with, per node and stream, the longest run of that stream any prompt had there.
type segmentCache struct {
	longest map[segmentRun]int     // (node, stream) → longest run seen after the node
	nodes   map[segmentEdge]uint32 // (node, stream, tokens) → child node; the root is 0
}

type segmentRun struct {
	node   uint32
	stream uint64
}

type segmentEdge struct {
	node   uint32
	stream uint64
	tokens int
}

// add returns how many leading tokens of r's prompt an earlier added prompt had, then adds r.
// Tokens past the segments (a hand-built request whose segments fall short) never hit.
func (c *segmentCache) add(r *Request) int {
	if c.longest == nil {
		c.longest, c.nodes = map[segmentRun]int{}, map[segmentEdge]uint32{}
	}
	hit, pos := 0, 0
	var node uint32
	for _, s := range r.Segments {
		n := min(max(s.Tokens, 0), r.InputTokens-pos)
		if n <= 0 {
			continue
		}
		pos += n
		run := segmentRun{node, s.Stream}
		m := c.longest[run]
		hit += min(m, n)
		c.longest[run] = max(m, n)
		edge := segmentEdge{node, s.Stream, n}
		child, ok := c.nodes[edge]
		if !ok {
			// No earlier prompt went on past this segment's end (none did when m < n): the new
			// node has no runs, so no later segment of r hits.
			child = uint32(len(c.nodes) + 1)
			c.nodes[edge] = child
		}
		node = child
	}
	return hit
}

// InfiniteCacheHitRatio returns the fraction of prompt blocks an infinite prefix cache would
// already hold (see InfiniteCache): 0.3664 for the Mooncake conversation trace
// (docs/traces.md: 36.64 %), 0 for a trace without hash IDs.
func (t *Trace) InfiniteCacheHitRatio() float64 { return t.InfiniteCache().BlockHitRatio() }

// InfiniteCacheTokenHitRatio returns the fraction of prompt tokens in blocks an infinite prefix
// cache would already hold (see InfiniteCache), with a last, partial block weighted by its
// actual size; this is the weighting of the replay report's hit rates. 0 for a trace without
// hash IDs.
func (t *Trace) InfiniteCacheTokenHitRatio() float64 { return t.InfiniteCache().TokenHitRatio() }

// Clone returns a deep copy of t that shares no memory with it; nil for a nil t. Nil HashIDs and
// Segments stay nil and empty ones stay empty.
func (t *Trace) Clone() *Trace {
	if t == nil {
		return nil
	}
	c := *t
	c.Requests = slices.Clone(t.Requests)
	c.Tenants = slices.Clone(t.Tenants)
	ids, segs := 0, 0
	for i := range t.Requests {
		ids += len(t.Requests[i].HashIDs)
		segs += len(t.Requests[i].Segments)
	}
	idArena := make([]uint64, 0, ids)
	segArena := make([]Segment, 0, segs)
	for i := range c.Requests {
		r := &c.Requests[i]
		if r.HashIDs != nil {
			start := len(idArena)
			idArena = append(idArena, r.HashIDs...)
			r.HashIDs = idArena[start:len(idArena):len(idArena)]
		}
		if r.Segments != nil {
			start := len(segArena)
			segArena = append(segArena, r.Segments...)
			r.Segments = segArena[start:len(segArena):len(segArena)]
		}
	}
	return &c
}

// ReadMooncake reads a Mooncake JSONL trace (docs/traces.md): one JSON object a line with the
// integer fields "timestamp" (ms from the trace start), "input_length" and "output_length"
// (tokens), and "hash_ids" (an array of unsigned integers, one per MooncakeBlockTokens-token
// prompt block). Arrival is the timestamp as written.
//
// Validation is strict. Every line must be a JSON object (blank lines are malformed; a trailing
// newline at the end of the file is fine) with all four fields present and non-null; values must
// be JSON integers (1.0, 1e3 and "1" are malformed); timestamp and lengths must not be negative
// and must not exceed MaxArrival and MaxTraceTokens; timestamps must not decrease;
// len(hash_ids) must equal ceil(input_length / 512). Unknown fields are ignored, and key matching
// is encoding/json's (case-insensitive; the last duplicate wins). Lines are limited to
// MaxMooncakeLineBytes.
//
// On success the Trace has Format FormatMooncake and at least one request. Otherwise the error
// is a *TraceError wrapping ErrEmptyTrace, ErrMalformed, ErrMissingField, ErrNegative,
// ErrOutOfRange, ErrHashIDMismatch or ErrUnsorted — or r's own error — and the Trace is nil.
func ReadMooncake(r io.Reader) (*Trace, error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64<<10), MaxMooncakeLineBytes)
	p := mooncakeParser{arenaChunk: 1 << 10}
	t := &Trace{Format: FormatMooncake}
	line := 0
	var prev time.Duration
	for sc.Scan() {
		line++
		req, err := p.parseLine(sc.Bytes())
		if err != nil {
			err.Line = line
			return nil, err
		}
		if req.Arrival < prev {
			return nil, &TraceError{Line: line, Field: "timestamp",
				Err: fmt.Errorf("%w: %d ms after %d ms", ErrUnsorted, req.Arrival.Milliseconds(), prev.Milliseconds())}
		}
		prev = req.Arrival
		req.Index = len(t.Requests)
		req.Line = line
		t.Requests = append(t.Requests, req)
	}
	if err := sc.Err(); err != nil {
		if errors.Is(err, bufio.ErrTooLong) {
			err = fmt.Errorf("%w: line longer than %d bytes: %w", ErrOutOfRange, MaxMooncakeLineBytes, err)
		}
		return nil, &TraceError{Line: line + 1, Err: err}
	}
	if len(t.Requests) == 0 {
		return nil, &TraceError{Line: line + 1, Err: ErrEmptyTrace}
	}
	return t, nil
}

// mooncakeRecord receives one line. The raw values are reused across lines (json.RawMessage
// appends into its existing capacity); an empty value after decoding means the key was absent.
type mooncakeRecord struct {
	Timestamp    json.RawMessage `json:"timestamp"`
	InputLength  json.RawMessage `json:"input_length"`
	OutputLength json.RawMessage `json:"output_length"`
	HashIDs      json.RawMessage `json:"hash_ids"`
}

// mooncakeParser holds the state reused across lines: the record and the arena that backs the
// requests' HashIDs (chunks that grow up to 64 Ki IDs, so small traces stay small).
type mooncakeParser struct {
	rec        mooncakeRecord
	arena      []uint64
	arenaChunk int
}

// parseLine decodes and validates one line, everything but its order relative to other lines.
// The returned error has Line unset.
func (p *mooncakeParser) parseLine(line []byte) (Request, *TraceError) {
	rec := &p.rec
	rec.Timestamp = rec.Timestamp[:0]
	rec.InputLength = rec.InputLength[:0]
	rec.OutputLength = rec.OutputLength[:0]
	rec.HashIDs = rec.HashIDs[:0]
	if err := json.Unmarshal(line, rec); err != nil {
		field := ""
		var typeErr *json.UnmarshalTypeError
		if errors.As(err, &typeErr) {
			field = typeErr.Field
		}
		return Request{}, &TraceError{Field: field, Err: fmt.Errorf("%w: %w", ErrMalformed, err)}
	}
	for _, f := range [...]struct {
		name string
		raw  json.RawMessage
	}{
		{"timestamp", rec.Timestamp},
		{"input_length", rec.InputLength},
		{"output_length", rec.OutputLength},
		{"hash_ids", rec.HashIDs},
	} {
		if len(f.raw) == 0 || string(f.raw) == "null" {
			return Request{}, &TraceError{Field: f.name, Err: ErrMissingField}
		}
	}
	ts, err := parseBounded(rec.Timestamp, uint64(MaxArrival/time.Millisecond))
	if err != nil {
		return Request{}, &TraceError{Field: "timestamp", Err: err}
	}
	in, err := parseBounded(rec.InputLength, MaxTraceTokens)
	if err != nil {
		return Request{}, &TraceError{Field: "input_length", Err: err}
	}
	out, err := parseBounded(rec.OutputLength, MaxTraceTokens)
	if err != nil {
		return Request{}, &TraceError{Field: "output_length", Err: err}
	}
	ids, err := p.parseHashIDs(rec.HashIDs)
	if err != nil {
		return Request{}, &TraceError{Field: "hash_ids", Err: err}
	}
	if want := ceilBlocks(int(in)); len(ids) != want {
		return Request{}, &TraceError{Field: "hash_ids", Err: fmt.Errorf("%w: %d IDs for input_length %d, want ceil(%d/%d) = %d",
			ErrHashIDMismatch, len(ids), in, in, MooncakeBlockTokens, want)}
	}
	return Request{
		Arrival:      time.Duration(ts) * time.Millisecond,
		InputTokens:  int(in),
		OutputTokens: int(out),
		HashIDs:      ids,
	}, nil
}

func ceilBlocks(tokens int) int { return (tokens + MooncakeBlockTokens - 1) / MooncakeBlockTokens }

// parseHashIDs parses raw, a valid JSON value, as an array of unsigned integers and stores them
// in the arena. The result is non-nil, and capped so that appending to it cannot overwrite the
// next request's IDs.
func (p *mooncakeParser) parseHashIDs(raw []byte) ([]uint64, error) {
	if raw[0] != '[' {
		return nil, fmt.Errorf("%w: %.32q is not an array", ErrMalformed, raw)
	}
	body := trimJSONSpace(raw[1 : len(raw)-1]) // raw is valid JSON, so it ends with ']'
	if len(body) == 0 {
		return []uint64{}, nil
	}
	n := bytes.Count(body, []byte{','}) + 1
	if cap(p.arena)-len(p.arena) < n {
		p.arena = make([]uint64, 0, max(n, p.arenaChunk))
		p.arenaChunk = min(2*p.arenaChunk, 1<<16)
	}
	start := len(p.arena)
	for len(body) > 0 {
		elem := body
		if i := bytes.IndexByte(body, ','); i >= 0 {
			elem, body = body[:i], body[i+1:]
		} else {
			body = nil
		}
		// An element holding a comma (a string, array or object) is split here, and each part
		// fails parseBounded: such an element is rejected either way.
		v, err := parseBounded(trimJSONSpace(elem), math.MaxUint64)
		if err != nil {
			p.arena = p.arena[:start]
			return nil, err
		}
		p.arena = append(p.arena, v)
	}
	return p.arena[start:len(p.arena):len(p.arena)], nil
}

func trimJSONSpace(b []byte) []byte {
	return bytes.Trim(b, " \t\r\n")
}

// parseBounded parses s as a decimal integer: an optional '-' then one or more digits, nothing
// else (no '+', spaces, fraction or exponent). A negative value (other than -0) is ErrNegative,
// a value above limit or beyond 64 bits ErrOutOfRange, anything else ErrMalformed.
func parseBounded[T ~string | ~[]byte](s T, limit uint64) (uint64, error) {
	digits := s
	neg := len(digits) > 0 && digits[0] == '-'
	if neg {
		digits = digits[1:]
	}
	if len(digits) == 0 {
		return 0, fmt.Errorf("%w: %.32q is not an integer", ErrMalformed, s)
	}
	var v uint64
	overflow := false
	for i := 0; i < len(digits); i++ {
		c := digits[i]
		if c < '0' || c > '9' {
			return 0, fmt.Errorf("%w: %.32q is not an integer", ErrMalformed, s)
		}
		d := uint64(c - '0')
		if v > (math.MaxUint64-d)/10 {
			overflow = true
		}
		v = v*10 + d
	}
	switch {
	case neg && (v != 0 || overflow):
		return 0, fmt.Errorf("%w: %.32s", ErrNegative, s)
	case overflow || v > limit:
		return 0, fmt.Errorf("%w: %.32s exceeds %d", ErrOutOfRange, s, limit)
	}
	return v, nil
}

// azureHeader is the header row of the Azure LLM inference 2023 CSVs (docs/traces.md).
var azureHeader = [...]string{"TIMESTAMP", "ContextTokens", "GeneratedTokens"}

// azureTimeLayout parses "2023-11-16 18:15:46.6805900"; time.Parse accepts a fractional second
// of any length after the seconds field. The traces carry no zone; times are taken as UTC.
const azureTimeLayout = time.DateTime

// ReadAzure reads an Azure LLM inference 2023 CSV trace (docs/traces.md; Azure/AzurePublicDataset
// `AzureLLMInferenceDataset2023.md`): the header TIMESTAMP,ContextTokens,GeneratedTokens, then one
// row a request with a wall-clock time like "2023-11-16 18:15:46.6805900", the prompt length and
// the output length in tokens. Arrival is the row's time minus the first row's, which becomes
// Trace.Start. HashIDs are nil: the trace has no prefix information.
//
// Validation is strict: the header must match exactly (case-sensitive, no byte-order mark), every
// row must have three fields, times must parse and not decrease, lengths must be decimal integers
// in [0, MaxTraceTokens], and no arrival may exceed MaxArrival. CRLF line endings and quoted
// fields are accepted; empty lines are skipped, as encoding/csv does.
//
// On success the Trace has Format FormatAzure and at least one request. Otherwise the error is a
// *TraceError wrapping ErrEmptyTrace, ErrHeaderMismatch, ErrMalformed, ErrNegative,
// ErrOutOfRange or ErrUnsorted — or r's own error — and the Trace is nil.
func ReadAzure(r io.Reader) (*Trace, error) {
	cr := csv.NewReader(r)
	cr.FieldsPerRecord = -1
	cr.ReuseRecord = true
	lastLine := 0
	readErr := func(err error) *TraceError {
		var pe *csv.ParseError
		if errors.As(err, &pe) {
			return &TraceError{Line: max(pe.Line, 1), Err: fmt.Errorf("%w: %w", ErrMalformed, err)}
		}
		return &TraceError{Line: lastLine + 1, Err: err}
	}

	header, err := cr.Read()
	if err == io.EOF {
		return nil, &TraceError{Line: 1, Err: ErrEmptyTrace}
	}
	if err != nil {
		return nil, readErr(err)
	}
	lastLine, _ = cr.FieldPos(0)
	if !slices.Equal(header, azureHeader[:]) {
		return nil, &TraceError{Line: lastLine,
			Err: fmt.Errorf("%w: got %.40q, want %q", ErrHeaderMismatch, header, azureHeader)}
	}

	t := &Trace{Format: FormatAzure}
	var prev time.Duration
	for {
		rec, err := cr.Read()
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, readErr(err)
		}
		line, _ := cr.FieldPos(0)
		lastLine = line
		if len(rec) != len(azureHeader) {
			return nil, &TraceError{Line: line,
				Err: fmt.Errorf("%w: %d fields, want %d", ErrMalformed, len(rec), len(azureHeader))}
		}
		at, err := time.Parse(azureTimeLayout, rec[0])
		if err != nil {
			return nil, &TraceError{Line: line, Field: azureHeader[0], Err: fmt.Errorf("%w: %w", ErrMalformed, err)}
		}
		if len(t.Requests) == 0 {
			t.Start = at
		}
		arrival := at.Sub(t.Start) // saturates instead of overflowing
		if arrival < prev {
			return nil, &TraceError{Line: line, Field: azureHeader[0],
				Err: fmt.Errorf("%w: %s is %v before the previous row", ErrUnsorted, rec[0], prev-arrival)}
		}
		if arrival > MaxArrival {
			return nil, &TraceError{Line: line, Field: azureHeader[0],
				Err: fmt.Errorf("%w: %s is more than %v after the first row", ErrOutOfRange, rec[0], MaxArrival)}
		}
		prev = arrival
		in, err := parseBounded(rec[1], MaxTraceTokens)
		if err != nil {
			return nil, &TraceError{Line: line, Field: azureHeader[1], Err: err}
		}
		out, err := parseBounded(rec[2], MaxTraceTokens)
		if err != nil {
			return nil, &TraceError{Line: line, Field: azureHeader[2], Err: err}
		}
		t.Requests = append(t.Requests, Request{
			Index:        len(t.Requests),
			Line:         line,
			Arrival:      arrival,
			InputTokens:  int(in),
			OutputTokens: int(out),
		})
	}
	if len(t.Requests) == 0 {
		return nil, &TraceError{Line: lastLine + 1, Err: ErrEmptyTrace}
	}
	return t, nil
}

// ReadTraceFile reads the trace at path and names it after the file (base name without
// extensions). A gzip file (detected by its magic bytes) is decompressed first. The format comes
// from the extension that remains: ".jsonl" or ".json" is Mooncake, ".csv" is Azure; any other
// extension is decided by content: a first non-blank byte '{' is Mooncake, a first line starting
// "TIMESTAMP," is Azure.
//
// Errors: the *fs.PathError of os.Open, a gzip header error, ErrUnknownFormat when neither rule
// applies, or the reader's *TraceError; each is wrapped with the path, so errors.Is and errors.As
// work. The Trace is nil on error.
func ReadTraceFile(path string) (*Trace, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("sim: read trace: %w", err)
	}
	defer f.Close()

	name := filepath.Base(path)
	br := bufio.NewReaderSize(f, 64<<10)
	if magic, _ := br.Peek(2); len(magic) == 2 && magic[0] == 0x1f && magic[1] == 0x8b {
		zr, err := gzip.NewReader(br)
		if err != nil {
			return nil, wrapf(err, "read trace %s", path)
		}
		defer zr.Close()
		br = bufio.NewReaderSize(zr, 64<<10)
		name = strings.TrimSuffix(name, ".gz")
	}
	ext := filepath.Ext(name)
	format := Format("")
	switch strings.ToLower(ext) {
	case ".jsonl", ".json":
		format = FormatMooncake
	case ".csv":
		format = FormatAzure
	default:
		head, _ := br.Peek(512)
		switch trimmed := trimJSONSpace(head); {
		case len(trimmed) > 0 && trimmed[0] == '{':
			format = FormatMooncake
		case bytes.HasPrefix(head, []byte(azureHeader[0]+",")):
			format = FormatAzure
		default:
			return nil, fmt.Errorf("sim: read trace %s: extension %q, content starts %.16q: %w", path, ext, head, ErrUnknownFormat)
		}
	}

	var t *Trace
	if format == FormatMooncake {
		t, err = ReadMooncake(br)
	} else {
		t, err = ReadAzure(br)
	}
	if err != nil {
		return nil, wrapf(err, "read trace %s", path)
	}
	t.Name = strings.TrimSuffix(name, ext)
	return t, nil
}
