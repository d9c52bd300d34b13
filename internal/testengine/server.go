package testengine

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// RankHeader is the request header that picks the DP rank to serve a request on, as vLLM's
// OpenAI server reads it (vllm-project/vllm vllm/entrypoints/openai/serving_engine.py,
// _get_data_parallel_rank).
const RankHeader = "X-data-parallel-rank"

// frontend is one HTTP server's view of the engine: the ranks it serves and its metrics.
type frontend struct {
	ranks []*rank
	// fixed: the server serves one rank of several (RankServers) and ignores RankHeader.
	fixed bool
	reg   *prometheus.Registry
}

func (e *Engine) handler(f *frontend) http.Handler {
	mux := http.NewServeMux()
	guard := func(h http.HandlerFunc) http.HandlerFunc {
		return func(w http.ResponseWriter, r *http.Request) {
			if !e.enter() {
				panic(http.ErrAbortHandler) // closing: cut the connection
			}
			defer e.exit()
			h(w, r)
		}
	}
	mux.HandleFunc("POST /v1/completions", guard(func(w http.ResponseWriter, r *http.Request) { e.inference(w, r, f, false) }))
	mux.HandleFunc("POST /v1/chat/completions", guard(func(w http.ResponseWriter, r *http.Request) { e.inference(w, r, f, true) }))
	mux.HandleFunc("POST /tokenize", guard(e.tokenize))
	mux.HandleFunc("GET /v1/models", guard(e.models))
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusOK) })
	mux.Handle("GET /metrics", promhttp.HandlerFor(f.reg, promhttp.HandlerOpts{}))
	mux.HandleFunc("POST /sleep", guard(func(w http.ResponseWriter, r *http.Request) {
		if err := sleepRanks(r.Context(), f.ranks); err != nil {
			writeError(w, http.StatusServiceUnavailable, "ServiceUnavailableError", err.Error())
			return
		}
		w.WriteHeader(http.StatusOK)
	}))
	mux.HandleFunc("POST /wake_up", func(w http.ResponseWriter, _ *http.Request) {
		wakeUpRanks(f.ranks)
		w.WriteHeader(http.StatusOK)
	})
	mux.HandleFunc("GET /is_sleeping", func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, http.StatusOK, map[string]bool{"is_sleeping": f.ranks[0].stats().Sleeping})
	})
	return mux
}

// apiError is an error answered to the client with its status.
type apiError struct {
	status int
	typ    string
	msg    string
}

func (e *apiError) Error() string { return e.msg }

func badRequest(format string, args ...any) *apiError {
	return &apiError{status: http.StatusBadRequest, typ: "BadRequestError", msg: fmt.Sprintf(format, args...)}
}

