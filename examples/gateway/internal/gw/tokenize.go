package gw

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"sync/atomic"
	"time"

	"github.com/enginepick/enginepick/state"
)

// Prompt is what a request says about its input: the model, and either chat messages or a
// completions prompt, both as the client sent them.
type Prompt struct {
	// Model is the requested model: a base model, or a LoRA adapter's name, which the engines
	// tokenize with the adapter's tokenizer (vLLM resolves the model field to the adapter).
	Model state.ModelID
	// Base is the model whose engines serve Model: Model itself when empty, else the adapter's
	// base model (Options.Adapters).
	Base state.ModelID
	// Messages is the chat request's "messages" (nil for /v1/completions).
	Messages json.RawMessage
	// Text is the completions request's "prompt" (nil for chat).
	Text json.RawMessage
}

// Tokenizer turns a prompt into token IDs. Implementations must be safe for concurrent use.
// An error means "unavailable": the handler then estimates the input length from the body size.
type Tokenizer interface {
	Tokenize(ctx context.Context, p Prompt) ([]uint32, error)
}

// ErrNotTokenizable: the prompt has a shape the tokenizer does not send (a batch of prompts).
var ErrNotTokenizable = errors.New("gw: prompt is not tokenizable")

// EngineTokenizer tokenizes through an engine's POST /tokenize (vLLM and SGLang serve it). Chat
// prompts are sent with their "messages", so the engine applies the model's chat template; a
// completions prompt is sent as "prompt". A completions prompt that is already a token ID array
// is returned as is, without a request. The engine is one of the model's healthy engines, taken in
// turn.
type EngineTokenizer struct {
	// Registry lists the engines. Required.
	Registry *Registry
	// Client sends the requests. Nil means a client shared by every EngineTokenizer that keeps up
	// to 256 idle connections per engine: http.DefaultClient keeps 2, so under concurrency most
	// tokenizations would open a new connection.
	Client *http.Client
	// Timeout bounds one request; 0 means 2 s.
	Timeout time.Duration

	next atomic.Uint64
}

var _ Tokenizer = (*EngineTokenizer)(nil)

// tokenizeClient is EngineTokenizer's default client.
var tokenizeClient = &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 256, IdleConnTimeout: 90 * time.Second}}

// CloseIdleConnections closes the tokenizer client's idle connections to the engines now, as its
// idle timeout (90 s for the default client) would.
func (t *EngineTokenizer) CloseIdleConnections() {
	if t.Client != nil {
		t.Client.CloseIdleConnections()
		return
	}
	tokenizeClient.CloseIdleConnections()
}

// tokenizeResponse is vLLM's and SGLang's /tokenize answer; only "tokens" is read.
type tokenizeResponse struct {
	Tokens []int64 `json:"tokens"`
}

// Tokenize implements Tokenizer. Errors: ErrNotTokenizable for a batch prompt; an error when no
// engine of the model is healthy, the request fails, the status is not 200, or the answer has no
// valid token array.
func (t *EngineTokenizer) Tokenize(ctx context.Context, p Prompt) ([]uint32, error) {
	body := map[string]json.RawMessage{}
	model, _ := json.Marshal(string(p.Model))
	body["model"] = model
	switch {
	case p.Messages != nil:
		body["messages"] = p.Messages
	case len(p.Text) > 0 && p.Text[0] == '"':
		body["prompt"] = p.Text
	case len(p.Text) > 0 && p.Text[0] == '[':
		var ids []int64
		if err := json.Unmarshal(p.Text, &ids); err != nil {
			return nil, ErrNotTokenizable // a batch of prompts, or a batch of token arrays
		}
		return toTokens(ids)
	default:
		return nil, ErrNotTokenizable
	}
	engines := t.Registry.Engines(cmp.Or(p.Base, p.Model))
	var e *Engine
	start := t.next.Add(1)
	for i := range engines {
		c := engines[(start+uint64(i))%uint64(len(engines))].(*Engine)
		if c.Healthy() {
			e = c
			break
		}
	}
	if e == nil {
		return nil, fmt.Errorf("gw: tokenize: no healthy engine of model %q", p.Model)
	}
	timeout := t.Timeout
	if timeout <= 0 {
		timeout = 2 * time.Second
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	raw, _ := json.Marshal(body)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, e.cfg.URL+"/tokenize", bytes.NewReader(raw))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	client := t.Client
	if client == nil {
		client = tokenizeClient
	}
	resp, err := client.Do(req)
	if err != nil {
		return nil, fmt.Errorf("gw: tokenize: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<16))
		return nil, fmt.Errorf("gw: tokenize: engine answered %d", resp.StatusCode)
	}
	var out tokenizeResponse
	if err := json.NewDecoder(io.LimitReader(resp.Body, 64<<20)).Decode(&out); err != nil {
		return nil, fmt.Errorf("gw: tokenize: %w", err)
	}
	if out.Tokens == nil {
		return nil, errors.New("gw: tokenize: answer has no tokens")
	}
	return toTokens(out.Tokens)
}

func toTokens(ids []int64) ([]uint32, error) {
	out := make([]uint32, len(ids))
	for i, v := range ids {
		if v < 0 || v > math.MaxUint32 {
			return nil, fmt.Errorf("gw: token ID %d out of range", v)
		}
		out[i] = uint32(v)
	}
	return out, nil
}

// EstimateTokens estimates a prompt's length in tokens from the request body size: one token per
// bytesPerToken bytes, rounded up, at least 1. The whole JSON body is counted, so the estimate
// errs long, which keeps a long prompt out of a bucket too short for it. bytesPerToken < 1 is
// read as 1.
func EstimateTokens(bodyBytes int, bytesPerToken int) int64 {
	bytesPerToken = max(bytesPerToken, 1)
	return max(int64((bodyBytes+bytesPerToken-1)/bytesPerToken), 1)
}
