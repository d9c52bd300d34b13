package sim

import (
	"cmp"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strconv"
)

// WorkloadLoRA names LoRA.
const WorkloadLoRA = "lora"

// Shape of the lora workload.
const (
	// LoRASystemPrompts is the number of system prompts each adapter (and the base model) has; a
	// request opens with one of its adapter's, chosen uniformly.
	LoRASystemPrompts = 8
	// MaxLoRAAdapters bounds LoRA.Adapters.
	MaxLoRAAdapters = 10_000
)

// Defaults of LoRA. ParseWorkload also defaults zipf; in the struct its zero value means uniform
// popularity (see LoRA).
const (
	// DefaultLoRAAdapters is LoRA.Adapters' default.
	DefaultLoRAAdapters = 64
	// DefaultLoRAZipf is the Zipf exponent ParseWorkload defaults to: adapter k (0-based) is asked
	// for in proportion to 1 ÷ (k+1), so with 64 adapters the most popular takes 21 % of the
	// requests and the top four 44 %.
	DefaultLoRAZipf = 1.0
	// DefaultLoRARequests is LoRA.Requests' default: about two and a half minutes at
	// DefaultLoRARate.
	DefaultLoRARequests = 10_000
	// DefaultLoRARate is LoRA.Rate's default, in requests per second: a load that the replay's
	// default fleet (16 engines of DefaultEngineModel with DefaultMaxLoRAs slots) serves with
	// short queues when each engine serves few adapters, and where requests routed without
	// regard to their adapter wait for slots (docs/performance.md "LoRA adapters").
	DefaultLoRARate = 70.0
)

// LoRA is a workload of requests spread over LoRA adapters of one base model: Requests requests
// arriving as a Poisson process of Rate requests per second, each for the base model with
// probability Base, otherwise for one of Adapters adapters named "lora-0" … "lora-<n−1>", adapter
// k (0-based) with probability proportional to 1 ÷ (k+1)^Zipf, so "lora-0" is the most popular.
//
// A request has the shape of a chat's first turn (see Chats), as in Tenants: one of its adapter's
// LoRASystemPrompts system prompts (the base model has its own), each of uniform length in
// [0, ChatSystemPromptMaxTokens], followed by a new user message, and a reply as output; messages
// and replies are uniform in [ChatMessageMinTokens, ChatMessageMaxTokens] tokens. So an adapter's
// requests share its system prompts, token for token, and no adapter shares a prompt with another
// (nor could it share a cached block: an adapter's KV is its own).
//
// Request.Adapter is set ("" for the base model); Session and Tenant are "". Unlike the other
// workloads, the zero value of Zipf means uniform popularity and of Base no base-model request,
// rather than a default; every other zero field means its default.
type LoRA struct {
	// Adapters is the number of adapters. 0 means DefaultLoRAAdapters; at most MaxLoRAAdapters.
	Adapters int
	// Zipf is the exponent of the adapters' popularity: 0 makes them equally popular. Finite
	// and >= 0.
	Zipf float64
	// Base is the share of requests for the base model, in [0, 1].
	Base float64
	// Requests is the number of requests. 0 means DefaultLoRARequests; at most
	// MaxWorkloadRequests.
	Requests int
	// Rate is the requests per second (a Poisson process). 0 means DefaultLoRARate; must be
	// finite and > 0.
	Rate float64
}

// loraSalt salts the lora workload's random source ("lora").
const loraSalt = 0x6c6f7261

func (p *specParser) lora() (Workload, error) {
	w := LoRA{Zipf: DefaultLoRAZipf}
	err := p.each([]string{"adapters", "zipf", "base", "requests", "rate"}, func(k, v string) error {
		var err error
		switch k {
		case "adapters":
			w.Adapters, err = p.count(k, v)
		case "zipf":
			w.Zipf, err = p.multiple(k, v)
		case "base":
			if w.Base, err = p.multiple(k, v); err == nil && w.Base > 1 {
				return p.fail("%s=%q: want a share in [0, 1]", k, v)
			}
		case "requests":
			w.Requests, err = p.count(k, v)
		case "rate":
			w.Rate, err = p.rate(k, v)
		}
		return err
	})
	if err != nil {
		return nil, err
	}
	w = w.filled()
	if err := w.validate(); err != nil {
		return nil, p.fail("%v", err)
	}
	return w, nil
}

