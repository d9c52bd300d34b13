package sim

import (
	"fmt"
	"math"
	"time"

	"github.com/enginepick/enginepick/state"
)

// Defaults of EngineModel: one Llama-3.1-8B-class model (BF16) served by one H100-SXM-class GPU
// (80 GB HBM3). Each constant states where it comes from. They are round figures for comparing
// routing policies, not a benchmark of any engine release.
const (
	// DefaultPrefillTokensPerSecond is the flat prefill model's throughput (PrefillFlat), for
	// uncached prompt tokens at any context length: the linear rate below lowered to 20,000 to
	// stand in for the attention over long contexts (the Mooncake conversation prompts average
	// 12,035 tokens, docs/traces.md).
	DefaultPrefillTokensPerSecond = 20_000.0

	// DefaultPrefillLinearTokensPerSecond is the context-independent part of prefill in the
	// attention model (PrefillAttention): the projections and MLP of one token. A forward pass
	// costs 2 FLOPs per parameter and token, 2 × 8.03 B = 16.1 GFLOP (Llama 3.1 8B model card);
	// at 40 % of the H100 SXM's 989 TFLOPS of dense BF16 (datasheet) that is
	// 0.40 × 989e12 ÷ 16.06e9 ≈ 24,600 tokens/s. Check against a published end-to-end figure: a
	// 500-token prefix "adds ~20-40 ms" to every request of Llama-8B on one H100 (Georgia Tech
	// agentic-AI infrastructure course, week 15, "LMCache" lab,
	// hungchun0201.github.io/agentic-ai-survey); the model gives 20.4 ms (attention included).
	DefaultPrefillLinearTokensPerSecond = 24_600.0

	// DefaultPrefillAttentionPairsPerSecond is the attention part of prefill in the attention
	// model: how many (query token, context token) pairs per second the attention kernels
	// process. One pair costs 4 FLOPs per head dimension and query head per layer (QKᵀ and PV):
	// 4 × 128 × 32 heads × 32 layers = 524,288 FLOPs (Llama 3.1 8B config.json). FlashAttention-3
	// measures 638–648 TFLOPS of causal forward attention with head dimension 128 at 4k–16k tokens
	// on an H100 80GB SXM5 in BF16 (Shah et al., "FlashAttention-3", arXiv:2407.08608, Figure 5;
	// the same kernel the vLLM and SGLang Hopper backends use): 640e12 ÷ 524,288 ≈ 1.22e9 pairs/s,
	// 0.82 ns per pair. A 12,035-token prompt from scratch then takes 0.489 s of linear work and
	// 0.059 s of attention (0.549 s, an effective 21,940 tokens/s); 100,000 tokens take 4.07 s and
	// 4.10 s, so attention dominates past about 100k tokens of context.
	DefaultPrefillAttentionPairsPerSecond = 640e12 / (4 * 128 * 32 * 32)

	// DefaultDecodeStepBase is the part of a decode step that does not depend on the batch:
	// reading the weights once. 8.03 B parameters × 2 bytes = 16.1 GB over the H100 SXM's
	// 3.35 TB/s of HBM3 bandwidth (datasheet) at 80 % achieved bandwidth is 16.1e9 ÷ 2.68e12 =
	// 6.0 ms.
	DefaultDecodeStepBase = 6 * time.Millisecond

	// DefaultKVBytesPerToken is the KV cache of one token of Llama-3-8B / Llama-3.1-8B in BF16:
	// 2 (K and V) × 32 layers × 8 KV heads × 128 head dim × 2 bytes = 131,072 bytes (128 KiB),
	// from the model's config.json (num_hidden_layers 32, num_key_value_heads 8, head_dim 128).
	DefaultKVBytesPerToken = 2 * 32 * 8 * 128 * 2

	// DefaultMemoryBytesPerSecond is the achieved HBM bandwidth a decode step reads the batch's
	// KV cache at: 80 % of the H100 SXM's 3.35 TB/s (datasheet). With DefaultKVBytesPerToken a
	// decode step costs 131,072 ÷ 2.68e12 ≈ 48.9 ns more per token of context in the batch.
	DefaultMemoryBytesPerSecond = 0.8 * 3.35e12

	// DefaultMaxRunningRequests caps an engine's running batch (vLLM's long-standing
	// max_num_seqs default, 256). With long prompts the KV capacity binds first.
	DefaultMaxRunningRequests = 256

	// DefaultChunkedPrefillTokens is the prefill token budget of one step (SGLang
	// --chunked-prefill-size 8192, its default on GPUs of H100 memory size; vLLM V1 uses the
	// same 8192 as max_num_batched_tokens for online serving).
	DefaultChunkedPrefillTokens = 8192

	// DefaultKVCapacityTokens is an engine's KV cache capacity. 80 GiB × 0.90 (vLLM
	// gpu_memory_utilization default) − 16.1 GB of weights − about 3 GB of activation and CUDA
	// graph workspace leaves about 58 GB, ÷ 128 KiB per token ≈ 443,000 tokens; rounded to
	// 440,000. (The Gateway API Inference Extension's prefix plugin assumes 31,250 blocks × 16 =
	// 500,000 tokens for Llama-3-8B on an H100.)
	DefaultKVCapacityTokens = 440_000

	// DefaultBlockTokens is the KV block (page) size, in tokens, of the simulated caches and of
	// the kvindex.Hasher the replay builds. It equals MooncakeBlockTokens, the granularity at
	// which the Mooncake traces record reuse: the synthetic prompts of two requests coincide
	// only in whole 512-token blocks (Request.AppendTokenIDs), so smaller pages would find no
	// more reuse and only multiply the work per request. vLLM's default is 16 and SGLang's 1;
	// set BlockTokens to model them on traces with finer prefix information.
	DefaultBlockTokens = MooncakeBlockTokens

	// DefaultMaxContextTokens is the model's context window (Llama 3.1: 131,072 tokens). The
	// replay's bucket refuses requests whose prompt plus output exceeds it.
	DefaultMaxContextTokens = 131_072

	// DefaultKVTransferBytesPerSecond is the prefill → decode link in PD mode: one 400 Gb/s
	// (NDR InfiniBand / ConnectX-7) NIC per GPU, 50 GB/s, the RDMA path Mooncake's transfer
	// engine and SGLang's PD disaggregation use. A 12,000-token prompt (1.57 GB of KV) moves in
	// about 31 ms.
	DefaultKVTransferBytesPerSecond = 50e9

	// DefaultMaxLoRAs is an engine's LoRA adapter slots when the trace names adapters (vLLM
	// --max-loras: the adapters resident in GPU memory, and so in one batch). vLLM's own
	// default is 1, one adapter per batch; 4 is the replay's LoRA scenario, 16 engines × 4 slots
	// for 64 adapters: as many slots in the fleet as adapters, so that where requests go decides
	// how often adapters load.
	DefaultMaxLoRAs = 4

	// DefaultLoRALoadTime is the time loading one adapter into a slot stalls its engine's step
	// (vLLM activates a batch's adapters synchronously, before the forward pass). The adapter:
	// rank 16 (vLLM --max-lora-rank default) on the seven projections of every layer (q, k, v,
	// o, gate, up, down), r × (2·4096 + 2·(4096+1024) + 2·4096 + 3·(4096+14336)) = 81,920·r
	// parameters a layer (Llama 3.1 8B config.json: hidden 4096, 8 KV heads × 128, intermediate
	// 14,336), × 32 layers × 2 bytes (BF16) = 83.9 MB. Loaded from host memory, where vLLM keeps
	// the adapters it has read in pinned buffers (vllm-project/vllm vllm/lora/models.py), over
	// the H100 SXM's PCIe Gen5 x16 link (64 GB/s each way, datasheet) at 80 % achieved bandwidth:
	// 83.9 MB ÷ 51.2 GB/s = 1.64 ms, rounded up to 2 ms for the 448 tensor copies (A and B of
	// each projection of each layer). This assumes the host keeps every adapter (vLLM
	// --max-cpu-loras at least the adapters served); read from local NVMe instead (about
	// 7 GB/s, PCIe Gen4 x4 datasheets), the same file takes 12 ms more.
	DefaultLoRALoadTime = 2 * time.Millisecond
)

