// Package fakeengine is an in-process stand-in for a vLLM or SGLang server, for the gateway's
// tests and benchmarks on loopback: it answers the OpenAI endpoints (JSON or a server-sent-event
// stream), POST /tokenize, GET /health and a load endpoint, and records every inference request
// it receives. It is not an engine: it generates nothing and caches nothing by itself.
package fakeengine

import (
	"encoding/json"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"time"
)

// Request is one inference request as the engine received it.
type Request struct {
	Path   string
	Header http.Header
	Body   map[string]json.RawMessage
	// Completed reports whether the handler ran to the end without its request context being
	// cancelled (the caller stayed until the answer was written).
	Completed bool
}

// Engine is a fake engine on an httptest server. Configure it through its fields before traffic
// or through the setters during it. Safe for concurrent use.
type Engine struct {
	Server *httptest.Server

	mu        sync.Mutex
	requests  []*Request
	status    int    // inference status; 0 = 200
	errBody   string // body of a non-200 inference answer
	chunks    []string
	chunkWait <-chan struct{} // when set, each chunk after the first waits for a receive
	holdOpen  bool            // after the chunks, block until the client leaves
	gate      <-chan struct{} // when set, the answer waits for it (prefill that takes time)
	delay     time.Duration   // every answer waits this long first (an engine's service time)
	health    int
	load      string // load page body
	tokenize  int    // /tokenize status; 0 = 200
	bodyLimit int64  // request bodies longer than this are refused; 0 = no limit
	bodyDrop  bool   // refuse by closing the connection instead of answering 413

	// Tokenized counts /tokenize calls.
	Tokenized atomic.Int64
	// LastTokenize is the last /tokenize body.
	lastTokenize map[string]json.RawMessage
	// inflight counts inference handlers running.
	inflight atomic.Int64
}

// New starts a fake engine answering non-streamed requests with a fixed JSON completion and
// streamed ones with three SSE events and [DONE], on a free loopback port.
func New() *Engine {
	e, mux := newEngine()
	e.Server = httptest.NewServer(mux)
	return e
}

// NewAt starts the same fake engine listening on addr (host:port): an engine restarted at the
// address it had before, so that the gateway, which knows engines by URL, finds it again.
func NewAt(addr string) (*Engine, error) {
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	e, mux := newEngine()
	e.Server = httptest.NewUnstartedServer(mux)
	_ = e.Server.Listener.Close()
	e.Server.Listener = l
	e.Server.Start()
	return e, nil
}

// Kill stops the engine as a crash would: every open connection, a stream in progress included,
// is cut at once, and new connections are refused. Kill after Kill or Close does nothing more.
func (e *Engine) Kill() {
	e.Server.CloseClientConnections()
	e.Server.Close()
}

func newEngine() (*Engine, http.Handler) {
	e := &Engine{health: http.StatusOK,
		chunks: []string{"data: {\"choices\":[{\"delta\":{\"content\":\"Hel\"}}]}\n\n",
			"data: {\"choices\":[{\"delta\":{\"content\":\"lo\"}}]}\n\n", "data: [DONE]\n\n"}}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/chat/completions", e.inference)
	mux.HandleFunc("POST /v1/completions", e.inference)
	mux.HandleFunc("POST /tokenize", e.tokenizeHandler)
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, _ *http.Request) {
		e.mu.Lock()
		code := e.health
		e.mu.Unlock()
		w.WriteHeader(code)
	})
	load := func(w http.ResponseWriter, _ *http.Request) {
		e.mu.Lock()
		body := e.load
		e.mu.Unlock()
		if body == "" {
			w.WriteHeader(http.StatusNotFound)
			return
		}
		_, _ = io.WriteString(w, body)
	}
	mux.HandleFunc("GET /metrics", load)
	mux.HandleFunc("GET /v1/loads", load)
	mux.HandleFunc("GET /get_load", load)
	return e, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		e.mu.Lock()
		limit, drop := e.bodyLimit, e.bodyDrop
		e.mu.Unlock()
		if limit > 0 && r.ContentLength > limit {
			refuseBody(w, drop)
			return
		}
		mux.ServeHTTP(w, r)
	})
}

// refuseBody refuses a request whose body is over the limit without reading it, as a server
// checking Content-Length does: a 413 with an error body, or (drop) the connection closed without
// an answer.
func refuseBody(w http.ResponseWriter, drop bool) {
	if drop {
		if conn, _, err := http.NewResponseController(w).Hijack(); err == nil {
			_ = conn.Close()
		}
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusRequestEntityTooLarge)
	_, _ = io.WriteString(w, `{"object":"error","message":"request body too large","type":"BadRequestError","code":413}`)
}

// URL returns the engine's base URL.
func (e *Engine) URL() string { return e.Server.URL }

// Close stops the server.
func (e *Engine) Close() { e.Server.Close() }

// SetStatus makes inference requests answer code with body (0 restores 200).
func (e *Engine) SetStatus(code int, body string) {
	e.mu.Lock()
	e.status, e.errBody = code, body
	e.mu.Unlock()
}

// SetChunks sets the stream's chunks, written and flushed one by one. With wait set, every chunk
// after the first waits for a receive from wait; with holdOpen, the stream then stays open until
// the client leaves.
func (e *Engine) SetChunks(chunks []string, wait <-chan struct{}, holdOpen bool) {
	e.mu.Lock()
	e.chunks, e.chunkWait, e.holdOpen = chunks, wait, holdOpen
	e.mu.Unlock()
}

