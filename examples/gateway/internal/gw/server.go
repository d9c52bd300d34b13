package gw

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"math"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptrace"
	"slices"
	"strconv"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/enginepick/enginepick"
	"github.com/enginepick/enginepick/bucket"
	"github.com/enginepick/enginepick/flowcontrol"
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

// Defaults of Options.
const (
	// DefaultMaxBodyBytes is the request body limit: 32 MiB. vLLM's and SGLang's OpenAI servers run
	// on uvicorn, which sets no body limit (vllm-project/vllm `vllm/entrypoints/launcher.py` bounds
	// only the headers); 32 MiB is the cap of vLLM's Rust HTTP frontend, so the gateway does not
	// forward a body an engine's own server refuses. It also bounds the memory one request holds:
	// the gateway reads the whole body before it routes. Something in front of an engine may set
	// less (4 MiB is fasthttp's default): the engine's 413, or its closing the connection before
	// reading the whole body, reaches the client as a 413.
	DefaultMaxBodyBytes = 32 << 20
	// DefaultBytesPerToken is the body-size estimate's bytes per token.
	DefaultBytesPerToken = 4
	// DefaultPrefillTimeout bounds a PD prefill leg, which runs on after the client leaves.
	DefaultPrefillTimeout = 10 * time.Minute
)

// VLLMRankHeader is the request header vLLM's OpenAI server reads for the data-parallel rank to
// serve a request on (vllm-project/vllm vllm/entrypoints/openai/serving_engine.py,
// _get_data_parallel_rank).
const VLLMRankHeader = "X-data-parallel-rank"

// Flow-control headers (docs/design.md §17): the request's priority, an integer that selects its
// band (bucket.Request.Priority; absent means 0), and its flow, the fairness key
// (bucket.Request.Flow; absent or empty means the body's OpenAI "user" field). They matter only
// when the Router has flow control (the --config file's flow_control block).
const (
	PriorityHeader = "x-enginepick-priority"
	FlowHeader     = "x-enginepick-flow"
)

// SGLang request fields (sgl-project/sglang python/sglang/srt/entrypoints/openai/protocol.py):
// the DP rank to serve on (routed_dp_rank, formerly data_parallel_rank), the prefill rank holding a
// PD request's KV (disagg_prefill_dp_rank, sent to decode), and the PD bootstrap triple.
const (
	sglangRankField        = "routed_dp_rank"
	sglangPrefillRankField = "disagg_prefill_dp_rank"
)

// vllmPriorityField is vLLM's request priority (vllm-project/vllm
// vllm/entrypoints/openai/protocol.py): lower values are served first under --scheduling-policy
// priority.
const vllmPriorityField = "priority"

// Options configures a Server.
type Options struct {
	// Router selects engines. Required; its registry must be Registry.
	Router *enginepick.Router
	// Registry holds the engines the Router picks from. Required.
	Registry *Registry
	// Tokenizer tokenizes prompts. Nil means every prompt's length is estimated from its body
	// size, and cache-aware groups fall back to load for every request.
	Tokenizer Tokenizer
	// BytesPerToken is the body-size estimate's ratio; 0 means DefaultBytesPerToken.
	BytesPerToken int
	// SessionHeader and RoutingKeyHeader name the request headers read into the session and
	// sticky-routing keys; "" reads none.
	SessionHeader    string
	RoutingKeyHeader string
	// MaxBodyBytes bounds a request body; 0 means DefaultMaxBodyBytes. A longer body is a 413.
	MaxBodyBytes int64
	// Client sends requests to engines. Nil means a client whose transport does not negotiate
	// compression, so that bodies are relayed byte for byte, keeps up to 256 idle connections per
	// engine and closes a connection idle for DefaultIdleConnTimeout.
	Client *http.Client
	// PrefillTimeout bounds a PD prefill leg; 0 means DefaultPrefillTimeout.
	PrefillTimeout time.Duration
	// Rand returns uniform 64-bit values for PD bootstrap rooms. Nil means math/rand/v2.Uint64.
	Rand func() uint64
	// Metrics records the gateway's series; nil records none.
	Metrics *Metrics
	// Logger receives upstream failures at debug level. Nil means zap.NewNop().
	Logger *zap.Logger
	// Prober probes an engine after a failure its request could have caused (Prober.Suspect).
	// Nil means a Prober on Registry with its defaults.
	Prober *Prober
	// EnginePriority, when set, gives the body's "priority" field forwarded to vLLM engines for a
	// request of priority p (PriorityHeader): for engines run with --scheduling-policy priority,
	// which serve lower values first (vllm-project/vllm vllm/v1/core/sched/request_queue.py) and
	// refuse any other value than 0 without it. Nil forwards the body as it is.
	EnginePriority func(p int) int
	// Adapters maps a LoRA adapter's name to its base model (config Model.Adapters). A request
	// whose model is an adapter is routed on the base model's buckets with bucket.Request.Adapter
	// set, and forwarded as it came: vLLM serves an adapter under its own name in the OpenAI
	// model field (vllm-project/vllm vllm/entrypoints/openai/serving_models.py). GET /v1/models
	// lists each adapter with its base model as parent. Nil means none.
	Adapters map[state.ModelID]state.ModelID
}