// EngineModel is the documented performance model of one simulated engine. Every engine of a
// replay follows it; it is deterministic and advances on the replay's virtual clock only.
//
// The zero value of each field means its Default… constant; negative values are invalid. Use
// DefaultEngineModel to see the filled-in values.
//
// Scheduling follows SGLang's default scheduler (no mixed chunk): the engine keeps a FIFO waiting
// queue and a running batch of at most MaxRunningRequests. At each step boundary it forms a
// prefill batch if it can: first the remaining prompt of a request whose prefill was chunked,
// then requests from the head of the queue, while the batch has fewer than ChunkedPrefillTokens
// uncached tokens, the running batch has room and the KV cache can hold the request's prompt and
// output. The queue is strictly FIFO: a head that does not fit blocks those behind it. A prefill
// step's time depends on PrefillModel. Under PrefillAttention (the default) every uncached token
// costs its context-independent work plus attention over every token at or before it in its
// prompt, cached and uncached alike:
//
//	Σ over the batch's chunks of  t ÷ PrefillLinearTokensPerSecond
//	                            + (t·c + t·(t+1)/2) ÷ PrefillAttentionPairsPerSecond
//
// for a chunk of t uncached tokens whose prompt already holds c tokens before it (cached tokens
// plus earlier chunks), so a cache hit saves the hit tokens' own work but not the attention the
// following tokens pay over them. Under PrefillFlat (the model of earlier releases, kept for
// comparison) a step takes (uncached tokens in the batch) ÷ PrefillTokensPerSecond at any context
// length, so a cached token costs nothing and an uncached one the same everywhere, which
// overstates the value of hits on long prompts. The decode batch waits during a prefill step. The step that completes a request's prompt produces its first token. Without
// prefill work the engine runs decode steps, each producing one token for every decoding
// request, taking
//
//	DecodeStepBase + (KV tokens of the decoding requests) × KVBytesPerToken ÷ MemoryBytesPerSecond
//
// so step time grows with the batch and its context (a memory-bound step reads the weights once
// and every request's KV). A request's KV tokens are its prompt plus the tokens it has generated.
// Between two events the decode batch does not change, so the engine advances whole runs of
// steps analytically rather than one by one.
//
// KV cache: admission reserves the request's uncached prompt plus its whole output, evicting
// unreferenced cached blocks in LRU order (leaves first, as SGLang's radix cache does) to make
// room, so a running request is never preempted; SGLang instead reserves an estimate of the
// output and retracts requests when it runs out. Cached prompt blocks are matched at admission
// (the last prompt token is always recomputed, as vLLM and SGLang do, to produce logits), and each
// full block a prefill step computes is inserted into the cache and published to the replay's
// kvindex.Index as a BlockStored event; evictions publish BlockRemoved. Generated tokens occupy KV
// while the request runs and are freed at the end, never cached: the traces give them no
// identity, so they could never be hit.
//
// LoRA adapters (a trace whose requests name Request.Adapter): a plain or prefill engine holds at
// most MaxLoRAs adapters in GPU slots, as vLLM does. A request for an adapter is admitted only if
// its adapter is resident or can be loaded: into a free slot, or in place of the least recently
// used adapter that no running request uses (an adapter in use cannot be evicted). A request whose
// adapter can get no slot is skipped and keeps its place in the queue, and the requests behind it
// are considered (vLLM's scheduler does the same when a batch is at max_loras); a request that
// does not fit in KV still blocks those behind it. Each load adds LoRALoadTime to the prefill step
// that admits the request. An adapter's KV blocks are cached under its own hash chain, apart from
// the base model's and every other adapter's, and published to its own index, as KV events naming
// the adapter (lora_name) are. Base-model requests need no slot. The engines report, as vLLM's
// vllm:lora_requests_info does, their slots and the adapters of their running and waiting requests
// (loadmon.Report.LoRA). PD decode engines hold every adapter (not modelled).
//
// Not modelled: CUDA graph and scheduling overheads, preemption, speculative decoding, network
// latency between router and engine, the cost of LoRA computation in a batch, and kernel
// efficiency varying with batch shape (the prefill coefficients are for long chunks).
type EngineModel struct {
	// PrefillModel selects the prefill time model: PrefillAttention or PrefillFlat. "" means
	// PrefillAttention; another value is invalid.
	PrefillModel PrefillModel `json:"prefill_model"`
	// PrefillTokensPerSecond is PrefillFlat's throughput, in uncached prompt tokens per second;
	// unused under PrefillAttention. 0 means DefaultPrefillTokensPerSecond.
	PrefillTokensPerSecond float64 `json:"prefill_tokens_per_s"`
	// PrefillLinearTokensPerSecond is PrefillAttention's context-independent rate, in uncached
	// tokens per second. 0 means DefaultPrefillLinearTokensPerSecond.
	PrefillLinearTokensPerSecond float64 `json:"prefill_linear_tokens_per_s"`
	// PrefillAttentionPairsPerSecond is PrefillAttention's attention rate, in (query token,
	// context token) pairs per second. 0 means DefaultPrefillAttentionPairsPerSecond.
	PrefillAttentionPairsPerSecond float64 `json:"prefill_attention_pairs_per_s"`
	// DecodeStepBase is the batch-independent time of one decode step. 0 means
	// DefaultDecodeStepBase.
	DecodeStepBase time.Duration `json:"decode_step_base_ns"`
	// KVBytesPerToken is the KV cache size of one token, in bytes; it prices decode steps and PD
	// transfers. 0 means DefaultKVBytesPerToken.
	KVBytesPerToken int `json:"kv_bytes_per_token"`
	// MemoryBytesPerSecond is the achieved memory bandwidth at which a decode step reads the
	// batch's KV, in bytes per second. 0 means DefaultMemoryBytesPerSecond.
	MemoryBytesPerSecond float64 `json:"memory_bytes_per_s"`
	// MaxRunningRequests caps the running batch, in requests. 0 means
	// DefaultMaxRunningRequests.
	MaxRunningRequests int `json:"max_running_requests"`
	// ChunkedPrefillTokens is the uncached-token budget of one prefill step. 0 means
	// DefaultChunkedPrefillTokens.
	ChunkedPrefillTokens int `json:"chunked_prefill_tokens"`
	// KVCapacityTokens is the engine's KV cache capacity, in tokens; it must hold
	// MaxContextTokens. 0 means DefaultKVCapacityTokens.
	KVCapacityTokens int `json:"kv_capacity_tokens"`
	// BlockTokens is the KV block size, in tokens: the unit of caching, eviction and KV events.
	// Must be at most KVCapacityTokens and 65,536 (kvindex.HasherConfig). 0 means DefaultBlockTokens.
	BlockTokens int `json:"block_tokens"`
	// MaxContextTokens is the model's context window, in tokens: the replay's bucket refuses
	// longer requests (prompt plus output). 0 means DefaultMaxContextTokens.
	MaxContextTokens int `json:"max_context_tokens"`
	// KVTransferBytesPerSecond is the prefill → decode link bandwidth in PD mode, in bytes per
	// second: a transfer takes prompt tokens × KVBytesPerToken ÷ this. 0 means
	// DefaultKVTransferBytesPerSecond.
	KVTransferBytesPerSecond float64 `json:"kv_transfer_bytes_per_s"`
	// PriorityScheduling orders a plain or prefill engine's waiting requests as vLLM's
	// --scheduling-policy priority does (vllm-project/vllm vllm/v1/core/sched/request_queue.py):
	// the lowest engine priority first, then the first to reach the engine. The router forwards
	// each request's priority negated (engine priority = −Request.Priority), since enginepick
	// serves higher priorities first and vLLM lower values. A running request is never preempted:
	// the engine reserves its KV up front, so vLLM's preemption (a running request out of KV)
	// never arises. False means first come, first served.
	PriorityScheduling bool `json:"priority_scheduling,omitempty"`
	// MaxLoRAs is the LoRA adapter slots of a plain or prefill engine (vLLM --max-loras). 0
	// means DefaultMaxLoRAs when the trace names adapters; a replay of a trace without adapters
	// leaves it 0 and models no slots.
	MaxLoRAs int `json:"max_loras,omitempty"`
	// LoRALoadTime is the time one adapter load adds to the step that admits its request. 0
	// means DefaultLoRALoadTime when the trace names adapters (then left 0 otherwise, as
	// MaxLoRAs).
	LoRALoadTime time.Duration `json:"lora_load_time_ns,omitempty"`
}