// filled returns w with zero fields replaced by their defaults (Zipf and Base stay).
func (w LoRA) filled() LoRA {
	w.Adapters = cmp.Or(w.Adapters, DefaultLoRAAdapters)
	w.Requests = cmp.Or(w.Requests, DefaultLoRARequests)
	w.Rate = cmp.Or(w.Rate, DefaultLoRARate)
	return w
}

// validate checks a filled w; the error names the field and the rule.
func (w LoRA) validate() error {
	switch {
	case w.Adapters < 1 || w.Adapters > MaxLoRAAdapters:
		return fmt.Errorf("adapters %d: must be in [1, %d]", w.Adapters, MaxLoRAAdapters)
	case !(w.Zipf >= 0) || math.IsInf(w.Zipf, 1):
		return fmt.Errorf("zipf %v: must be finite and >= 0", w.Zipf)
	case !(w.Base >= 0 && w.Base <= 1):
		return fmt.Errorf("base %v: must be in [0, 1]", w.Base)
	case w.Requests < 1 || w.Requests > MaxWorkloadRequests:
		return fmt.Errorf("requests %d: must be in [1, %d]", w.Requests, MaxWorkloadRequests)
	case !(w.Rate > 0) || math.IsInf(w.Rate, 1):
		return fmt.Errorf("rate %v: must be finite and > 0", w.Rate)
	}
	return nil
}

// String returns the canonical spec, for example
// "lora:adapters=64,zipf=1,base=0,requests=10000,rate=70".
func (w LoRA) String() string {
	w = w.filled()
	f := func(x float64) string { return strconv.FormatFloat(x, 'g', -1, 64) }
	return fmt.Sprintf("%s:adapters=%d,zipf=%s,base=%s,requests=%d,rate=%s", WorkloadLoRA,
		w.Adapters, f(w.Zipf), f(w.Base), w.Requests, f(w.Rate))
}

// AdapterName returns the name of adapter k (0-based popularity rank): "lora-<k>".
func AdapterName(k int) string { return "lora-" + strconv.Itoa(k) }

// Generate implements Workload (see LoRA).
func (w LoRA) Generate(seed uint64) (*Trace, error) {
	w = w.filled()
	if err := w.validate(); err != nil {
		return nil, &configError{msg: "sim: LoRA: " + err.Error(), errs: []error{ErrBadWorkload}}
	}
	rng := rand.New(rand.NewPCG(seed, loraSalt))
	// cdf[k] is the probability of adapters 0..k.
	cdf := make([]float64, w.Adapters)
	sum := 0.0
	for k := range cdf {
		sum += math.Pow(float64(k+1), -w.Zipf)
		cdf[k] = sum
	}
	for k := range cdf {
		cdf[k] /= sum
	}
	cdf[len(cdf)-1] = 1
	names := make([]string, w.Adapters)
	for k := range names {
		names[k] = AdapterName(k)
	}
	// prompts[k] are adapter k's system prompts, prompts[Adapters] the base model's.
	prompts := make([][LoRASystemPrompts]Segment, w.Adapters+1)
	for k := range prompts {
		for j := range prompts[k] {
			prompts[k][j] = Segment{Stream: rng.Uint64(), Tokens: rng.IntN(ChatSystemPromptMaxTokens + 1)}
		}
	}
	message := func() int { return ChatMessageMinTokens + rng.IntN(ChatMessageMaxTokens-ChatMessageMinTokens+1) }
	reqs := make([]Request, 0, w.Requests)
	segs := make([]Segment, 0, 2*w.Requests)
	at := 0.0
	for range w.Requests {
		at += rng.ExpFloat64() / w.Rate
		if at > MaxArrival.Seconds() {
			return nil, arrivalError("LoRA", w.String(), at)
		}
		k, adapter := w.Adapters, "" // the base model
		if rng.Float64() >= w.Base {
			k, _ = slices.BinarySearch(cdf, rng.Float64())
			k = min(k, w.Adapters-1)
			adapter = names[k]
		}
		system := prompts[k][rng.IntN(LoRASystemPrompts)]
		user := Segment{Stream: rng.Uint64(), Tokens: message()}
		n := len(segs)
		if system.Tokens > 0 {
			segs = append(segs, system)
		}
		segs = append(segs, user)
		reqs = append(reqs, Request{Arrival: secondsToDuration(at), InputTokens: system.Tokens + user.Tokens,
			OutputTokens: message(), Segments: segs[n:len(segs):len(segs)], Adapter: adapter})
	}
	return generated(w, seed, reqs), nil
}