// SetGate makes every inference answer wait until gate is closed (or receives).
func (e *Engine) SetGate(gate <-chan struct{}) {
	e.mu.Lock()
	e.gate = gate
	e.mu.Unlock()
}

// SetDelay makes every inference answer wait d before its first byte (0: none), as an engine's
// service time would; a client that leaves ends the wait.
func (e *Engine) SetDelay(d time.Duration) {
	e.mu.Lock()
	e.delay = d
	e.mu.Unlock()
}

// SetBodyLimit makes the engine refuse every request whose Content-Length is over limit bytes
// (0: no limit) without reading its body: with drop false it answers 413, with drop true it closes
// the connection without an answer.
func (e *Engine) SetBodyLimit(limit int64, drop bool) {
	e.mu.Lock()
	e.bodyLimit, e.bodyDrop = limit, drop
	e.mu.Unlock()
}

// SetHealth sets GET /health's status.
func (e *Engine) SetHealth(code int) {
	e.mu.Lock()
	e.health = code
	e.mu.Unlock()
}

// SetLoad sets the body of the load endpoints (/metrics, /v1/loads, /get_load).
func (e *Engine) SetLoad(body string) {
	e.mu.Lock()
	e.load = body
	e.mu.Unlock()
}

// SetTokenizeStatus makes /tokenize answer code (0 restores 200).
func (e *Engine) SetTokenizeStatus(code int) {
	e.mu.Lock()
	e.tokenize = code
	e.mu.Unlock()
}

// Requests returns the inference requests received so far.
func (e *Engine) Requests() []Request {
	e.mu.Lock()
	defer e.mu.Unlock()
	out := make([]Request, len(e.requests))
	for i, r := range e.requests {
		out[i] = *r
	}
	return out
}

// ResetRequests forgets the inference requests recorded so far.
func (e *Engine) ResetRequests() {
	e.mu.Lock()
	e.requests = nil
	e.mu.Unlock()
}

// LastTokenize returns the last /tokenize request body.
func (e *Engine) LastTokenize() map[string]json.RawMessage {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.lastTokenize
}

// InFlight returns the inference handlers running now.
func (e *Engine) InFlight() int64 { return e.inflight.Load() }

// Tokens is the fake tokenizer: one token per byte of text.
func Tokens(text string) []uint32 {
	out := make([]uint32, len(text))
	for i := range len(text) {
		out[i] = uint32(text[i])
	}
	return out
}

func (e *Engine) tokenizeHandler(w http.ResponseWriter, r *http.Request) {
	e.Tokenized.Add(1)
	var body map[string]json.RawMessage
	if err := json.NewDecoder(r.Body).Decode(&body); err != nil {
		w.WriteHeader(http.StatusBadRequest)
		return
	}
	e.mu.Lock()
	e.lastTokenize = body
	code := e.tokenize
	e.mu.Unlock()
	if code != 0 && code != http.StatusOK {
		w.WriteHeader(code)
		return
	}
	var text string
	if raw, ok := body["messages"]; ok {
		var msgs []struct {
			Content string `json:"content"`
		}
		_ = json.Unmarshal(raw, &msgs)
		for _, m := range msgs {
			text += m.Content
		}
	} else {
		_ = json.Unmarshal(body["prompt"], &text)
	}
	_ = json.NewEncoder(w).Encode(map[string]any{"tokens": Tokens(text), "count": len(text), "max_model_len": 1 << 20})
}

func (e *Engine) inference(w http.ResponseWriter, r *http.Request) {
	e.inflight.Add(1)
	defer e.inflight.Add(-1)
	raw, _ := io.ReadAll(r.Body)
	var body map[string]json.RawMessage
	_ = json.Unmarshal(raw, &body)
	rec := &Request{Path: r.URL.Path, Header: r.Header.Clone(), Body: body}
	e.mu.Lock()
	e.requests = append(e.requests, rec)
	status, errBody, chunks, wait, hold, gate, delay := e.status, e.errBody, e.chunks, e.chunkWait, e.holdOpen, e.gate, e.delay
	e.mu.Unlock()
	defer func() {
		if r.Context().Err() == nil {
			e.mu.Lock()
			rec.Completed = true
			e.mu.Unlock()
		}
	}()
	if gate != nil {
		select {
		case <-gate:
		case <-r.Context().Done():
			return
		}
	}
	if delay > 0 {
		t := time.NewTimer(delay)
		select {
		case <-t.C:
		case <-r.Context().Done():
			t.Stop()
			return
		}
	}
	if status != 0 && status != http.StatusOK {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(status)
		_, _ = io.WriteString(w, errBody)
		return
	}
	var stream bool
	_ = json.Unmarshal(body["stream"], &stream)
	if !stream {
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"id":"cmpl-1","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"Hello"},"finish_reason":"stop"}]}`)
		return
	}
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("Cache-Control", "no-cache")
	rc := http.NewResponseController(w)
	for i, c := range chunks {
		if i > 0 && wait != nil {
			select {
			case <-wait:
			case <-r.Context().Done():
				return
			}
		}
		if _, err := io.WriteString(w, c); err != nil {
			return
		}
		_ = rc.Flush()
	}
	if hold {
		select {
		case <-r.Context().Done():
		case <-time.After(time.Minute):
		}
	}
}
