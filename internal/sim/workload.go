package sim

import (
	"cmp"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/enginepick/enginepick/state"
)

// Workload generates a synthetic request trace (docs/traces.md "Generated workloads"). Its
// requests are of the type the readers return, with Segments instead of HashIDs, so prompts share
// prefixes token for token, and Trace.InfiniteCache counts that reuse exactly.
type Workload interface {
	// Generate returns the trace for seed: the same workload and seed give an identical trace,
	// different seeds unrelated ones. Its Name is String() followed by " (seed N)", its Format "".
	// Errors: a configuration error wrapping ErrBadWorkload (and state.ErrInvalidConfiguration)
	// for a field out of range, also wrapping ErrOutOfRange when an arrival would pass
	// MaxArrival. The Trace is nil on error.
	Generate(seed uint64) (*Trace, error)
	// String returns the workload's canonical spec, every parameter spelled out, in the syntax
	// ParseWorkload reads: ParseWorkload(w.String()) returns w with its defaults filled in.
	String() string
}

// The workload names ParseWorkload knows.
const (
	// WorkloadChats names Chats.
	WorkloadChats = "chats"
	// WorkloadPrefixGroups names PrefixGroups.
	WorkloadPrefixGroups = "prefix-groups"
)

// WorkloadBlockTokens is the KV block size, in tokens, to replay a generated workload with (vLLM's
// default page size): its prompts share prefixes of any length, which DefaultBlockTokens' 512-token
// blocks, sized for the Mooncake traces, would round down by up to 511 tokens.
const WorkloadBlockTokens = 16

// MaxWorkloadRequests bounds the requests a workload generates, and PrefixGroups' distinct prompts.
const MaxWorkloadRequests = 1_000_000

// ErrBadWorkload reports a workload spec that ParseWorkload cannot read, or a Chats,
// PrefixGroups, Tenants or LoRA field out of range. It wraps state.ErrInvalidConfiguration.
var ErrBadWorkload = fmt.Errorf("sim: bad workload: %w", state.ErrInvalidConfiguration)

// Sizes of a generated chat, in tokens: each conversation's system prompt is uniform in
// [0, ChatSystemPromptMaxTokens], each user message and each reply uniform in
// [ChatMessageMinTokens, ChatMessageMaxTokens].
const (
	ChatSystemPromptMaxTokens = 1100
	ChatMessageMinTokens      = 50
	ChatMessageMaxTokens      = 300
)

// Defaults of Chats.
const (
	// DefaultChatConversations is Chats.Conversations' default: about two minutes of conversation
	// starts at DefaultChatRate.
	DefaultChatConversations = 5000
	// DefaultChatTurns is Chats.Turns' default.
	DefaultChatTurns = 5
	// DefaultChatRate is Chats.Rate's default, in conversations per second: with DefaultChatTurns,
	// about 225 requests per second once conversations overlap, which keeps the replay's default
	// fleet (16 engines of DefaultEngineModel) about half the time prefilling under round-robin.
	DefaultChatRate = 45.0
	// DefaultChatThink is Chats.Think's default: the mean pause of a user between a reply and the
	// next message.
	DefaultChatThink = 5 * time.Second
	// MaxChatTurns bounds Chats.Turns, so that the longest prompt (about 600 tokens a turn) stays
	// far below MaxTraceTokens.
	MaxChatTurns = 1000
)