// Server is the OpenAI-compatible handler: POST /v1/chat/completions and /v1/completions, GET
// /v1/models, GET /healthz and, with Metrics, GET /metrics. Safe for concurrent use.
type Server struct {
	opts Options
	mux  *http.ServeMux
	log  *zap.Logger
}

// NewServer validates opts and returns the handler. A nil Router or Registry is an error wrapping
// state.ErrInvalidConfiguration.
func NewServer(opts Options) (*Server, error) {
	if opts.Router == nil || opts.Registry == nil {
		return nil, fmt.Errorf("gw: server needs a Router and a Registry: %w", state.ErrInvalidConfiguration)
	}
	if opts.BytesPerToken <= 0 {
		opts.BytesPerToken = DefaultBytesPerToken
	}
	if opts.MaxBodyBytes <= 0 {
		opts.MaxBodyBytes = DefaultMaxBodyBytes
	}
	if opts.Client == nil {
		opts.Client = &http.Client{Transport: &http.Transport{DisableCompression: true, MaxIdleConnsPerHost: 256,
			IdleConnTimeout: DefaultIdleConnTimeout}}
	}
	if opts.PrefillTimeout <= 0 {
		opts.PrefillTimeout = DefaultPrefillTimeout
	}
	if opts.Rand == nil {
		opts.Rand = rand.Uint64
	}
	if opts.Prober == nil {
		opts.Prober = &Prober{Registry: opts.Registry}
	}
	s := &Server{opts: opts, mux: http.NewServeMux(), log: opts.Logger}
	if s.log == nil {
		s.log = zap.NewNop()
	}
	s.mux.HandleFunc("POST /v1/chat/completions", func(w http.ResponseWriter, r *http.Request) { s.inference(w, r, true) })
	s.mux.HandleFunc("POST /v1/completions", func(w http.ResponseWriter, r *http.Request) { s.inference(w, r, false) })
	models, err := modelsAnswer(opts.Registry, opts.Adapters, time.Now())
	if err != nil {
		return nil, err
	}
	s.mux.HandleFunc("GET /v1/models", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write(models)
	})
	s.mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		_, _ = io.WriteString(w, "ok\n")
	})
	if opts.Metrics != nil {
		s.mux.Handle("GET /metrics", opts.Metrics.Handler())
	}
	return s, nil
}

// modelCard is one model of GET /v1/models, in OpenAI's format as vLLM's server answers it
// (vllm-project/vllm `vllm/entrypoints/openai/protocol.py`, ModelCard and ModelList).
type modelCard struct {
	ID      string `json:"id"`
	Object  string `json:"object"`
	Created int64  `json:"created"`
	OwnedBy string `json:"owned_by"`
	Parent  string `json:"parent,omitempty"`
}

// modelsAnswer returns GET /v1/models' body: every model of the registry, sorted, then every
// adapter of a served model, sorted, with its base model as parent; all created at created (Unix
// seconds) and owned by "enginepick". The registry never changes, so neither does the answer.
func modelsAnswer(r *Registry, adapters map[state.ModelID]state.ModelID, created time.Time) ([]byte, error) {
	list := struct {
		Object string      `json:"object"`
		Data   []modelCard `json:"data"`
	}{Object: "list", Data: []modelCard{}}
	models := r.Models()
	for _, m := range models {
		list.Data = append(list.Data, modelCard{ID: string(m), Object: "model", Created: created.Unix(), OwnedBy: "enginepick"})
	}
	for _, a := range slices.Sorted(maps.Keys(adapters)) {
		if slices.Contains(models, adapters[a]) {
			list.Data = append(list.Data, modelCard{ID: string(a), Object: "model", Created: created.Unix(), OwnedBy: "enginepick", Parent: string(adapters[a])})
		}
	}
	return json.Marshal(list)
}

