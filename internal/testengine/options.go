package testengine

import (
	"errors"
	"fmt"
	"time"
)

// Defaults of Options. Durations are small so that tests run fast; a test that needs a cache hit
// to be visibly faster raises PrefillPerToken.
const (
	DefaultModel            = "test-model"
	DefaultAddr             = "127.0.0.1:0"
	DefaultMaxNumSeqs       = 256 // vLLM's max_num_seqs default
	DefaultBlockSize        = 16  // vLLM's block_size default on GPUs
	DefaultNumBlocks        = 4096
	DefaultMaxModelLen      = 8192
	DefaultMaxTokens        = 16
	DefaultPrefillPerToken  = 20 * time.Microsecond
	DefaultDecodePerToken   = time.Millisecond
	DefaultMaxBodyBytes     = 4 << 20
	DefaultReplayBufferSize = 10_000 // vLLM's ZmqEventPublisher buffer_steps
)

// Options configures an Engine. The zero value is usable: every zero field takes the default
// named in its comment.
type Options struct {
	// Model is the served model name; requests naming another model get a 404. "" means
	// DefaultModel.
	Model string
	// Addr is the HTTP listen address (host:port). "" means DefaultAddr, a free port on loopback.
	Addr string
	// DPRanks is the number of data-parallel ranks, each with its own scheduler, KV cache and
	// KV-event publisher (on consecutive ports), in one process. By default they are served as
	// vLLM's --data-parallel-size behind one API server: one HTTP server for all ranks, a request's
	// rank chosen by its X-data-parallel-rank header or else the least loaded rank, and /metrics
	// naming each rank in its engine label; RankServers gives each its own server. 0 means 1.
	DPRanks int
	// RankServers serves each rank on its own HTTP server, as vLLM's external DP load balancing
	// (and llm-d's simulator) runs one server per rank: rank r at RankURL(r), on the port of Addr
	// plus r when Addr names one, else on a free port. Such a server serves only its rank (it
	// ignores X-data-parallel-rank), and its /metrics, /sleep and /wake_up are that rank's.
	RankServers bool
	// MaxNumSeqs caps the running requests of a rank (vLLM max_num_seqs); later requests wait in
	// the order of SchedulingPolicy. 0 means DefaultMaxNumSeqs.
	MaxNumSeqs int
	// SchedulingPolicy is vLLM's --scheduling-policy: "fcfs" (first come, first served) or
	// "priority": waiting requests by their body's "priority" field, lowest first, then first
	// come (vllm-project/vllm vllm/v1/core/sched/request_queue.py). Under "fcfs" a request with a
	// priority other than 0 gets vLLM's 400. "" means "fcfs".
	SchedulingPolicy string
	// BlockSize is the KV block size in tokens (vLLM block_size). 0 means DefaultBlockSize.
	BlockSize int
	// NumBlocks is each rank's KV capacity in blocks (vLLM num_gpu_blocks). 0 means
	// DefaultNumBlocks. It must hold MaxModelLen tokens.
	NumBlocks int
	// MaxModelLen bounds a request's prompt plus output tokens (vLLM max_model_len); longer
	// requests get a 400. 0 means DefaultMaxModelLen, or NumBlocks × BlockSize when NumBlocks is
	// set and smaller.
	MaxModelLen int
	// MaxTokens is the output length of a request that sets neither max_tokens nor
	// max_completion_tokens. 0 means DefaultMaxTokens.
	MaxTokens int
	// PrefillPerToken is the prefill time per prompt token not served from the prefix cache;
	// the first output token comes when the prefill ends. 0 means DefaultPrefillPerToken;
	// negative means none.
	PrefillPerToken time.Duration
	// DecodePerToken is the time between two output tokens. 0 means DefaultDecodePerToken;
	// negative means none.
	DecodePerToken time.Duration
	// MaxBodyBytes bounds a request body; a longer one gets a 413. 0 means DefaultMaxBodyBytes.
	MaxBodyBytes int64
	// KVEvents configures the KV-event publishers.
	KVEvents KVEventsOptions
}

// Encoding is the msgpack shape of the KV-event payloads.
type Encoding uint8

// The encodings of vllm-project/vllm vllm/distributed/kv_events.py: EventBatch and KVCacheEvent
// as msgspec structs with array_like=True (tagged arrays) in older releases, as maps since.
const (
	// EncodingMap encodes a batch as {"ts", "events", "data_parallel_rank"} and each event as a
	// map whose "type" key is the tag, as current vLLM does.
	EncodingMap Encoding = iota
	// EncodingArray encodes a batch as [ts, events, data_parallel_rank] and each event as a
	// tagged array: ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
	// lora_id, medium], ["BlockRemoved", block_hashes, medium], ["AllBlocksCleared"].
	EncodingArray
)

// ReplayFormat is the reply framing of the replay socket.
type ReplayFormat uint8

const (
	// ReplayVLLM answers each buffered batch with ["", seq, payload] and ends with
	// ["", 0xffffffffffffffff, ""] (vllm-project/vllm vllm/distributed/kv_events.py,
	// ZmqEventPublisher._service_replay).
	ReplayVLLM ReplayFormat = iota
	// ReplayTopic answers each batch with ["", topic, seq, payload] and ends with
	// ["", "", 0xffffffffffffffff, ""], as llm-d's vLLM simulator does.
	ReplayTopic
)