// Chats is a workload of short multi-turn chats. Conversations start as a Poisson process of Rate
// conversations per second; each has Turns turns. A conversation opens with its own system prompt
// of uniform length in [0, ChatSystemPromptMaxTokens] (SharedSystemPrompt: one system prompt, of
// one such length, opens every conversation). Turn k's prompt is the whole conversation so far
// (system prompt, then every earlier user message and reply) followed by a new user message; its
// output is the reply. Messages and replies are uniform in [ChatMessageMinTokens,
// ChatMessageMaxTokens] tokens. So turn k's prompt starts, token for token, with turn k−1's prompt
// and reply: the reuse a prefix cache can get, and a cache that keeps only prompts (the simulated
// engines do not cache generated tokens) can hit turn k−1's prompt.
//
// Think time: the replay is open-loop, every arrival fixed before it starts (there is no
// closed-loop session driver), so turn k+1 arrives at turn k's arrival plus an estimate of turn
// k's service plus an exponential think time of mean Think. The estimate is what an idle engine of
// DefaultEngineModel takes: the prefill of the tokens turn k−1's prompt does not cover, and one
// decode step alone per output token after the first. Under load real service takes longer, so a
// turn can arrive before the previous reply has ended; its prompt's prefix is still cached, since
// an engine caches a prompt once it has prefilled it. Config.Speed divides think times with every
// other arrival offset.
//
// Each request's Session is "conv-<n>", n the conversation's 0-based start order; requests are
// in arrival order. The zero value of a field means its default.
type Chats struct {
	// Conversations is the number of conversations. 0 means DefaultChatConversations; at most
	// MaxWorkloadRequests ÷ Turns.
	Conversations int
	// Turns is the number of turns of every conversation. 0 means DefaultChatTurns; at most
	// MaxChatTurns.
	Turns int
	// Rate is the conversations started per second (a Poisson process). 0 means DefaultChatRate;
	// must be finite and > 0.
	Rate float64
	// Think is the mean think time (exponentially distributed). 0 means DefaultChatThink; must be
	// > 0 and at most MaxArrival.
	Think time.Duration
	// SharedSystemPrompt gives every conversation the same system prompt instead of its own.
	SharedSystemPrompt bool
}

// Defaults of PrefixGroups: the "shared_prefix" workload of llm-d's precise prefix-cache-aware
// routing guide, llm-d/llm-d `guides/precise-prefix-cache-aware/benchmark-templates/guide.yaml`
// (an inference-perf configuration: num_groups 150, num_prompts_per_group 5, system_prompt_len
// 6000, question_len 1200, output_len 1000, Poisson arrivals).
const (
	DefaultPrefixGroups          = 150
	DefaultPrefixPromptsPerGroup = 5
	DefaultPrefixTokens          = 6000
	DefaultPrefixQuestionTokens  = 1200
	DefaultPrefixOutputTokens    = 1000
	// DefaultPrefixRequests is PrefixGroups.Requests' default: four passes over the 750 prompts.
	DefaultPrefixRequests = 3000
	// DefaultPrefixRate is PrefixGroups.Rate's default, in requests per second: enough to keep the
	// replay's default fleet (16 engines of DefaultEngineModel) decoding all the time under
	// round-robin, with requests holding KV for 1,000 output tokens each.
	DefaultPrefixRate = 20.0
)

// PrefixGroups is a workload of groups of requests sharing a long prefix, in the shape of
// inference-perf's shared-prefix generator (kubernetes-sigs/inference-perf
// `inference_perf/datagen/shared_prefix_datagen.py`), with the defaults of the llm-d benchmark
// that uses it (see DefaultPrefixGroups). Each of Groups groups has a shared prefix (a document or
// system prompt) of PrefixTokens tokens and PromptsPerGroup questions of QuestionTokens tokens; a
// prompt is its group's prefix followed by one of the group's questions, and asks for OutputTokens
// tokens. As in inference-perf, the Groups × PromptsPerGroup prompts are shuffled once and
// request i sends prompt i mod (Groups × PromptsPerGroup), so after one pass prompts repeat whole.
// Requests arrive as a Poisson process of Rate requests per second. Session is "": the generator
// names no session. The zero value of a field means its default.
type PrefixGroups struct {
	// Groups is the number of distinct prefixes. 0 means DefaultPrefixGroups.
	Groups int
	// PromptsPerGroup is the number of distinct questions per prefix. 0 means
	// DefaultPrefixPromptsPerGroup; Groups × PromptsPerGroup is at most MaxWorkloadRequests.
	PromptsPerGroup int
	// PrefixTokens is the length of each shared prefix, in tokens. 0 means DefaultPrefixTokens.
	PrefixTokens int
	// QuestionTokens is the length of each question, in tokens. 0 means
	// DefaultPrefixQuestionTokens. PrefixTokens + QuestionTokens is at most MaxTraceTokens.
	QuestionTokens int
	// OutputTokens is every request's output length, in tokens. 0 means
	// DefaultPrefixOutputTokens; at most MaxTraceTokens.
	OutputTokens int
	// Requests is the number of requests. 0 means DefaultPrefixRequests; at most
	// MaxWorkloadRequests.
	Requests int
	// Rate is the requests per second (a Poisson process). 0 means DefaultPrefixRate; must be
	// finite and > 0.
	Rate float64
}