// ServeHTTP implements http.Handler.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) { s.mux.ServeHTTP(w, r) }

// DefaultIdleConnTimeout is how long the default client keeps an idle connection to an engine
// (net/http's DefaultTransport value). Without it, the connections a burst opened (up to 256 per
// engine, each with its goroutines and buffers on both ends) stayed open for the process's life.
const DefaultIdleConnTimeout = 90 * time.Second

// CloseIdleConnections closes the idle connections to the engines now, the client's and the
// tokenizer's (when it has a CloseIdleConnections method, as EngineTokenizer does), as their idle
// timeouts would.
func (s *Server) CloseIdleConnections() {
	s.opts.Client.CloseIdleConnections()
	if c, ok := s.opts.Tokenizer.(interface{ CloseIdleConnections() }); ok {
		c.CloseIdleConnections()
	}
}

// statusWriter records the status written, for the request metric.
type statusWriter struct {
	http.ResponseWriter
	status int
}

func (w *statusWriter) WriteHeader(code int) {
	if w.status == 0 {
		w.status = code
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *statusWriter) Write(b []byte) (int, error) {
	if w.status == 0 {
		w.status = http.StatusOK
	}
	return w.ResponseWriter.Write(b)
}

// Unwrap lets http.ResponseController reach the connection's Flush.
func (w *statusWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

func (s *Server) inference(rw http.ResponseWriter, r *http.Request, chat bool) {
	w := &statusWriter{ResponseWriter: rw}
	defer func() {
		code := w.status
		if code == 0 {
			code = 499 // the client left before anything was written
		}
		s.opts.Metrics.request(r.URL.Path, code)
	}()
	tooLarge := func() {
		writeError(w, http.StatusRequestEntityTooLarge, "invalid_request_error",
			fmt.Sprintf("request body is larger than %d bytes", s.opts.MaxBodyBytes))
	}
	if r.ContentLength > s.opts.MaxBodyBytes {
		tooLarge() // refused before it is read
		return
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, s.opts.MaxBodyBytes))
	if err != nil {
		var maxBytes *http.MaxBytesError
		if errors.As(err, &maxBytes) {
			tooLarge()
			return
		}
		writeError(w, http.StatusBadRequest, "invalid_request_error", "could not read the request body")
		return
	}
	head, err := parseHead(body, chat)
	if err != nil {
		writeError(w, http.StatusBadRequest, "invalid_request_error", err.Error())
		return
	}
	prompt := Prompt{Model: state.ModelID(head.Model), Messages: head.Messages, Text: head.Prompt}

	req := &bucket.Request{Model: prompt.Model}
	if base, ok := s.opts.Adapters[prompt.Model]; ok {
		// A LoRA adapter: its base model's buckets and engines serve it (docs/design.md §18).
		prompt.Base, req.Model, req.Adapter = base, base, head.Model
	}
	if s.opts.Tokenizer != nil {
		tokens, err := s.opts.Tokenizer.Tokenize(r.Context(), prompt)
		if err == nil {
			req.TokenIDs = tokens
			req.InputTokens = int64(len(tokens))
		} else if ce := s.log.Check(zap.DebugLevel, "tokenization unavailable; estimating"); ce != nil {
			ce.Write(zap.Error(err))
		}
	}
	if req.TokenIDs == nil {
		// docs/design.md §1: without tokens the length is estimated and cache-aware routing falls
		// back to load for this request (no token IDs, no prefix lookup).
		req.InputTokens = EstimateTokens(len(body), s.opts.BytesPerToken)
		s.opts.Metrics.estimate()
	}
	if out := head.Output; out != nil {
		if err := out.check(req.InputTokens); err != nil {
			writeError(w, http.StatusBadRequest, "invalid_request_error", err.Error())
			return
		}
		peak, err := bucket.ExpectedPeak(req.InputTokens, out.N)
		if err != nil { // not reached: check bounds the sum
			writeError(w, http.StatusBadRequest, "invalid_request_error", err.Error())
			return
		}
		req.ExpectedPeakTokens, req.HasExpectedPeak = peak, true
	}
	if s.opts.SessionHeader != "" {
		req.SessionKey = r.Header.Get(s.opts.SessionHeader)
	}
	if s.opts.RoutingKeyHeader != "" {
		req.RoutingKey = r.Header.Get(s.opts.RoutingKeyHeader)
	}
	if v := r.Header.Get(PriorityHeader); v != "" {
		p, err := strconv.Atoi(v)
		if err != nil {
			writeError(w, http.StatusBadRequest, "invalid_request_error",
				fmt.Sprintf("header %s must be an integer, got %s", PriorityHeader, quote([]byte(strconv.Quote(v)))))
			return
		}
		req.Priority = p
	}
	req.Flow = cmp.Or(r.Header.Get(FlowHeader), head.User)

	d, err := s.opts.Router.Select(r.Context(), req)
	if err != nil {
		s.selectionError(w, err, req.Model)
		return
	}
	if d.Selection.IsPD() {
		s.dispatchPD(w, r, body, head.Stream, req.Priority, d)
		return
	}
	s.dispatchPlain(w, r, body, req.Priority, d)
}

// priorityField is the "priority" field a request of the given priority carries to engine e
// (Options.EnginePriority): nil for an SGLang engine or without EnginePriority.
func (s *Server) priorityField(e *Engine, priority int) map[string]any {
	if s.opts.EnginePriority == nil || e.cfg.Kind != KindVLLM {
		return nil
	}
	return map[string]any{vllmPriorityField: s.opts.EnginePriority(priority)}
}

// selectionError answers a failed selection with bucket.StatusCode's status and an OpenAI-style
// error whose message never names an engine (docs/design.md §16: error texts carry engine URLs).
func (s *Server) selectionError(w http.ResponseWriter, err error, model state.ModelID) {
	code := bucket.StatusCode(err)
	s.opts.Metrics.selectionFailure(code)
	if ce := s.log.Check(zap.DebugLevel, "selection failed"); ce != nil {
		ce.Write(zap.Int("status", code), zap.Error(err))
	}
	var typ, msg string
	var rejected *flowcontrol.RejectedError
	switch {
	case errors.As(err, &rejected):
		// RFC 9110 §10.2.3: delay-seconds, rounded up so that a client does not retry early.
		w.Header().Set("Retry-After", strconv.Itoa(int(math.Ceil(rejected.RetryAfter.Seconds()))))
		writeError(w, code, "rate_limit_exceeded", "too many requests are waiting for an engine: retry later")
		return
	case errors.Is(err, flowcontrol.ErrTimeout):
		writeError(w, code, "engine_unavailable", "the request waited its priority's time limit and no engine took it")
		return
	}
	switch code {
	case http.StatusBadRequest:
		typ, msg = "invalid_request_error", "no engine group accepts a request of this length"
	case http.StatusNotFound:
		typ, msg = "model_not_found", fmt.Sprintf("model %q is not served here: GET /v1/models lists the served models", model)
	case http.StatusServiceUnavailable:
		typ, msg = "engine_unavailable", "no engine can take the request now"
	case 499:
		return // the client went away; nobody reads an answer
	case http.StatusGatewayTimeout:
		typ, msg = "timeout", "the request timed out before an engine was chosen"
	default:
		typ, msg = "internal_error", "the request could not be routed"
	}
	writeError(w, code, typ, msg)
}

// writeError writes an OpenAI-style error body.
func writeError(w http.ResponseWriter, code int, typ, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(map[string]any{"error": map[string]any{"message": msg, "type": typ, "code": code}})
}

func (s *Server) engineOf(p policy.Pick) *Engine { return p.Engine.(*Engine) }

// pickRank returns the DP rank the pick names (policy.Pick.DPRank), if any. Without one the
// engine places the request on a rank itself.
func pickRank(p policy.Pick) (int, bool) { return p.DPRank, p.HasDPRank }

// withFields returns body with the given top-level fields set (replaced when present).
func withFields(body []byte, fields map[string]any) ([]byte, error) {
	if len(fields) == 0 {
		return body, nil
	}
	var obj map[string]json.RawMessage
	if err := json.Unmarshal(body, &obj); err != nil {
		return nil, err
	}
	for k, v := range fields {
		raw, err := json.Marshal(v)
		if err != nil {
			return nil, err
		}
		obj[k] = raw
	}
	return json.Marshal(obj)
}

// hopHeaders are the hop-by-hop headers a proxy never forwards (RFC 9110 §7.6.1).
var hopHeaders = map[string]bool{"Connection": true, "Proxy-Connection": true, "Keep-Alive": true,
	"Proxy-Authenticate": true, "Proxy-Authorization": true, "Te": true, "Trailer": true,
	"Transfer-Encoding": true, "Upgrade": true}

// ErrBodyRefused is the error of an exchange the engine ended by closing the connection before it
// had read the whole request body of at least 1 MiB, as a server with a body limit does with a body
// over it, while its health probe answered 200. The request caused it, not the engine: the client gets a 413.
var ErrBodyRefused = errors.New("gw: the engine closed the connection before reading the whole request body")

// minRefusableBody is the smallest request body, in bytes, whose unsent remainder the gateway
// blames on a body limit of the engine (ErrBodyRefused). The smallest limit engine servers set is
// fasthttp's 4 MiB default (vLLM's and SGLang's Python servers set none): an engine that stops
// reading a smaller body has failed, for instance crashed and restarted while it was sent.
const minRefusableBody = 1 << 20

// exchange records how far one request to an engine got, from the transport's trace.
type exchange struct {
	mu        sync.Mutex
	connected bool // a connection to the engine was obtained
	sent      bool // the whole request, body included, was written to it
}

// traced returns ctx with a trace that records the exchange's progress. Each attempt of the
// transport (it retries a request its reused connection could not carry) starts the record again.
func (x *exchange) traced(ctx context.Context) context.Context {
	set := func(connected, sent bool) {
		x.mu.Lock()
		x.connected, x.sent = connected, sent
		x.mu.Unlock()
	}
	return httptrace.WithClientTrace(ctx, &httptrace.ClientTrace{
		GetConn:      func(string) { set(false, false) },
		GotConn:      func(httptrace.GotConnInfo) { set(true, false) },
		WroteRequest: func(i httptrace.WroteRequestInfo) { set(true, i.Err == nil) },
	})
}

func (x *exchange) state() (connected, sent bool) {
	x.mu.Lock()
	defer x.mu.Unlock()
	return x.connected, x.sent
}

// send posts body to the engine at the client request's path (to the picked rank's own server
// when the engine has one per rank, Engine.RankURL) and feeds the exchange to the engine's
// breaker (BreakerConfig). An answer is OutcomeOf its status: a 5xx probes the engine. Without an
// answer: the client's own cancellation is nobody's failure; no connection is OutcomeConnError; a
// connection closed before the whole body was written probes the engine and, if the probe answers
// 200, returns ErrBodyRefused (the engine refused the body), else the transport's error; after the
// whole request was written, a timeout (ctx's deadline) is OutcomeServerError and a connection
// closed or reset probes the engine (noAnswer).
func (s *Server) send(ctx context.Context, r *http.Request, e *Engine, body []byte, rank int, hasRank bool) (*http.Response, error) {
	base, _ := e.RankURL(rank, hasRank)
	x := &exchange{}
	req, err := http.NewRequestWithContext(x.traced(ctx), http.MethodPost, base+r.URL.Path, bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	for k, vs := range r.Header {
		// The DP rank is the gateway's to set: a client's own rank header is not forwarded.
		if hopHeaders[k] || k == "Content-Length" || k == "Host" || http.CanonicalHeaderKey(k) == http.CanonicalHeaderKey(VLLMRankHeader) {
			continue
		}
		req.Header[k] = vs
	}
	if req.Header.Get("Content-Type") == "" {
		req.Header.Set("Content-Type", "application/json")
	}
	if wire, ok := e.WireRank(rank, hasRank); ok && e.cfg.Kind == KindVLLM {
		req.Header.Set(VLLMRankHeader, strconv.Itoa(wire))
	}
	resp, err := s.opts.Client.Do(req)
	if err != nil {
		connected, sent := x.state()
		var kind string
		switch {
		case ctx.Err() != nil && !errors.Is(ctx.Err(), context.DeadlineExceeded):
			return nil, err // the client left
		case !connected:
			kind = "connection"
			s.opts.Metrics.upstreamFailure(e, kind)
			e.Record(OutcomeConnError)
		case !sent:
			// A body over the engine's limit, or the engine dying while it was sent: the probe
			// tells which.
			o, werr := s.opts.Prober.Suspect(e).Wait(ctx)
			if werr != nil && !errors.Is(werr, context.DeadlineExceeded) {
				return nil, err // the client left
			}
			kind = "no_answer"
			if o == OutcomeOK && werr == nil && len(body) >= minRefusableBody {
				kind = "body_refused"
				err = fmt.Errorf("%w: %w", ErrBodyRefused, err)
			}
			s.opts.Metrics.upstreamFailure(e, kind)
		default:
			kind = s.noAnswer(ctx, e, err, "no_answer")
		}
		if ce := s.log.Check(zap.DebugLevel, "no answer from the engine"); ce != nil {
			ce.Write(zap.String("engine", string(e.ID())), zap.String("kind", kind), zap.Error(err))
		}
		return nil, err
	}
	o := OutcomeOf(resp.StatusCode)
	if o == OutcomeAmbiguous {
		s.opts.Prober.Suspect(e)
		s.opts.Metrics.upstreamFailure(e, "server_error")
	}
	e.Record(o)
	return resp, nil
}

// noAnswer feeds e's breaker an exchange that ended, after the whole request was written, without
// an answer or with its answer cut off, and returns the failure's kind for the metrics: past ctx's
// deadline or a transport timeout it is the engine's failure ("timeout", OutcomeServerError);
// otherwise the engine closed or reset the connection, which the request could have caused (a
// body over the engine's limit that socket buffers took whole, a request that crashes the
// engine), so the engine is probed (Prober.Suspect) and kind is returned. It waits for the probe
// (or ctx), so that the breaker reflects a dead engine before the client learns of the failure
// and retries.
func (s *Server) noAnswer(ctx context.Context, e *Engine, err error, kind string) string {
	var ne net.Error
	if errors.Is(ctx.Err(), context.DeadlineExceeded) || (errors.As(err, &ne) && ne.Timeout()) {
		s.opts.Metrics.upstreamFailure(e, "timeout")
		e.Record(OutcomeServerError)
		return "timeout"
	}
	probe := s.opts.Prober.Suspect(e)
	s.opts.Metrics.upstreamFailure(e, kind)
	_, _ = probe.Wait(ctx)
	return kind
}

// bodyRefused answers a request whose body the engine refused (ErrBodyRefused).
func bodyRefused(w http.ResponseWriter, n int) {
	writeError(w, http.StatusRequestEntityTooLarge, "invalid_request_error",
		fmt.Sprintf("the engine closed the connection before reading the whole request body: it does not accept a body of %d bytes", n))
}

var copyBuf = sync.Pool{New: func() any { b := make([]byte, 32<<10); return &b }}

// relay writes the engine's response to the client as it arrives: headers (hop-by-hop ones
// excepted), status, then every chunk read from the body, flushed at once, so server-sent events
// reach the client byte for byte and without delay. The first body byte ends the request's prefill
// for the router (Dispatch.FirstToken). It returns when the body ends, the client leaves (a failed
// write) or the engine cuts the body off (noAnswer).
func (s *Server) relay(w http.ResponseWriter, r *http.Request, e *Engine, resp *http.Response, d *enginepick.Dispatch) (firstByte time.Time, err error) {
	h := w.Header()
	for k, vs := range resp.Header {
		if !hopHeaders[k] {
			h[k] = vs
		}
	}
	w.WriteHeader(resp.StatusCode)
	rc := http.NewResponseController(w)
	bp := copyBuf.Get().(*[]byte)
	defer copyBuf.Put(bp)
	buf := *bp
	for {
		n, err := resp.Body.Read(buf)
		if n > 0 {
			if firstByte.IsZero() {
				firstByte = time.Now()
				d.FirstToken()
			}
			if _, werr := w.Write(buf[:n]); werr != nil {
				return firstByte, werr // the client left; the request context cancels the engine request
			}
			_ = rc.Flush()
		}
		if err == io.EOF {
			return firstByte, nil
		}
		if err != nil {
			if r.Context().Err() == nil {
				s.noAnswer(r.Context(), e, err, "cut")
			}
			return firstByte, err
		}
	}
}

// dispatchPlain forwards the request to the plain engine and relays its answer. The dispatch ends
// with Done when the response (or stream) ends, however it ends: the error (none for a 2xx or 4xx
// answer relayed whole, nor for a body the engine refused, answered 413), and the time to the
// first byte of the answer's body as its time to first token (docs/design.md §15.1); token counts
// are not parsed from the body.
func (s *Server) dispatchPlain(w http.ResponseWriter, r *http.Request, body []byte, priority int, d *enginepick.Dispatch) {
	var outcome enginepick.Outcome
	defer func() { d.Done(outcome) }() // the guard is held until the response or stream ends, or the client leaves
	start := time.Now()
	pick := d.Selection.Plain
	e := s.engineOf(pick)
	s.opts.Metrics.dispatch(state.StagePlain, pick)
	rank, hasRank := pickRank(pick)
	fields := s.priorityField(e, priority)
	if wire, ok := e.WireRank(rank, hasRank); ok && e.cfg.Kind == KindSGLang {
		fields = map[string]any{sglangRankField: wire}
	}
	var err error
	if body, err = withFields(body, fields); err != nil {
		writeError(w, http.StatusBadRequest, "invalid_request_error", "the request body is not a JSON object")
		return
	}
	resp, err := s.send(r.Context(), r, e, body, rank, hasRank)
	switch {
	case errors.Is(err, ErrBodyRefused):
		bodyRefused(w, len(body))
		return
	case err != nil:
		outcome.Err = err
		if r.Context().Err() == nil {
			writeError(w, http.StatusBadGateway, "engine_unavailable", "the selected engine could not be reached")
		}
		return
	}
	defer resp.Body.Close()
	first, err := s.relay(w, r, e, resp, d)
	outcome = relayOutcome(e, resp.StatusCode, start, first, err)
}

// relayOutcome is the outcome of a relayed answer: the relay's error, or an engine error for a 5xx
// status (a 4xx is the client's error, not the engine's), else the time from start to the answer's
// first body byte as its time to first token.
func relayOutcome(e *Engine, status int, start, first time.Time, err error) enginepick.Outcome {
	var o enginepick.Outcome
	switch {
	case err != nil:
		o.Err = err
	case status >= http.StatusInternalServerError:
		o.Err = fmt.Errorf("gw: engine %s answered %d", e.ID(), status)
	case status < http.StatusBadRequest && !first.IsZero():
		o.TTFT = first.Sub(start)
	}
	return o
}

// BootstrapRoom draws a PD bootstrap room in [0, 2^63) from u. When the prefill engine has
// dpRanks > 1 and the pick names its rank, the room is the nearest value below u's with
// room mod dpRanks = rank: SGLang's prefill DP controller and its decode side both find the
// prefill DP rank as bootstrap_room mod the prefill DP size unless told otherwise
// (sgl-project/sglang python/sglang/srt/managers/data_parallel_controller.py), so the room agrees
// with the rank sent.
func BootstrapRoom(u uint64, dpRanks int, rank int, hasRank bool) uint64 {
	room := u & (1<<63 - 1)
	if hasRank && dpRanks > 1 && rank >= 0 && rank < dpRanks {
		d := uint64(dpRanks)
		room = room - room%d + uint64(rank)
		if room >= 1<<63 {
			room -= d
		}
	}
	return room
}

// prefillLeg is the outcome of a PD prefill request, set before done is closed.
type prefillLeg struct {
	done    chan struct{}
	bodyLen int // the request body's length
	err     error
	status  int
	header  http.Header
	body    []byte
}

func (p *prefillLeg) failed() bool { return p.err != nil || p.status >= 400 }

// dispatchPD sends the request to the prefill and the decode engine concurrently, each with the
// same bootstrap host, port and room (and each leg's DP rank when known), and relays the decode
// engine's response. The prefill leg is detached from the client: it runs to completion (or
// PrefillTimeout) even if the client leaves, because the decode engine waits for its KV. Each
// leg's in-flight guard is released when that leg ends (enginepick.Dispatch.ReleaseStage): the
// prefill engine's when its answer has been read, the decode engine's when its response or stream
// has been relayed (or the client left); the dispatch ends when both have, with Done: the decode
// leg's outcome (its time to first byte as the time to first token), or the prefill leg's error
// when the prefill engine failed (docs/design.md §15.1).
func (s *Server) dispatchPD(w http.ResponseWriter, r *http.Request, body []byte, stream bool, priority int, d *enginepick.Dispatch) {
	start := time.Now()
	sel := d.Selection
	pe, de := s.engineOf(sel.Prefill), s.engineOf(sel.Decode)
	s.opts.Metrics.dispatch(state.StagePrefill, sel.Prefill)
	s.opts.Metrics.dispatch(state.StageDecode, sel.Decode)
	prank, pok := pickRank(sel.Prefill)
	drank, dok := pickRank(sel.Decode)
	room := BootstrapRoom(s.opts.Rand(), pe.cfg.DPRanks, prank, pok)
	var port any // null when the prefill engine has no bootstrap port configured
	if pe.cfg.BootstrapPort != 0 {
		port = pe.cfg.BootstrapPort
	}
	_, host := pe.RankURL(prank, pok)
	common := func() map[string]any {
		return map[string]any{"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": room}
	}
	pf, df := common(), common()
	maps.Copy(pf, s.priorityField(pe, priority))
	maps.Copy(df, s.priorityField(de, priority))
	pwire, pwok := pe.WireRank(prank, pok)
	if pwok && pe.cfg.Kind == KindSGLang {
		pf[sglangRankField] = pwire
	}
	if dwire, ok := de.WireRank(drank, dok); ok && de.cfg.Kind == KindSGLang {
		df[sglangRankField] = dwire
	}
	if pwok && de.cfg.Kind == KindSGLang {
		df[sglangPrefillRankField] = pwire
	}
	pbody, err := withFields(body, pf)
	if err != nil {
		d.Release()
		writeError(w, http.StatusBadRequest, "invalid_request_error", "the request body is not a JSON object")
		return
	}
	dbody, _ := withFields(body, df)

	p := &prefillLeg{done: make(chan struct{}), bodyLen: len(pbody)}
	pctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), s.opts.PrefillTimeout)
	go func() {
		defer close(p.done)
		defer d.ReleaseStage(state.StagePrefill) // this leg's engine is done with the request
		defer cancel()
		resp, err := s.send(pctx, r, pe, pbody, prank, pok)
		if err != nil {
			p.err = err
			return
		}
		defer resp.Body.Close()
		p.status, p.header = resp.StatusCode, resp.Header
		if resp.StatusCode >= 400 {
			p.body, _ = io.ReadAll(io.LimitReader(resp.Body, 1<<20))
			return
		}
		if _, err := io.Copy(io.Discard, resp.Body); err != nil {
			s.noAnswer(pctx, pe, err, "cut")
			p.err = err
		}
	}()
	var outcome enginepick.Outcome // the decode leg's; set before the deferred end below reads it
	end := func() {
		if outcome.Err == nil && ((p.err != nil && !errors.Is(p.err, ErrBodyRefused)) || p.status >= http.StatusInternalServerError) {
			outcome = enginepick.Outcome{Err: fmt.Errorf("gw: prefill engine %s failed: %w", pe.ID(), prefillErr(p))}
		}
		d.Done(outcome)
	}
	defer func() {
		d.ReleaseStage(state.StageDecode)
		select {
		case <-p.done:
			end()
		default:
			go func() { <-p.done; end() }()
		}
	}()

	resp, err := s.send(r.Context(), r, de, dbody, drank, dok)
	if errors.Is(err, ErrBodyRefused) {
		bodyRefused(w, len(dbody))
		return
	}
	if err != nil {
		outcome.Err = err
		if r.Context().Err() == nil {
			writeError(w, http.StatusBadGateway, "engine_unavailable", "the selected decode engine could not be reached")
		}
		return
	}
	defer resp.Body.Close()
	select {
	case <-p.done:
		if p.failed() {
			s.prefillError(w, p)
			return
		}
	default:
	}
	if stream || resp.StatusCode >= 400 {
		first, err := s.relay(w, r, de, resp, d)
		outcome = relayOutcome(de, resp.StatusCode, start, first, err)
		return
	}
	// A complete answer waits for the prefill leg: a decode result without its prefill is not
	// trustworthy, and a prefill error (a 4xx is the client's) is the one to report.
	full, err := io.ReadAll(resp.Body)
	if err != nil {
		outcome.Err = err
		if r.Context().Err() == nil {
			s.noAnswer(r.Context(), de, err, "cut")
			writeError(w, http.StatusBadGateway, "engine_unavailable", "the decode engine cut its answer off")
		}
		return
	}
	select {
	case <-p.done:
	case <-r.Context().Done():
		return
	}
	if p.failed() {
		s.prefillError(w, p)
		return
	}
	resp.Body = io.NopCloser(bytes.NewReader(full))
	first, err := s.relay(w, r, de, resp, d)
	outcome = relayOutcome(de, resp.StatusCode, start, first, err)
}

// prefillErr is a failed prefill leg's error: the transport's, else its status.
func prefillErr(p *prefillLeg) error {
	if p.err != nil {
		return p.err
	}
	return fmt.Errorf("answered %d", p.status)
}

// prefillError reports a failed prefill leg: an engine's 4xx answer is relayed as it is and a body
// the engine refused is a 413 (the request is the client's error); anything else is a 502.
func (s *Server) prefillError(w http.ResponseWriter, p *prefillLeg) {
	if errors.Is(p.err, ErrBodyRefused) {
		bodyRefused(w, p.bodyLen)
		return
	}
	if p.err == nil && p.status < 500 {
		for k, vs := range p.header {
			if !hopHeaders[k] && k != "Content-Length" {
				w.Header()[k] = vs
			}
		}
		w.WriteHeader(p.status)
		_, _ = w.Write(p.body)
		return
	}
	writeError(w, http.StatusBadGateway, "prefill_failed", "the prefill engine failed")
}

// Metrics returns the server's metrics (nil when none were configured).
func (s *Server) Metrics() *Metrics { return s.opts.Metrics }
