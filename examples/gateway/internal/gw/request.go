package gw

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strconv"
	"unicode/utf8"
)

// requestHead is what the gateway reads of an OpenAI request body; the body itself is forwarded.
type requestHead struct {
	// Model is the requested model, never empty.
	Model string
	// Stream is the request's "stream" (false when absent or null).
	Stream bool
	// Messages is a chat request's non-empty "messages" array, as sent (nil for completions).
	Messages json.RawMessage
	// Prompt is a completions request's "prompt", as sent (nil for chat).
	Prompt json.RawMessage
	// Output is the output budget: max_completion_tokens, else max_tokens; nil when neither is
	// given (or both are null).
	Output *tokenCount
	// User is the request's "user", OpenAI's end-user identifier ("" when absent or null).
	User string
}

// tokenCount is a valid, non-negative integer token-count field of the request.
type tokenCount struct {
	// Field is the field's name, Raw its value as sent.
	Field, Raw string
	// N is the value; meaningless when Over.
	N int64
	// Over reports a value above math.MaxInt64.
	Over bool
}

// check returns the error for a count that, added to input tokens, leaves int64 (the expected
// peak's range), naming the largest value this prompt allows.
func (c *tokenCount) check(input int64) error {
	if c.Over || c.N > math.MaxInt64-input {
		return fmt.Errorf("%s %s is too large: at most %d, so that it plus the prompt's %d tokens stays within %d",
			c.Field, c.Raw, int64(math.MaxInt64)-input, input, int64(math.MaxInt64))
	}
	return nil
}

// errNotObject is parseHead's error for a body that is not a JSON object.
var errNotObject = errors.New("the request body is not a JSON object")

// parseHead reads and checks the fields the gateway routes on, for a chat request (chat) or a
// completions request. Its error's text is the message for the client's 400: it names the field
// and the cause and quotes the value (its first 32 bytes).
func parseHead(body []byte, chat bool) (requestHead, error) {
	var raw struct {
		Model               json.RawMessage `json:"model"`
		Stream              json.RawMessage `json:"stream"`
		Messages            json.RawMessage `json:"messages"`
		Prompt              json.RawMessage `json:"prompt"`
		MaxTokens           json.RawMessage `json:"max_tokens"`
		MaxCompletionTokens json.RawMessage `json:"max_completion_tokens"`
		User                json.RawMessage `json:"user"`
	}
	if t := bytes.TrimSpace(body); len(t) == 0 || t[0] != '{' {
		return requestHead{}, errNotObject
	}
	if err := json.Unmarshal(body, &raw); err != nil {
		return requestHead{}, errNotObject // every field is raw: only invalid JSON fails
	}
	var h requestHead
	switch {
	case absent(raw.Model):
		return h, errors.New("model is required")
	case raw.Model[0] != '"':
		return h, fmt.Errorf("model must be a string, got %s", quote(raw.Model))
	}
	if err := json.Unmarshal(raw.Model, &h.Model); err != nil {
		return h, errNotObject // a string json.Unmarshal validated
	}
	if h.Model == "" {
		return h, errors.New("model is required")
	}
	switch string(raw.Stream) {
	case "", "null", "false":
	case "true":
		h.Stream = true
	default:
		return h, fmt.Errorf("stream must be a boolean, got %s", quote(raw.Stream))
	}
	if chat {
		switch {
		case absent(raw.Messages):
			return h, errors.New("messages is required")
		case raw.Messages[0] != '[':
			return h, fmt.Errorf("messages must be an array, got %s", quote(raw.Messages))
		case len(bytes.TrimSpace(raw.Messages[1:len(raw.Messages)-1])) == 0:
			return h, errors.New("messages must be a non-empty array")
		}
		h.Messages = raw.Messages
	} else {
		if absent(raw.Prompt) {
			return h, errors.New("prompt is required")
		}
		h.Prompt = raw.Prompt
	}
	if !absent(raw.User) {
		if raw.User[0] != '"' {
			return h, fmt.Errorf("user must be a string, got %s", quote(raw.User))
		}
		if err := json.Unmarshal(raw.User, &h.User); err != nil {
			return h, errNotObject // a string json.Unmarshal validated
		}
	}
	completion, err := parseTokenCount("max_completion_tokens", raw.MaxCompletionTokens)
	if err != nil {
		return h, err
	}
	maxTokens, err := parseTokenCount("max_tokens", raw.MaxTokens)
	if err != nil {
		return h, err
	}
	h.Output = completion
	if h.Output == nil {
		h.Output = maxTokens
	}
	return h, nil
}

// parseTokenCount parses a token-count field: nil when absent or null; an error unless it is an
// integer literal (no fraction, no exponent) that is not negative.
func parseTokenCount(field string, raw json.RawMessage) (*tokenCount, error) {
	if absent(raw) {
		return nil, nil
	}
	if (raw[0] != '-' && (raw[0] < '0' || raw[0] > '9')) || bytes.ContainsAny(raw, ".eE") {
		return nil, fmt.Errorf("%s must be an integer, got %s", field, quote(raw))
	}
	c := &tokenCount{Field: field, Raw: string(raw)}
	n, err := strconv.ParseInt(string(raw), 10, 64)
	switch {
	case err == nil && n >= 0:
		c.N = n
	case err == nil || raw[0] == '-':
		return nil, fmt.Errorf("%s must be a non-negative integer, got %s", field, quote(raw))
	case errors.Is(err, strconv.ErrRange):
		c.Over = true
	default:
		return nil, fmt.Errorf("%s must be an integer, got %s", field, quote(raw)) // not reached: json validated the literal
	}
	return c, nil
}

// absent reports a field that was not sent or was null.
func absent(raw json.RawMessage) bool { return len(raw) == 0 || string(raw) == "null" }

// quote returns a value as sent, cut to its first 32 bytes (at a character boundary) and "…".
func quote(raw json.RawMessage) string {
	const most = 32
	if len(raw) <= most {
		return string(raw)
	}
	cut := most
	for cut > 0 && !utf8.RuneStart(raw[cut]) {
		cut--
	}
	return string(raw[:cut]) + "…"
}