// Salts of the generators' random sources, so that one seed drives unrelated streams.
const (
	chatsSalt        = 0x6368617473   // "chats"
	prefixGroupsSalt = 0x707265666978 // "prefix"
)

// ParseWorkload reads a workload spec: a name, optionally followed by a colon and comma-separated
// key=value parameters, for example "chats" or "prefix-groups:groups=50,rate=8". Omitted
// parameters take their defaults.
//
//   - chats (Chats): conversations, turns (decimal integers), rate (conversations per second,
//     a positive number), think (a Go duration such as 5s), shared-system (true or false);
//   - prefix-groups (PrefixGroups): groups, prompts (per group), prefix, question, output (in
//     tokens), requests (decimal integers), rate (requests per second);
//   - tenants (Tenants): tenants (a decimal integer), rate (each tenant's requests per second),
//     heavy and critical (multiples of rate, numbers >= 0, 0 for none; by default
//     DefaultTenantHeavy and DefaultTenantCritical), duration (a Go duration such as 60s);
//   - lora (LoRA): adapters, requests (decimal integers), zipf (the popularity exponent, a number
//     >= 0, by default DefaultLoRAZipf), base (the base model's share, in [0, 1]), rate (requests
//     per second).
//
// A number must be written without sign or spaces. Errors: a configuration error wrapping
// ErrBadWorkload (and state.ErrInvalidConfiguration) that names the spec, the key and the rule:
// an unknown name or key, a key given twice, a parameter without "=", a value that does not parse
// or is out of the field's range. The Workload is nil on error.
func ParseWorkload(spec string) (Workload, error) {
	name, params, hasParams := strings.Cut(spec, ":")
	p := &specParser{spec: spec, seen: map[string]bool{}}
	if hasParams {
		for _, kv := range strings.Split(params, ",") {
			k, v, ok := strings.Cut(kv, "=")
			if !ok {
				return nil, p.fail("parameter %q is not key=value", kv)
			}
			p.pairs = append(p.pairs, [2]string{k, v})
		}
	}
	var w Workload
	var err error
	switch name {
	case WorkloadChats:
		w, err = p.chats()
	case WorkloadPrefixGroups:
		w, err = p.prefixGroups()
	case WorkloadTenants:
		w, err = p.tenants()
	case WorkloadLoRA:
		w, err = p.lora()
	default:
		return nil, p.fail("unknown workload %q (known: %s, %s, %s, %s)", name, WorkloadChats, WorkloadPrefixGroups, WorkloadTenants, WorkloadLoRA)
	}
	if err != nil {
		return nil, err
	}
	return w, nil
}

// specParser reads the key=value pairs of one spec.
type specParser struct {
	spec  string
	pairs [][2]string
	seen  map[string]bool
}

func (p *specParser) fail(format string, args ...any) error {
	return &configError{msg: fmt.Sprintf("sim: workload %q: ", p.spec) + fmt.Sprintf(format, args...),
		errs: []error{ErrBadWorkload}}
}

// each calls set for every pair, in order, after checking that its key is one of known and new.
func (p *specParser) each(known []string, set func(k, v string) error) error {
	for _, kv := range p.pairs {
		k := kv[0]
		if !slices.Contains(known, k) {
			return p.fail("unknown parameter %q (known: %s)", k, strings.Join(known, ", "))
		}
		if p.seen[k] {
			return p.fail("parameter %q given twice", k)
		}
		p.seen[k] = true
		if err := set(k, kv[1]); err != nil {
			return err
		}
	}
	return nil
}

// count parses a positive decimal integer of at most 9 digits (so it fits any int). Zero is
// refused: it would mean the default.
func (p *specParser) count(k, v string) (int, error) {
	if v == "" || len(v) > 9 || strings.TrimLeft(v, "0123456789") != "" {
		return 0, p.fail("%s=%q: want a decimal integer of at most 9 digits", k, v)
	}
	n, _ := strconv.Atoi(v)
	if n == 0 {
		return 0, p.fail("%s=%q: must be >= 1 (omit it for the default)", k, v)
	}
	return n, nil
}

// multiple parses a non-negative finite number.
func (p *specParser) multiple(k, v string) (float64, error) {
	f, err := strconv.ParseFloat(v, 64)
	if err != nil || !(f >= 0) || math.IsInf(f, 1) {
		return 0, p.fail("%s=%q: want a finite number >= 0", k, v)
	}
	return f, nil
}

