package sim

import (
	"math"
)

// Ceiling is the sustained throughput ceiling of a replay's requests on its engine model: the
// least engine time they need whatever the routing, and the highest speed at which the fleet could
// do that work over the trace's arrival span with every engine busy all the time. No router
// sustains more. A finite replay can pass it by the work still undone when its last request
// arrives: prefill bounded by the TTFT target (at most engines × SLO of engine time for the
// requests that meet it) and the decode of the requests still running, which KV capacity bounds;
// on a short trace prefix that allowance is several per cent of the work. The floors are:
//
//   - prefill: every prompt prefilled after the longest prefix that any earlier request of the
//     trace had, as if one cache of unlimited size, never evicted, were shared by every engine
//     (the last prompt token is recomputed, as on the engines), each priced by the engine model
//     with its attention term;
//   - decode: every decode step of every request reads its whole context
//     (prompt plus the tokens generated so far) at KVBytesPerToken ÷ MemoryBytesPerSecond per token,
//     whatever the batch, and the weights are read once per step for a batch of
//     MaxRunningRequests, the largest an engine runs.
//
// Real engines do more: caches are finite and per engine, KV capacity limits batches to a few
// dozen long requests, queues idle engines between bursts (docs/performance.md "Capacity and its
// ceiling").
type Ceiling struct {
	// Requests is the number of requests priced: those of the trace (cut to Config.Limit) that
	// fit the model's context window (the replay refuses the others).
	Requests int `json:"requests"`
	// ArrivalSpan is the time from the first to the last arrival at speed 1, in seconds.
	ArrivalSpan float64 `json:"arrival_span_s"`
	// PrefillNoCache is the engine time, in seconds, of prefilling every prompt from scratch.
	PrefillNoCache float64 `json:"prefill_no_cache_s"`
	// PrefillInfiniteCache is the prefill floor, in seconds: every prompt after its longest
	// prefix seen earlier in the trace.
	PrefillInfiniteCache float64 `json:"prefill_infinite_cache_s"`
	// DecodeKV is the decode steps' reads of the requests' KV, in seconds.
	DecodeKV float64 `json:"decode_kv_s"`
	// DecodeBase is the decode steps' weight reads with every step at MaxRunningRequests, in
	// seconds.
	DecodeBase float64 `json:"decode_base_s"`
	// Speed is the ceiling: engines × ArrivalSpan ÷ work, where a plain fleet's engines do
	// PrefillInfiniteCache + DecodeKV + DecodeBase, and a PD fleet's prefill and decode engines
	// do the prefill and decode floors separately (the lower of the two speeds; KV transfers are
	// free). +Inf when the span or the work is zero.
	Speed float64 `json:"speed"`
}

// ComputeCeiling returns the sustained throughput ceiling of cfg's requests (after Config.Limit and
// Config.SystemPromptTokens) on cfg.Model and cfg.Fleet (see Ceiling). Config.Speed, Policies and
// Routers do not matter. Errors: those of Replay for an invalid configuration.
func ComputeCeiling(cfg Config) (*Ceiling, error) {
	rc, err := cfg.resolve()
	if err != nil {
		return nil, err
	}
	m := &rc.Model
	B := m.BlockTokens
	c := &Ceiling{}
	seen := map[uint64]struct{}{}
	var toks []uint32
	var hashes []uint64
	var scratch []byte
	steps := 0.0
	for i := range rc.requests {
		tr := &rc.requests[i]
		toks = tr.AppendTokenIDs(append(toks[:0], rc.systemPrompt...))
		root := uint64(engineHashSeed)
		if tr.Adapter != "" {
			root = rc.adapterRoots[rc.adapterIDs[tr.Adapter]]
		}
		hashes, scratch = appendEngineHashes(hashes[:0], scratch, toks, B, root)
		input := len(toks)
		if input+tr.OutputTokens > m.MaxContextTokens {
			continue // the replay's bucket refuses it
		}
		c.Requests++
		k := 0
		for k < len(hashes) {
			if _, ok := seen[hashes[k]]; !ok {
				break
			}
			k++
		}
		for _, h := range hashes {
			seen[h] = struct{}{}
		}
		cached := 0
		if input > 0 {
			cached = min(k, (input-1)/B) * B
		}
		c.PrefillNoCache += m.prefillSeconds(input, 0)
		c.PrefillInfiniteCache += m.prefillSeconds(input-cached, cached)
		// The prefill produces the first token; each of the other output−1 tokens is a decode
		// step over the prompt and the g tokens generated before it, g = 1 … output−1.
		out := float64(max(tr.OutputTokens, 1))
		c.DecodeKV += ((out-1)*float64(input) + (out-1)*out/2) * m.kvTokenSeconds()
		steps += out - 1
	}
	c.DecodeBase = steps / float64(m.MaxRunningRequests) * m.DecodeStepBase.Seconds()
	if n := len(rc.requests); n > 0 {
		c.ArrivalSpan = (rc.requests[n-1].Arrival - rc.requests[0].Arrival).Seconds()
	}
	speed := func(engines int, work float64) float64 {
		if work == 0 || c.ArrivalSpan == 0 {
			return math.Inf(1)
		}
		return float64(engines) * c.ArrivalSpan / work
	}
	decode := c.DecodeKV + c.DecodeBase
	if rc.Fleet.IsPD() {
		c.Speed = min(speed(rc.Fleet.Prefill, c.PrefillInfiniteCache), speed(rc.Fleet.Decode, decode))
	} else {
		c.Speed = speed(rc.Fleet.Plain, c.PrefillInfiniteCache+decode)
	}
	return c, nil
}
