package gw

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/enginepick/enginepick/state"
)

// Kind is the inference server software behind an engine; it decides how a DP rank and the PD
// bootstrap fields are sent.
type Kind uint8

// The engine kinds.
const (
	// KindVLLM is a vLLM OpenAI-compatible server.
	KindVLLM Kind = iota + 1
	// KindSGLang is an SGLang server.
	KindSGLang
)

// ParseKind parses "vllm" or "sglang".
func ParseKind(s string) (Kind, error) {
	switch s {
	case "vllm":
		return KindVLLM, nil
	case "sglang":
		return KindSGLang, nil
	}
	return 0, fmt.Errorf("gw: engine kind %q: want vllm or sglang: %w", s, state.ErrInvalidConfiguration)
}

// String returns "vllm" or "sglang".
func (k Kind) String() string {
	switch k {
	case KindVLLM:
		return "vllm"
	case KindSGLang:
		return "sglang"
	}
	return fmt.Sprintf("kind(%d)", uint8(k))
}

// EngineConfig describes one engine.
type EngineConfig struct {
	// URL is the engine's base URL ("http://10.0.0.7:8000"); it is also the engine's ID, without a
	// trailing slash. Required.
	URL string
	// Model is the model it serves. Required.
	Model state.ModelID
	// Kind is the server software. Required.
	Kind Kind
	// Stage is its role: plain, prefill or decode.
	Stage state.Stage
	// DPRanks is its data-parallel rank count; 0 means 1, or len(RankURLs).
	DPRanks int
	// DPRankStart is the global DP rank of its rank 0, for an engine that serves a slice of a
	// larger DP group: a request picked for rank r carries the rank DPRankStart + r. 0 means the
	// engine's ranks are the global ones.
	DPRankStart int
	// RankURLs, when set, are the base URLs of the servers that each serve one rank alone, in rank
	// order (one per rank): a request picked for rank r is sent to RankURLs[r] and carries no
	// rank, that server being the rank. Nil means every request goes to URL.
	RankURLs []string
	// BootstrapPort is a prefill engine's PD bootstrap port (SGLang --disaggregation-bootstrap-port);
	// 0 means none is configured and bootstrap_port is sent as null.
	BootstrapPort int
	// PDCompatibility is the PD compatibility label (docs/design.md §3); "" is unlabelled.
	PDCompatibility string
}

// BreakerConfig configures every engine's circuit breaker.
//
// Nothing a client sends may change an engine's health, so the breaker counts only what the
// engine alone causes (Outcome): no connection (refused, unreachable) opens it at once; a timeout
// waiting for the answer (a prefill leg past its bound) and a failed health probe count toward
// the streak. A failure the request could have caused as well, a 5xx answer, a connection closed
// or reset without an answer after the whole request was sent (a body over the engine's limit
// that socket buffers took whole ends so), an answer cut off, is OutcomeAmbiguous: it counts only
// through the health probe it triggers (Prober.Suspect); so does a connection closed before the
// whole body was written (a body over the engine's limit if the probe answers 200,
// ErrBodyRefused, or the engine dying). What the request causes never counts: a 4xx answer (400,
// 413, 422, …), the client leaving.
type BreakerConfig struct {
	// FailureStreak is how many consecutive OutcomeServerError outcomes open the breaker; 0 means
	// 3.
	FailureStreak int
}

// Engine is one engine of the registry: a state.Engine and state.PDCompatible whose health is its
// circuit breaker. Safe for concurrent use.
type Engine struct {
	cfg   EngineConfig
	id    state.EngineID
	base  *url.URL
	ranks []*url.URL // parsed RankURLs

	threshold int
	mu        sync.Mutex // serializes breaker transitions
	open      atomic.Bool
	streak    int
	opens     atomic.Uint64

	probeMu      sync.Mutex
	probing      *Probe // the probe Prober.Suspect started, while it is in flight
	probesOK     atomic.Uint64
	probesFailed atomic.Uint64
}

var (
	_ state.Engine       = (*Engine)(nil)
	_ state.PDCompatible = (*Engine)(nil)
)

// ID implements state.Engine: the base URL.
func (e *Engine) ID() state.EngineID { return e.id }

// Model implements state.Engine.
func (e *Engine) Model() state.ModelID { return e.cfg.Model }