// rate parses a positive finite number.
func (p *specParser) rate(k, v string) (float64, error) {
	f, err := strconv.ParseFloat(v, 64)
	if err != nil || !(f > 0) || math.IsInf(f, 1) {
		return 0, p.fail("%s=%q: want a positive finite number", k, v)
	}
	return f, nil
}

func (p *specParser) chats() (Workload, error) {
	var c Chats
	err := p.each([]string{"conversations", "turns", "rate", "think", "shared-system"}, func(k, v string) error {
		var err error
		switch k {
		case "conversations":
			c.Conversations, err = p.count(k, v)
		case "turns":
			c.Turns, err = p.count(k, v)
		case "rate":
			c.Rate, err = p.rate(k, v)
		case "think":
			c.Think, err = time.ParseDuration(v)
			if err != nil || c.Think <= 0 {
				return p.fail("%s=%q: want a positive duration such as 5s", k, v)
			}
		case "shared-system":
			c.SharedSystemPrompt, err = strconv.ParseBool(v)
			if err != nil {
				return p.fail("%s=%q: want true or false", k, v)
			}
		}
		return err
	})
	if err != nil {
		return nil, err
	}
	c = c.filled()
	if err := c.validate(); err != nil {
		return nil, p.fail("%v", err)
	}
	return c, nil
}

func (p *specParser) prefixGroups() (Workload, error) {
	var g PrefixGroups
	fields := map[string]*int{"groups": &g.Groups, "prompts": &g.PromptsPerGroup, "prefix": &g.PrefixTokens,
		"question": &g.QuestionTokens, "output": &g.OutputTokens, "requests": &g.Requests}
	err := p.each([]string{"groups", "prompts", "prefix", "question", "output", "requests", "rate"}, func(k, v string) error {
		var err error
		if k == "rate" {
			g.Rate, err = p.rate(k, v)
			return err
		}
		*fields[k], err = p.count(k, v)
		return err
	})
	if err != nil {
		return nil, err
	}
	g = g.filled()
	if err := g.validate(); err != nil {
		return nil, p.fail("%v", err)
	}
	return g, nil
}