// writeError writes vLLM's error body ({"error": {"message", "type", "param", "code"}}).
func writeError(w http.ResponseWriter, status int, typ, msg string) {
	writeJSON(w, status, map[string]any{"error": map[string]any{"message": msg, "type": typ, "param": nil, "code": status}})
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

// request is what the engine reads of a completions, chat or tokenize body.
type request struct {
	Model               string          `json:"model"`
	Prompt              json.RawMessage `json:"prompt"`
	Messages            json.RawMessage `json:"messages"`
	Stream              bool            `json:"stream"`
	StreamOptions       *streamOptions  `json:"stream_options"`
	MaxTokens           *int            `json:"max_tokens"`
	MaxCompletionTokens *int            `json:"max_completion_tokens"`
	AddGenerationPrompt *bool           `json:"add_generation_prompt"`
	Priority            int64           `json:"priority"`
}

type streamOptions struct {
	IncludeUsage bool `json:"include_usage"`
}

// readBody reads a JSON body of at most MaxBodyBytes into req and, when fields is not nil, its
// fields into *fields.
func (e *Engine) readBody(w http.ResponseWriter, r *http.Request, req *request, fields *map[string]json.RawMessage) *apiError {
	raw, err := io.ReadAll(http.MaxBytesReader(w, r.Body, e.opts.MaxBodyBytes))
	if err != nil {
		var tooLarge *http.MaxBytesError
		if errors.As(err, &tooLarge) {
			return &apiError{status: http.StatusRequestEntityTooLarge, typ: "RequestEntityTooLarge",
				msg: fmt.Sprintf("request body exceeds %d bytes", e.opts.MaxBodyBytes)}
		}
		return badRequest("reading the request body: %v", err)
	}
	if err := json.Unmarshal(raw, req); err != nil {
		return badRequest("the request body is not a valid request: %v", err)
	}
	if fields != nil {
		_ = json.Unmarshal(raw, fields)
	}
	if req.Model != "" && req.Model != e.opts.Model {
		return &apiError{status: http.StatusNotFound, typ: "NotFoundError", msg: fmt.Sprintf("The model `%s` does not exist.", req.Model)}
	}
	return nil
}

// promptTokens returns the request's prompt tokens: the chat template applied to its messages
// (chat), or its prompt, a string or an array of token IDs (completions and tokenize).
func promptTokens(req *request, chat bool) ([]uint32, *apiError) {
	if chat {
		msgs, err := parseMessages(req.Messages)
		if err != nil {
			return nil, err
		}
		add := req.AddGenerationPrompt == nil || *req.AddGenerationPrompt
		return Tokenize(ChatPrompt(msgs, add)), nil
	}
	var text string
	if err := json.Unmarshal(req.Prompt, &text); err == nil {
		if text == "" {
			return nil, badRequest("prompt cannot be empty")
		}
		return Tokenize(text), nil
	}
	var ids []int64
	if err := json.Unmarshal(req.Prompt, &ids); err != nil || len(ids) == 0 {
		return nil, badRequest("prompt must be a non-empty string or array of token IDs (batches are not served)")
	}
	out := make([]uint32, len(ids))
	for i, id := range ids {
		if id < 0 || id > math.MaxInt32 {
			return nil, badRequest("token ID %d at %d outside [0, 2^31)", id, i)
		}
		out[i] = uint32(id)
	}
	return out, nil
}

// parseMessages reads chat messages: content a string, null, or a list of parts whose "text"
// parts are concatenated.
func parseMessages(raw json.RawMessage) ([]Message, *apiError) {
	var msgs []struct {
		Role    string          `json:"role"`
		Content json.RawMessage `json:"content"`
	}
	if err := json.Unmarshal(raw, &msgs); err != nil || len(msgs) == 0 {
		return nil, badRequest("messages must be a non-empty array of messages")
	}
	out := make([]Message, len(msgs))
	for i, m := range msgs {
		out[i].Role = m.Role
		if len(m.Content) == 0 || string(m.Content) == "null" {
			continue
		}
		if err := json.Unmarshal(m.Content, &out[i].Content); err == nil {
			continue
		}
		var parts []struct {
			Type string `json:"type"`
			Text string `json:"text"`
		}
		if err := json.Unmarshal(m.Content, &parts); err != nil {
			return nil, badRequest("messages[%d].content must be a string or an array of parts", i)
		}
		var b strings.Builder
		for _, p := range parts {
			if p.Type == "text" {
				b.WriteString(p.Text)
			}
		}
		out[i].Content = b.String()
	}
	return out, nil
}

// tokenize is POST /tokenize in vLLM's shape: {"count", "max_model_len", "tokens", "token_strs"}.
func (e *Engine) tokenize(w http.ResponseWriter, r *http.Request) {
	var req request
	if err := e.readBody(w, r, &req, nil); err != nil {
		writeError(w, err.status, err.typ, err.msg)
		return
	}
	chat := len(req.Messages) > 0 && string(req.Messages) != "null"
	tokens, err := promptTokens(&req, chat)
	if err != nil {
		writeError(w, err.status, err.typ, err.msg)
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"count": len(tokens), "max_model_len": e.opts.MaxModelLen, "tokens": tokens, "token_strs": nil})
}

// models is GET /v1/models.
func (e *Engine) models(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, map[string]any{"object": "list", "data": []map[string]any{{
		"id": e.opts.Model, "object": "model", "created": 0, "owned_by": "vllm", "root": e.opts.Model,
		"parent": nil, "max_model_len": e.opts.MaxModelLen}}})
}