// Stage implements state.Engine.
func (e *Engine) Stage() state.Stage { return e.cfg.Stage }

// Healthy implements state.Engine: the breaker is closed.
func (e *Engine) Healthy() bool { return !e.open.Load() }

// PDCompatibility implements state.PDCompatible.
func (e *Engine) PDCompatibility() string { return e.cfg.PDCompatibility }

// Config returns the engine's configuration.
func (e *Engine) Config() EngineConfig { return e.cfg }

// RankURL returns the base URL a request picked for DP rank rank (hasRank) is sent to, and its
// host name (the PD bootstrap host of a prefill engine): the rank's own server when the engine
// has RankURLs, else the engine's URL.
func (e *Engine) RankURL(rank int, hasRank bool) (base, host string) {
	if hasRank && rank >= 0 && rank < len(e.ranks) {
		return e.cfg.RankURLs[rank], e.ranks[rank].Hostname()
	}
	return e.cfg.URL, e.base.Hostname()
}

// WireRank returns the DP rank a request picked for rank (hasRank) carries to the engine: the
// global rank DPRankStart + rank. False when it carries none: no rank was picked, or the rank has
// its own server (RankURLs).
func (e *Engine) WireRank(rank int, hasRank bool) (int, bool) {
	if !hasRank || len(e.ranks) > 0 {
		return 0, false
	}
	return e.cfg.DPRankStart + rank, true
}

// Opens counts how often the breaker opened.
func (e *Engine) Opens() uint64 { return e.opens.Load() }

// Probes counts the engine's health probes that ended (Prober), those answered 200 and the
// others. A probe is counted once its outcome has been fed to the breaker.
func (e *Engine) Probes() (ok, failed uint64) { return e.probesOK.Load(), e.probesFailed.Load() }

func (e *Engine) probed(o Outcome) {
	if o == OutcomeOK {
		e.probesOK.Add(1)
	} else {
		e.probesFailed.Add(1)
	}
}

// Outcome classifies one exchange with an engine for its breaker.
type Outcome uint8

// The outcomes.
const (
	// OutcomeOK: a 2xx, 3xx or 4xx answer (a 4xx is the client's error, not the engine's), or a
	// health probe answered 200.
	OutcomeOK Outcome = iota
	// OutcomeServerError: a failure of the engine alone: no answer within the exchange's time
	// bound after the whole request was sent, or a failed health probe (a status other than 200,
	// no answer within the probe's timeout).
	OutcomeServerError
	// OutcomeConnError: no connection (refused, unreachable, dial timeout), for a request or a
	// probe.
	OutcomeConnError
	// OutcomeAmbiguous: a failure the request could have caused as well as the engine: a 5xx
	// answer, a connection closed or reset without an answer after the whole request was sent, an
	// answer cut off. It leaves the breaker as it is: its sender probes the engine
	// (Prober.Suspect), and the probe's outcome is recorded.
	OutcomeAmbiguous
)

// OutcomeOf classifies an HTTP status: a 5xx is OutcomeAmbiguous (a request can make an engine's
// handler fail), anything else OutcomeOK.
func OutcomeOf(status int) Outcome {
	if status >= 500 {
		return OutcomeAmbiguous
	}
	return OutcomeOK
}

// Record feeds an outcome to the breaker: OK resets the streak; a streak of FailureStreak
// OutcomeServerError, or one OutcomeConnError, opens the breaker (the engine turns unhealthy and the
// Router stops picking it until a probe closes it); OutcomeAmbiguous changes nothing.
func (e *Engine) Record(o Outcome) {
	e.mu.Lock()
	defer e.mu.Unlock()
	switch o {
	case OutcomeOK:
		e.streak = 0
		return
	case OutcomeAmbiguous:
		return
	case OutcomeServerError:
		e.streak++
		if e.streak < e.threshold {
			return
		}
	}
	if !e.open.Load() {
		e.open.Store(true)
		e.opens.Add(1)
	}
}

// close closes the breaker after a successful probe.
func (e *Engine) close() {
	e.mu.Lock()
	e.streak = 0
	e.open.Store(false)
	e.mu.Unlock()
}

// Registry is the gateway's engine list: a state.VersionedRegistry whose engines never change
// after construction (health is the breakers', which the version does not cover). Safe for
// concurrent use.
type Registry struct {
	engines []*Engine
	byID    map[state.EngineID]*Engine
	byModel map[state.ModelID][]state.Engine
}