func (p *specParser) tenants() (Workload, error) {
	w := Tenants{Heavy: DefaultTenantHeavy, Critical: DefaultTenantCritical}
	err := p.each([]string{"tenants", "rate", "heavy", "critical", "duration"}, func(k, v string) error {
		var err error
		switch k {
		case "tenants":
			w.Tenants, err = p.count(k, v)
		case "rate":
			w.Rate, err = p.rate(k, v)
		case "heavy":
			w.Heavy, err = p.multiple(k, v)
		case "critical":
			w.Critical, err = p.multiple(k, v)
		case "duration":
			w.Duration, err = time.ParseDuration(v)
			if err != nil || w.Duration <= 0 {
				return p.fail("%s=%q: want a positive duration such as 60s", k, v)
			}
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

// filled returns c with zero fields replaced by their defaults.
func (c Chats) filled() Chats {
	c.Conversations = cmp.Or(c.Conversations, DefaultChatConversations)
	c.Turns = cmp.Or(c.Turns, DefaultChatTurns)
	c.Rate = cmp.Or(c.Rate, DefaultChatRate)
	c.Think = cmp.Or(c.Think, DefaultChatThink)
	return c
}

// validate checks a filled c; the error names the field and the rule.
func (c Chats) validate() error {
	switch {
	case c.Turns < 1 || c.Turns > MaxChatTurns:
		return fmt.Errorf("turns %d: must be in [1, %d]", c.Turns, MaxChatTurns)
	case c.Conversations < 1 || c.Conversations > MaxWorkloadRequests/c.Turns:
		return fmt.Errorf("conversations %d: must be in [1, %d] with %d turns (%d requests at most)",
			c.Conversations, MaxWorkloadRequests/c.Turns, c.Turns, MaxWorkloadRequests)
	case !(c.Rate > 0) || math.IsInf(c.Rate, 1):
		return fmt.Errorf("rate %v: must be finite and > 0", c.Rate)
	case c.Think <= 0 || c.Think > MaxArrival:
		return fmt.Errorf("think %v: must be in (0, %v]", c.Think, MaxArrival)
	}
	return nil
}

// String returns the canonical spec, for example
// "chats:conversations=5000,turns=5,rate=45,think=5s,shared-system=false".
func (c Chats) String() string {
	c = c.filled()
	return fmt.Sprintf("%s:conversations=%d,turns=%d,rate=%s,think=%v,shared-system=%t", WorkloadChats,
		c.Conversations, c.Turns, strconv.FormatFloat(c.Rate, 'g', -1, 64), c.Think, c.SharedSystemPrompt)
}

// Generate implements Workload (see Chats).
func (c Chats) Generate(seed uint64) (*Trace, error) {
	c = c.filled()
	if err := c.validate(); err != nil {
		return nil, &configError{msg: "sim: Chats: " + err.Error(), errs: []error{ErrBadWorkload}}
	}
	rng := rand.New(rand.NewPCG(seed, chatsSalt))
	m := DefaultEngineModel()
	message := func() int { return ChatMessageMinTokens + rng.IntN(ChatMessageMaxTokens-ChatMessageMinTokens+1) }
	var shared Segment // the shared system prompt; Tokens 0 when none
	if c.SharedSystemPrompt {
		shared = Segment{Stream: rng.Uint64(), Tokens: rng.IntN(ChatSystemPromptMaxTokens + 1)}
	}
	n := c.Conversations * c.Turns
	reqs := make([]Request, 0, n)
	segs := make([]Segment, 0, 2*n)
	start := 0.0 // seconds
	for conv := range c.Conversations {
		start += rng.ExpFloat64() / c.Rate
		stream := rng.Uint64()
		context := 0 // tokens of the conversation's own stream so far
		if !c.SharedSystemPrompt {
			context = rng.IntN(ChatSystemPromptMaxTokens + 1)
		}
		session := "conv-" + strconv.Itoa(conv)
		at, cached := start, shared.Tokens
		for range c.Turns {
			user, reply := message(), message()
			k := len(segs)
			if shared.Tokens > 0 {
				segs = append(segs, shared)
			}
			segs = append(segs, Segment{Stream: stream, Tokens: context + user})
			input := shared.Tokens + context + user
			if at > MaxArrival.Seconds() {
				return nil, arrivalError("Chats", c.String(), at)
			}
			reqs = append(reqs, Request{Arrival: secondsToDuration(at), InputTokens: input, OutputTokens: reply,
				Segments: segs[k:len(segs):len(segs)], Session: session})
			at += idleServiceSeconds(&m, input, cached, reply) + rng.ExpFloat64()*c.Think.Seconds()
			context += user + reply
			cached = input
		}
	}
	return generated(c, seed, reqs), nil
}

// idleServiceSeconds returns the time an idle engine of model m takes to serve a prompt of input
// tokens, the first cached of them already cached, with output tokens: the prefill of the rest,
// then output−1 decode steps with the request alone in the batch.
func idleServiceSeconds(m *EngineModel, input, cached, output int) float64 {
	s := m.prefillSeconds(input-cached, cached)
	if output > 1 {
		steps := float64(output - 1)
		s += steps*m.DecodeStepBase.Seconds() + (steps*float64(input)+steps*float64(output)/2)*m.kvTokenSeconds()
	}
	return s
}

// filled returns g with zero fields replaced by their defaults.
func (g PrefixGroups) filled() PrefixGroups {
	g.Groups = cmp.Or(g.Groups, DefaultPrefixGroups)
	g.PromptsPerGroup = cmp.Or(g.PromptsPerGroup, DefaultPrefixPromptsPerGroup)
	g.PrefixTokens = cmp.Or(g.PrefixTokens, DefaultPrefixTokens)
	g.QuestionTokens = cmp.Or(g.QuestionTokens, DefaultPrefixQuestionTokens)
	g.OutputTokens = cmp.Or(g.OutputTokens, DefaultPrefixOutputTokens)
	g.Requests = cmp.Or(g.Requests, DefaultPrefixRequests)
	g.Rate = cmp.Or(g.Rate, DefaultPrefixRate)
	return g
}

// validate checks a filled g; the error names the field and the rule.
func (g PrefixGroups) validate() error {
	switch {
	case g.Groups < 1 || g.Groups > MaxWorkloadRequests:
		return fmt.Errorf("groups %d: must be in [1, %d]", g.Groups, MaxWorkloadRequests)
	case g.PromptsPerGroup < 1 || g.PromptsPerGroup > MaxWorkloadRequests/g.Groups:
		return fmt.Errorf("prompts %d: must be in [1, %d] with %d groups (%d prompts at most)",
			g.PromptsPerGroup, MaxWorkloadRequests/g.Groups, g.Groups, MaxWorkloadRequests)
	case g.PrefixTokens < 0 || g.QuestionTokens < 0 || g.PrefixTokens > MaxTraceTokens-max(g.QuestionTokens, 0):
		return fmt.Errorf("prefix %d + question %d tokens: each must be >= 0 and the sum at most %d",
			g.PrefixTokens, g.QuestionTokens, MaxTraceTokens)
	case g.OutputTokens < 0 || g.OutputTokens > MaxTraceTokens:
		return fmt.Errorf("output %d: must be in [0, %d]", g.OutputTokens, MaxTraceTokens)
	case g.Requests < 1 || g.Requests > MaxWorkloadRequests:
		return fmt.Errorf("requests %d: must be in [1, %d]", g.Requests, MaxWorkloadRequests)
	case !(g.Rate > 0) || math.IsInf(g.Rate, 1):
		return fmt.Errorf("rate %v: must be finite and > 0", g.Rate)
	}
	return nil
}

// String returns the canonical spec, for example
// "prefix-groups:groups=150,prompts=5,prefix=6000,question=1200,output=1000,requests=3000,rate=20".
func (g PrefixGroups) String() string {
	g = g.filled()
	return fmt.Sprintf("%s:groups=%d,prompts=%d,prefix=%d,question=%d,output=%d,requests=%d,rate=%s", WorkloadPrefixGroups,
		g.Groups, g.PromptsPerGroup, g.PrefixTokens, g.QuestionTokens, g.OutputTokens, g.Requests,
		strconv.FormatFloat(g.Rate, 'g', -1, 64))
}

// Generate implements Workload (see PrefixGroups).
func (g PrefixGroups) Generate(seed uint64) (*Trace, error) {
	g = g.filled()
	if err := g.validate(); err != nil {
		return nil, &configError{msg: "sim: PrefixGroups: " + err.Error(), errs: []error{ErrBadWorkload}}
	}
	rng := rand.New(rand.NewPCG(seed, prefixGroupsSalt))
	n := g.Groups * g.PromptsPerGroup
	arena := make([]Segment, 0, 2*n)
	prompts := make([][]Segment, 0, n)
	for range g.Groups {
		prefix := Segment{Stream: rng.Uint64(), Tokens: g.PrefixTokens}
		for range g.PromptsPerGroup {
			k := len(arena)
			if prefix.Tokens > 0 {
				arena = append(arena, prefix)
			}
			if question := (Segment{Stream: rng.Uint64(), Tokens: g.QuestionTokens}); question.Tokens > 0 {
				arena = append(arena, question)
			}
			prompts = append(prompts, arena[k:len(arena):len(arena)])
		}
	}
	rng.Shuffle(len(prompts), func(i, j int) { prompts[i], prompts[j] = prompts[j], prompts[i] })
	reqs := make([]Request, 0, g.Requests)
	at := 0.0
	for i := range g.Requests {
		at += rng.ExpFloat64() / g.Rate
		if at > MaxArrival.Seconds() {
			return nil, arrivalError("PrefixGroups", g.String(), at)
		}
		reqs = append(reqs, Request{Arrival: secondsToDuration(at), InputTokens: g.PrefixTokens + g.QuestionTokens,
			OutputTokens: g.OutputTokens, Segments: prompts[i%n]})
	}
	return generated(g, seed, reqs), nil
}

// arrivalError reports a generated arrival past MaxArrival.
func arrivalError(kind, spec string, at float64) error {
	return &configError{msg: fmt.Sprintf("sim: %s %s: an arrival at %.0f s passes MaxArrival (%v): raise the rate or lower the count",
		kind, spec, at, MaxArrival), errs: []error{ErrBadWorkload, ErrOutOfRange}}
}

// generated returns the trace of w's requests, sorted by arrival (ties in generation order) and
// numbered.
func generated(w Workload, seed uint64, reqs []Request) *Trace {
	slices.SortStableFunc(reqs, func(a, b Request) int { return cmp.Compare(a.Arrival, b.Arrival) })
	for i := range reqs {
		reqs[i].Index = i
	}
	return &Trace{Name: fmt.Sprintf("%s (seed %d)", w, seed), Requests: reqs}
}