// PrefillModel names a prefill time model (EngineModel.PrefillModel).
type PrefillModel string

// The prefill time models.
const (
	// PrefillAttention charges every uncached token its linear work and attention over its whole
	// context, cached tokens included (the default).
	PrefillAttention PrefillModel = "attention"
	// PrefillFlat charges every uncached token the same time at any context length and cached
	// tokens nothing: the model of earlier releases, for comparison.
	PrefillFlat PrefillModel = "flat"
)

// DefaultEngineModel returns the model with every field set to its default.
func DefaultEngineModel() EngineModel {
	var m EngineModel
	m.fill()
	return m
}

// fill replaces zero fields with their defaults.
func (m *EngineModel) fill() {
	if m.PrefillModel == "" {
		m.PrefillModel = PrefillAttention
	}
	if m.PrefillTokensPerSecond == 0 {
		m.PrefillTokensPerSecond = DefaultPrefillTokensPerSecond
	}
	if m.PrefillLinearTokensPerSecond == 0 {
		m.PrefillLinearTokensPerSecond = DefaultPrefillLinearTokensPerSecond
	}
	if m.PrefillAttentionPairsPerSecond == 0 {
		m.PrefillAttentionPairsPerSecond = DefaultPrefillAttentionPairsPerSecond
	}
	if m.DecodeStepBase == 0 {
		m.DecodeStepBase = DefaultDecodeStepBase
	}
	if m.KVBytesPerToken == 0 {
		m.KVBytesPerToken = DefaultKVBytesPerToken
	}
	if m.MemoryBytesPerSecond == 0 {
		m.MemoryBytesPerSecond = DefaultMemoryBytesPerSecond
	}
	if m.MaxRunningRequests == 0 {
		m.MaxRunningRequests = DefaultMaxRunningRequests
	}
	if m.ChunkedPrefillTokens == 0 {
		m.ChunkedPrefillTokens = DefaultChunkedPrefillTokens
	}
	if m.KVCapacityTokens == 0 {
		m.KVCapacityTokens = DefaultKVCapacityTokens
	}
	if m.BlockTokens == 0 {
		m.BlockTokens = DefaultBlockTokens
	}
	if m.MaxContextTokens == 0 {
		m.MaxContextTokens = DefaultMaxContextTokens
	}
	if m.KVTransferBytesPerSecond == 0 {
		m.KVTransferBytesPerSecond = DefaultKVTransferBytesPerSecond
	}
}