var _ state.VersionedRegistry = (*Registry)(nil)

// NewRegistry validates the engines and builds the registry. An empty or non-http(s) URL, an
// empty model, an invalid kind or stage, DPRanks outside [0, 1024], global ranks (DPRankStart on)
// past 1023, RankURLs that are not one base URL per rank, a negative or too large bootstrap port,
// or two engines with one URL is an error wrapping state.ErrInvalidConfiguration.
func NewRegistry(configs []EngineConfig, breaker BreakerConfig) (*Registry, error) {
	threshold := breaker.FailureStreak
	if threshold == 0 {
		threshold = 3
	}
	if threshold < 0 {
		return nil, fmt.Errorf("gw: breaker failure streak %d is negative: %w", threshold, state.ErrInvalidConfiguration)
	}
	r := &Registry{byID: map[state.EngineID]*Engine{}, byModel: map[state.ModelID][]state.Engine{}}
	for i, c := range configs {
		bad := func(format string, args ...any) (*Registry, error) {
			return nil, fmt.Errorf("gw: engine %d (%s): "+format+": %w", append([]any{i, c.URL}, append(args, state.ErrInvalidConfiguration)...)...)
		}
		c.URL = strings.TrimRight(c.URL, "/")
		u, err := url.Parse(c.URL)
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || (u.Path != "" && u.Path != "/") {
			return bad("URL must be an absolute http(s) base URL without a path")
		}
		if c.Model == "" {
			return bad("empty model")
		}
		if c.Kind != KindVLLM && c.Kind != KindSGLang {
			return bad("invalid kind %v", c.Kind)
		}
		if !c.Stage.Valid() {
			return bad("invalid stage %v", c.Stage)
		}
		if c.DPRanks == 0 {
			c.DPRanks = max(len(c.RankURLs), 1)
		}
		if c.DPRanks < 0 || c.DPRanks > 1024 {
			return bad("DP ranks %d outside [1, 1024]", c.DPRanks)
		}
		if c.DPRankStart < 0 || c.DPRankStart+c.DPRanks > 1024 {
			return bad("global DP ranks %d..%d outside [0, 1024)", c.DPRankStart, c.DPRankStart+c.DPRanks-1)
		}
		if len(c.RankURLs) > 0 && len(c.RankURLs) != c.DPRanks {
			return bad("%d rank URLs for %d DP ranks", len(c.RankURLs), c.DPRanks)
		}
		var ranks []*url.URL
		c.RankURLs = slices.Clone(c.RankURLs)
		for r, raw := range c.RankURLs {
			c.RankURLs[r] = strings.TrimRight(raw, "/")
			ru, err := url.Parse(c.RankURLs[r])
			if err != nil || (ru.Scheme != "http" && ru.Scheme != "https") || ru.Host == "" || ru.Path != "" {
				return bad("rank %d URL %q must be an absolute http(s) base URL without a path", r, raw)
			}
			ranks = append(ranks, ru)
		}
		if c.BootstrapPort < 0 || c.BootstrapPort > 65535 {
			return bad("bootstrap port %d outside [0, 65535]", c.BootstrapPort)
		}
		id := state.EngineID(c.URL)
		if r.byID[id] != nil {
			return bad("duplicate engine")
		}
		e := &Engine{cfg: c, id: id, base: u, ranks: ranks, threshold: threshold}
		r.engines = append(r.engines, e)
		r.byID[id] = e
		r.byModel[c.Model] = append(r.byModel[c.Model], e)
	}
	return r, nil
}

// Engines implements state.Registry.
func (r *Registry) Engines(m state.ModelID) []state.Engine { return r.byModel[m] }

// EnginesVersion implements state.VersionedRegistry: the engine set never changes.
func (r *Registry) EnginesVersion(state.ModelID) uint64 { return 1 }

// All returns every engine in configuration order. The slice is shared: do not modify it.
func (r *Registry) All() []*Engine { return r.engines }

// Lookup returns the engine with the given ID.
func (r *Registry) Lookup(id state.EngineID) (*Engine, bool) {
	e, ok := r.byID[id]
	return e, ok
}

// Models returns the served models, sorted.
func (r *Registry) Models() []state.ModelID {
	out := make([]state.ModelID, 0, len(r.byModel))
	for m := range r.byModel {
		out = append(out, m)
	}
	slices.Sort(out)
	return out
}