// pickRank returns the rank of a server that serves one (RankServers), else the rank the request
// names in RankHeader, else the least loaded one by vLLM's score (waiting × 4 + running; the
// lowest rank on a tie).
func (f *frontend) pickRank(r *http.Request) (*rank, *apiError) {
	if f.fixed {
		return f.ranks[0], nil
	}
	if v := r.Header.Get(RankHeader); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 0 || n >= len(f.ranks) {
			return nil, badRequest("%s %q: want a rank in [0, %d)", RankHeader, v, len(f.ranks))
		}
		return f.ranks[n], nil
	}
	best, bestLoad := f.ranks[0], f.ranks[0].load()
	for _, rk := range f.ranks[1:] {
		if l := rk.load(); l < bestLoad {
			best, bestLoad = rk, l
		}
	}
	return best, nil
}

// The OpenAI response bodies, fields in vLLM's order.
type (
	usage struct {
		PromptTokens        int           `json:"prompt_tokens"`
		TotalTokens         int           `json:"total_tokens"`
		CompletionTokens    int           `json:"completion_tokens"`
		PromptTokensDetails *tokenDetails `json:"prompt_tokens_details"`
	}
	tokenDetails struct {
		CachedTokens int `json:"cached_tokens"`
	}
	choice struct {
		Index        int      `json:"index"`
		Text         *string  `json:"text,omitempty"`
		Message      *message `json:"message,omitempty"`
		Delta        *message `json:"delta,omitempty"`
		Logprobs     any      `json:"logprobs"`
		FinishReason *string  `json:"finish_reason"`
	}
	message struct {
		Role    string  `json:"role,omitempty"`
		Content *string `json:"content,omitempty"`
	}
	response struct {
		ID      string   `json:"id"`
		Object  string   `json:"object"`
		Created int64    `json:"created"`
		Model   string   `json:"model"`
		Choices []choice `json:"choices"`
		Usage   *usage   `json:"usage,omitempty"`
	}
)