// fillLoRA replaces the zero LoRA fields with their defaults; the replay calls it when the trace
// names adapters.
func (m *EngineModel) fillLoRA() {
	if m.MaxLoRAs == 0 {
		m.MaxLoRAs = DefaultMaxLoRAs
	}
	if m.LoRALoadTime == 0 {
		m.LoRALoadTime = DefaultLoRALoadTime
	}
}

// validate checks a filled model. Errors wrap state.ErrInvalidConfiguration and name the field.
func (m *EngineModel) validate() error {
	bad := func(field string, v any, rule string) error {
		return fmt.Errorf("sim: EngineModel.%s = %v: %s: %w", field, v, rule, state.ErrInvalidConfiguration)
	}
	positive := func(v float64) bool { return v > 0 && !math.IsInf(v, 1) }
	switch {
	case m.PrefillModel != PrefillAttention && m.PrefillModel != PrefillFlat:
		return bad("PrefillModel", fmt.Sprintf("%q", m.PrefillModel), fmt.Sprintf("must be %q or %q", PrefillAttention, PrefillFlat))
	case !positive(m.PrefillTokensPerSecond):
		return bad("PrefillTokensPerSecond", m.PrefillTokensPerSecond, "must be finite and > 0")
	case !positive(m.PrefillLinearTokensPerSecond):
		return bad("PrefillLinearTokensPerSecond", m.PrefillLinearTokensPerSecond, "must be finite and > 0")
	case !positive(m.PrefillAttentionPairsPerSecond):
		return bad("PrefillAttentionPairsPerSecond", m.PrefillAttentionPairsPerSecond, "must be finite and > 0")
	case m.DecodeStepBase < 0:
		return bad("DecodeStepBase", m.DecodeStepBase, "must be >= 0")
	case m.KVBytesPerToken < 0:
		return bad("KVBytesPerToken", m.KVBytesPerToken, "must be >= 0")
	case !positive(m.MemoryBytesPerSecond):
		return bad("MemoryBytesPerSecond", m.MemoryBytesPerSecond, "must be finite and > 0")
	case m.MaxRunningRequests < 0:
		return bad("MaxRunningRequests", m.MaxRunningRequests, "must be >= 0")
	case m.ChunkedPrefillTokens < 0:
		return bad("ChunkedPrefillTokens", m.ChunkedPrefillTokens, "must be >= 0")
	case m.BlockTokens < 0 || m.BlockTokens > 1<<16:
		return bad("BlockTokens", m.BlockTokens, "must be in [1, 65536]")
	case m.MaxContextTokens < 0:
		return bad("MaxContextTokens", m.MaxContextTokens, "must be >= 0")
	case m.KVCapacityTokens < m.MaxContextTokens:
		return bad("KVCapacityTokens", m.KVCapacityTokens, fmt.Sprintf("must hold MaxContextTokens (%d)", m.MaxContextTokens))
	case m.KVCapacityTokens < m.BlockTokens:
		return bad("KVCapacityTokens", m.KVCapacityTokens, fmt.Sprintf("must hold one block (%d tokens)", m.BlockTokens))
	case !positive(m.KVTransferBytesPerSecond):
		return bad("KVTransferBytesPerSecond", m.KVTransferBytesPerSecond, "must be finite and > 0")
	case m.MaxLoRAs < 0:
		return bad("MaxLoRAs", m.MaxLoRAs, "must be >= 0")
	case m.LoRALoadTime < 0:
		return bad("LoRALoadTime", m.LoRALoadTime, "must be >= 0")
	}
	return nil
}