// KVEventsOptions configures the KV-event publishers: per rank a ZMQ PUB socket sending
// [topic, sequence as 8 bytes big-endian, msgpack payload] and a ROUTER replay socket answering
// ["", start as 8 bytes big-endian] with the buffered batches numbered start or later. The zero
// value publishes vLLM's current format on free ports with a replay socket.
type KVEventsOptions struct {
	// Disabled turns the publishers off: no ZMQ sockets, no events.
	Disabled bool
	// Port is rank 0's PUB port; rank r binds Port + r, as vLLM offsets its endpoint by the DP
	// rank. 0 means consecutive free ports.
	Port int
	// ReplayPort is rank 0's replay (ROUTER) port; rank r binds ReplayPort + r. 0 means
	// consecutive free ports.
	ReplayPort int
	// NoReplay leaves the replay sockets out.
	NoReplay bool
	// Topic is the first frame of every message (vLLM KVEventsConfig.topic, "" by default). In it,
	// {rank} is replaced by the rank and {addr} by the host:port of the HTTP server serving the
	// rank, so that "kv@{addr}@m" gives llm-d's per-rank topics with RankServers.
	Topic string
	// Encoding is the payload shape; the zero value is EncodingMap.
	Encoding Encoding
	// RootParentZero sends the parent of a prompt's first block as the integer 0 instead of nil
	// (nil is vLLM's; 0 is llm-d's convention).
	RootParentZero bool
	// FirstSeq is the sequence number of the first batch, and again after Restart: 0 as vLLM,
	// 1 as some other publishers.
	FirstSeq uint64
	// OmitDPRank leaves data_parallel_rank out of every batch, as vLLM releases before it existed
	// did ([ts, events] arrays).
	OmitDPRank bool
	// ReplayFormat is the replay reply framing; the zero value is ReplayVLLM.
	ReplayFormat ReplayFormat
	// ReplayBufferSize is how many of the latest batches each rank keeps for replay. 0 means
	// DefaultReplayBufferSize.
	ReplayBufferSize int
}

// ErrOptions is matched (errors.Is) by every error of an invalid Options value.
var ErrOptions = errors.New("testengine: invalid options")

// withDefaults returns o with its defaults applied, or an error wrapping ErrOptions.
func (o Options) withDefaults() (Options, error) {
	if o.Model == "" {
		o.Model = DefaultModel
	}
	if o.Addr == "" {
		o.Addr = DefaultAddr
	}
	def := func(v *int, d int) {
		if *v == 0 {
			*v = d
		}
	}
	def(&o.DPRanks, 1)
	def(&o.MaxNumSeqs, DefaultMaxNumSeqs)
	def(&o.BlockSize, DefaultBlockSize)
	def(&o.NumBlocks, DefaultNumBlocks)
	def(&o.MaxTokens, DefaultMaxTokens)
	def(&o.KVEvents.ReplayBufferSize, DefaultReplayBufferSize)
	if o.MaxModelLen == 0 {
		o.MaxModelLen = min(DefaultMaxModelLen, o.NumBlocks*o.BlockSize)
	}
	if o.PrefillPerToken == 0 {
		o.PrefillPerToken = DefaultPrefillPerToken
	}
	if o.DecodePerToken == 0 {
		o.DecodePerToken = DefaultDecodePerToken
	}
	if o.MaxBodyBytes == 0 {
		o.MaxBodyBytes = DefaultMaxBodyBytes
	}
	if o.SchedulingPolicy == "" {
		o.SchedulingPolicy = "fcfs"
	}
	bad := func(format string, args ...any) (Options, error) {
		return o, fmt.Errorf("%w: "+format, append([]any{ErrOptions}, args...)...)
	}
	switch {
	case o.DPRanks < 0 || o.DPRanks > 64:
		return bad("DPRanks %d outside [1, 64]", o.DPRanks)
	case o.MaxNumSeqs < 0:
		return bad("MaxNumSeqs %d is negative", o.MaxNumSeqs)
	case o.SchedulingPolicy != "fcfs" && o.SchedulingPolicy != "priority":
		return bad("SchedulingPolicy %q: want \"fcfs\" or \"priority\"", o.SchedulingPolicy)
	case o.BlockSize < 0:
		return bad("BlockSize %d is negative", o.BlockSize)
	case o.NumBlocks < 0:
		return bad("NumBlocks %d is negative", o.NumBlocks)
	case o.MaxTokens < 0:
		return bad("MaxTokens %d is negative", o.MaxTokens)
	case o.MaxBodyBytes < 0:
		return bad("MaxBodyBytes %d is negative", o.MaxBodyBytes)
	case o.MaxModelLen < 2:
		return bad("MaxModelLen %d below 2", o.MaxModelLen)
	case o.MaxModelLen > o.NumBlocks*o.BlockSize:
		// vLLM refuses to start when one request of max_model_len tokens cannot fit its cache.
		return bad("MaxModelLen %d tokens exceeds the KV capacity of %d blocks × %d tokens", o.MaxModelLen, o.NumBlocks, o.BlockSize)
	case o.KVEvents.Port < 0 || o.KVEvents.Port+o.DPRanks-1 > 65535:
		return bad("KVEvents.Port %d + %d ranks outside [1, 65535]", o.KVEvents.Port, o.DPRanks)
	case o.KVEvents.ReplayPort < 0 || o.KVEvents.ReplayPort+o.DPRanks-1 > 65535:
		return bad("KVEvents.ReplayPort %d + %d ranks outside [1, 65535]", o.KVEvents.ReplayPort, o.DPRanks)
	case o.KVEvents.Encoding > EncodingArray:
		return bad("KVEvents.Encoding %d unknown", o.KVEvents.Encoding)
	case o.KVEvents.ReplayFormat > ReplayTopic:
		return bad("KVEvents.ReplayFormat %d unknown", o.KVEvents.ReplayFormat)
	case o.KVEvents.ReplayBufferSize < 0:
		return bad("KVEvents.ReplayBufferSize %d is negative", o.KVEvents.ReplayBufferSize)
	}
	return o, nil
}