// inference serves POST /v1/completions and /v1/chat/completions. Every request generates exactly
// its max_tokens (finish_reason "length"). A stream sends a chunk per token (a chat stream first
// sends the assistant role), then a usage chunk when stream_options.include_usage is set, then
// "data: [DONE]". usage.prompt_tokens_details.cached_tokens is always present: the prompt tokens
// served from the prefix cache (vLLM reports it with --enable-prompt-tokens-details).
func (e *Engine) inference(w http.ResponseWriter, r *http.Request, f *frontend, chat bool) {
	var req request
	fields := map[string]json.RawMessage{}
	if err := e.readBody(w, r, &req, &fields); err != nil {
		writeError(w, err.status, err.typ, err.msg)
		return
	}
	if chat && (len(req.Messages) == 0 || string(req.Messages) == "null") {
		writeError(w, http.StatusBadRequest, "BadRequestError", "messages is required")
		return
	}
	prompt, apiErr := promptTokens(&req, chat)
	if apiErr != nil {
		writeError(w, apiErr.status, apiErr.typ, apiErr.msg)
		return
	}
	maxTokens := e.opts.MaxTokens
	if req.MaxCompletionTokens != nil {
		maxTokens = *req.MaxCompletionTokens
	} else if req.MaxTokens != nil {
		maxTokens = *req.MaxTokens
	}
	if maxTokens < 1 {
		writeError(w, http.StatusBadRequest, "BadRequestError", fmt.Sprintf("max_tokens must be at least 1, got %d", maxTokens))
		return
	}
	if len(prompt)+maxTokens > e.opts.MaxModelLen {
		writeError(w, http.StatusBadRequest, "BadRequestError", fmt.Sprintf(
			"This model's maximum context length is %d tokens. However, you requested %d tokens (%d in the messages, %d in the completion).",
			e.opts.MaxModelLen, len(prompt)+maxTokens, len(prompt), maxTokens))
		return
	}
	if req.Priority != 0 && e.opts.SchedulingPolicy != "priority" {
		writeError(w, http.StatusBadRequest, "BadRequestError", fmt.Sprintf("Got priority %d but Priority scheduling is not enabled.", req.Priority))
		return
	}
	rk, apiErr := f.pickRank(r)
	if apiErr != nil {
		writeError(w, apiErr.status, apiErr.typ, apiErr.msg)
		return
	}
	rec := &Request{Path: r.URL.Path, Header: r.Header.Clone(), Body: fields, Rank: rk.id, PromptTokens: len(prompt)}
	e.record(rec)

	object, prefix := "text_completion", "cmpl-"
	if chat {
		object, prefix = "chat.completion", "chatcmpl-"
	}
	resp := response{ID: prefix + strconv.FormatUint(e.ids.Add(1), 10), Object: object, Created: time.Now().Unix(), Model: e.opts.Model}
	s := newSeq(prompt, maxTokens, e.opts.BlockSize)
	s.priority = req.Priority
	var text strings.Builder
	var stream *sse
	if req.Stream {
		stream = &sse{w: w, rc: http.NewResponseController(w)}
		if stream.start() != nil {
			return
		}
	}
	emit := func(piece string) error {
		text.WriteString(piece)
		n := len(s.tokens) - s.promptLen
		e.update(func() {
			rec.CachedTokens, rec.CompletionTokens = s.hitTokens, n
			if n == 1 {
				e.firsts++
				rec.FirstToken = e.firsts
			}
		})
		if stream == nil {
			return nil
		}
		if n == 1 && chat {
			role := ""
			if err := stream.send(resp.chunk(choice{Delta: &message{Role: "assistant", Content: &role}})); err != nil {
				return err
			}
		}
		ch := choice{}
		if chat {
			ch.Delta = &message{Content: &piece}
		} else {
			ch.Text = &piece
		}
		if n == maxTokens {
			ch.FinishReason = ptr("length")
		}
		return stream.send(resp.chunk(ch))
	}
	err := rk.run(r.Context(), s, emit)
	switch {
	case errors.Is(err, errAborted):
		panic(http.ErrAbortHandler) // the engine restarted or closed: cut the connection
	case err != nil:
		return // the client left
	}
	u := &usage{PromptTokens: s.promptLen, CompletionTokens: maxTokens, TotalTokens: s.promptLen + maxTokens,
		PromptTokensDetails: &tokenDetails{CachedTokens: s.hitTokens}}
	if stream != nil {
		if req.StreamOptions != nil && req.StreamOptions.IncludeUsage {
			c := resp.chunk()
			c.Choices, c.Usage = []choice{}, u
			if stream.send(c) != nil {
				return
			}
		}
		if stream.write("data: [DONE]\n\n") != nil {
			return
		}
	} else {
		out := text.String()
		ch := choice{FinishReason: ptr("length")}
		if chat {
			ch.Message = &message{Role: "assistant", Content: &out}
		} else {
			ch.Text = &out
		}
		resp.Choices, resp.Usage = []choice{ch}, u
		writeJSON(w, http.StatusOK, resp)
	}
	e.update(func() { rec.Completed = true })
}

func ptr[T any](v T) *T { return &v }

// chunk returns a streamed chunk of the response with the given choices.
func (r response) chunk(choices ...choice) response {
	c := r
	if c.Object == "chat.completion" {
		c.Object = "chat.completion.chunk"
	}
	c.Choices = choices
	return c
}

// sse writes server-sent events, each flushed at once.
type sse struct {
	w  http.ResponseWriter
	rc *http.ResponseController
}

// start sends the stream's headers at once, as vLLM's streaming response does.
func (s *sse) start() error {
	s.w.Header().Set("Content-Type", "text/event-stream")
	s.w.Header().Set("Cache-Control", "no-cache")
	s.w.WriteHeader(http.StatusOK)
	return s.rc.Flush()
}

func (s *sse) send(v any) error {
	var b bytes.Buffer
	b.WriteString("data: ")
	if err := json.NewEncoder(&b).Encode(v); err != nil {
		return err
	}
	b.WriteString("\n") // Encode ended the line; a blank line ends the event
	return s.write(b.String())
}

func (s *sse) write(text string) error {
	if _, err := io.WriteString(s.w, text); err != nil {
		return err
	}
	return s.rc.Flush()
}