// prefillSeconds returns the time, in seconds, of prefilling a chunk of tokens uncached tokens
// whose prompt holds context tokens before it (see EngineModel). A step's time is the sum over its
// chunks.
func (m *EngineModel) prefillSeconds(tokens, context int) float64 {
	t := float64(tokens)
	if m.PrefillModel == PrefillFlat {
		return t / m.PrefillTokensPerSecond
	}
	pairs := t*float64(context) + t*(t+1)/2
	return t/m.PrefillLinearTokensPerSecond + pairs/m.PrefillAttentionPairsPerSecond
}

// transferTime returns the PD transfer time of a prompt of tokens tokens.
func (m *EngineModel) transferTime(tokens int) time.Duration {
	return secondsToDuration(float64(tokens) * float64(m.KVBytesPerToken) / m.KVTransferBytesPerSecond)
}

// kvTokenSeconds is the decode-step cost of one token of context, in seconds.
func (m *EngineModel) kvTokenSeconds() float64 {
	return float64(m.KVBytesPerToken) / m.MemoryBytesPerSecond
}

// secondsToDuration rounds s seconds to the nearest nanosecond, saturating at the Duration range.
func secondsToDuration(s float64) time.Duration {
	ns := math.Round(s * 1e9)
	if ns >= math.MaxInt64 {
		return time.Duration(math.MaxInt64)
	}
	if ns <= 0 {
		return 0
	}
	return time.Duration(ns)
}
