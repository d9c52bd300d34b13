package gw

import (
	"bytes"
	"encoding/json"
	"testing"
)

// parseHead never panics; what it accepts is a JSON object with a model, a non-empty messages
// array (chat) or a prompt (completions), and a non-negative output budget when one is given.
func FuzzParseHead(f *testing.F) {
	for _, seed := range []string{
		`{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":16}`,
		`{"model":"m","prompt":"once","max_completion_tokens":9223372036854775808,"stream":true}`,
		`{"model":"m","messages":[ ],"max_tokens":"ten"}`,
		`{"model":5,"messages":"hi","max_tokens":1e30}`,
		`{"model":"","stream":"yes","max_tokens":-0}`,
		`[1,2]`, `null`, ` {"model":"é","messages":[1]} `, `{"max_tokens":-9223372036854775809}`,
		`{"model":"m","prompt":"x","user":"alice"}`, `{"model":"m","prompt":"x","user":["alice"]}`,
	} {
		f.Add([]byte(seed), true)
		f.Add([]byte(seed), false)
	}
	f.Fuzz(func(t *testing.T, body []byte, chat bool) {
		h, err := parseHead(body, chat)
		if err != nil {
			if err.Error() == "" {
				t.Fatal("an error without a message")
			}
			return
		}
		if !json.Valid(body) || bytes.TrimSpace(body)[0] != '{' {
			t.Fatalf("accepted %q, which is not a JSON object", body)
		}
		if h.Model == "" {
			t.Fatal("accepted without a model")
		}
		if chat && (len(h.Messages) < 3 || h.Messages[0] != '[' || h.Prompt != nil) {
			t.Fatalf("accepted chat messages %q", h.Messages)
		}
		if !chat && (len(h.Prompt) == 0 || h.Messages != nil) {
			t.Fatalf("accepted completions prompt %q", h.Prompt)
		}
		if o := h.Output; o != nil && !o.Over && o.N < 0 {
			t.Fatalf("negative output budget %d", o.N)
		}
	})
}