// Prober checks engines' health with GET Path. It brings engines with an open breaker back: every
// Interval it probes each of them and closes the breaker of those that answer 200 within Timeout.
// It also checks an engine after a failure its request could have caused (Suspect). Safe for
// concurrent use.
type Prober struct {
	// Registry holds the engines. Required.
	Registry *Registry
	// Client sends the probes. Nil means a client that opens a connection for each probe (no
	// keep-alive, no proxy), as Kubernetes' HTTP probes do: a probe never rides a pooled
	// connection the engine has already closed, and tests that the engine accepts connections.
	Client *http.Client
	// Interval between probe rounds; 0 means 5 s.
	Interval time.Duration
	// Timeout bounds one probe; 0 means 2 s.
	Timeout time.Duration
	// Path is the health endpoint; "" means "/health" (vLLM and SGLang both serve it).
	Path string
}

// Run probes until ctx is done, then returns nil.
func (p *Prober) Run(ctx context.Context) error {
	interval := p.Interval
	if interval <= 0 {
		interval = 5 * time.Second
	}
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
			p.Round(ctx)
		}
	}
}

// Round probes every engine whose breaker is open, once, concurrently, and returns when all
// probes ended.
func (p *Prober) Round(ctx context.Context) {
	var wg sync.WaitGroup
	for _, e := range p.Registry.engines {
		if e.Healthy() {
			continue
		}
		wg.Go(func() {
			o := p.probe(ctx, e)
			if o == OutcomeOK {
				e.close()
			}
			e.probed(o)
		})
	}
	wg.Wait()
}

// Probe is a health probe of one engine that Prober.Suspect started.
type Probe struct {
	done    chan struct{}
	outcome Outcome // set before done is closed
}

// Wait waits until the probe has ended and its outcome has been fed to the engine's breaker, and
// returns the outcome; or until ctx is done, and returns ctx's error.
func (p *Probe) Wait(ctx context.Context) (Outcome, error) {
	select {
	case <-p.done:
		return p.outcome, nil
	case <-ctx.Done():
		return 0, ctx.Err()
	}
}

// Suspect checks e after a failure its request could have caused (OutcomeAmbiguous, or a
// connection closed before the whole request was written): it probes e in the background and
// records the probe's outcome as e's (Engine.Record): a 200 resets the streak, no connection
// opens the breaker at once, anything else counts toward the streak. At most one such probe per
// engine is in flight: a failure while one is in flight is left to it, and gets it, so a burst
// of failures costs one probe. The probe ends within Timeout.
func (p *Prober) Suspect(e *Engine) *Probe {
	e.probeMu.Lock()
	defer e.probeMu.Unlock()
	if e.probing != nil {
		return e.probing
	}
	pr := &Probe{done: make(chan struct{})}
	e.probing = pr
	go func() {
		pr.outcome = p.probe(context.Background(), e)
		e.Record(pr.outcome)
		e.probed(pr.outcome)
		e.probeMu.Lock()
		e.probing = nil
		e.probeMu.Unlock()
		close(pr.done)
	}()
	return pr
}

// probeClient is the Prober's default client (Prober.Client).
var probeClient = &http.Client{Transport: &http.Transport{DisableKeepAlives: true, DisableCompression: true}}

// probe sends GET Path to e within Timeout: OutcomeOK for a 200, OutcomeConnError without a
// connection, else OutcomeServerError.
func (p *Prober) probe(ctx context.Context, e *Engine) Outcome {
	client := p.Client
	if client == nil {
		client = probeClient
	}
	timeout := p.Timeout
	if timeout <= 0 {
		timeout = 2 * time.Second
	}
	path := p.Path
	if path == "" {
		path = "/health"
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	x := &exchange{}
	req, err := http.NewRequestWithContext(x.traced(ctx), http.MethodGet, e.cfg.URL+path, nil)
	if err != nil {
		return OutcomeServerError // not reached: the URL was validated
	}
	resp, err := client.Do(req)
	if err != nil {
		if connected, _ := x.state(); !connected {
			return OutcomeConnError
		}
		return OutcomeServerError
	}
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10)) // lets the connection be reused
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return OutcomeServerError
	}
	return OutcomeOK
}
