package testengine

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Both OpenAI endpoints, streamed and not, generate exactly max_tokens deterministic tokens and
// report the usage; the second identical request is served from the prefix cache.
func TestCompletionsAndChat(t *testing.T) {
	e := start(t, Options{KVEvents: KVEventsOptions{Disabled: true}})
	content := words("cmp", 40)
	for _, tc := range []struct {
		name, path, body string
		prompt           []uint32
		chat, stream     bool
	}{
		{"completions", "/v1/completions", fmt.Sprintf(`{"model":%q,"prompt":%q,"max_tokens":5}`, DefaultModel, content), Tokenize(content), false, false},
		{"completions stream", "/v1/completions", fmt.Sprintf(`{"prompt":%q,"max_tokens":5,"stream":true,"stream_options":{"include_usage":true}}`, content), Tokenize(content), false, true},
		{"chat", "/v1/chat/completions", chatBody(content, 5, false), chatTokens(content), true, false},
		{"chat stream", "/v1/chat/completions", chatBody(content, 5, true), chatTokens(content), true, true},
		{"chat parts", "/v1/chat/completions", fmt.Sprintf(`{"messages":[{"role":"user","content":[{"type":"text","text":%q}]}],"max_completion_tokens":5}`, content), chatTokens(content), true, false},
		{"token IDs", "/v1/completions", `{"prompt":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18],"max_tokens":5}`, []uint32{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18}, false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			want := strings.Join(Generate(tc.prompt, 5), "")
			cached := (len(tc.prompt) - 1) / 16 * 16
			for i, wantCached := range []int{-1, cached} { // -1: whatever an earlier case left
				resp := post(t, context.Background(), e.URL()+tc.path, tc.body, nil)
				require.Equal(t, http.StatusOK, resp.StatusCode)
				var got completion
				var text string
				if tc.stream {
					assert.Equal(t, "text/event-stream", resp.Header.Get("Content-Type"))
					evs := events(t, resp.Body)
					require.Equal(t, "[DONE]", evs[len(evs)-1])
					chunks := evs[:len(evs)-1]
					first := 0
					if tc.chat {
						var c completion
						require.NoError(t, json.Unmarshal([]byte(chunks[0]), &c))
						require.NotNil(t, c.Choices[0].Delta)
						assert.Equal(t, "assistant", c.Choices[0].Delta.Role)
						first = 1
					}
					require.Len(t, chunks, first+5+1, "one chunk per token, then the usage")
					for j, raw := range chunks[first : first+5] {
						var c completion
						require.NoError(t, json.Unmarshal([]byte(raw), &c))
						require.Len(t, c.Choices, 1)
						if tc.chat {
							assert.Equal(t, "chat.completion.chunk", c.Object)
							text += *c.Choices[0].Delta.Content
						} else {
							assert.Equal(t, "text_completion", c.Object)
							text += *c.Choices[0].Text
						}
						if j == 4 {
							assert.Equal(t, "length", *c.Choices[0].FinishReason)
						} else {
							assert.Nil(t, c.Choices[0].FinishReason)
						}
					}
					require.NoError(t, json.Unmarshal([]byte(chunks[len(chunks)-1]), &got))
					assert.Empty(t, got.Choices)
				} else {
					var raw json.RawMessage
					require.NoError(t, json.NewDecoder(resp.Body).Decode(&raw))
					require.NoError(t, json.Unmarshal(raw, &got))
					require.Len(t, got.Choices, 1)
					assert.Equal(t, "length", *got.Choices[0].FinishReason)
					if tc.chat {
						assert.Equal(t, "chat.completion", got.Object)
						assert.Equal(t, "assistant", got.Choices[0].Message.Role)
						text = got.Choices[0].Message.Content
					} else {
						assert.Equal(t, "text_completion", got.Object)
						text = *got.Choices[0].Text
					}
				}
				resp.Body.Close()
				assert.Equal(t, want, text)
				assert.Equal(t, DefaultModel, got.Model)
				require.NotNil(t, got.Usage)
				assert.Equal(t, len(tc.prompt), got.Usage.PromptTokens)
				assert.Equal(t, 5, got.Usage.CompletionTokens)
				assert.Equal(t, len(tc.prompt)+5, got.Usage.TotalTokens)
				require.NotNil(t, got.Usage.PromptTokensDetails)
				if i == 1 {
					assert.Equal(t, wantCached, got.Usage.PromptTokensDetails.CachedTokens, "the repeat is served from the cache")
				}
			}
		})
	}
}

// The first request of a prompt computes it all; a repeat takes every full block of the prompt
// but the one holding the last token (vLLM computes at least the last prompt token), and a
// prompt that shares a prefix takes the full blocks of the prefix.
func TestCachedTokens(t *testing.T) {
	e := start(t, Options{KVEvents: KVEventsOptions{Disabled: true}})
	base := words("c", 60) // 64 prompt tokens: 4 full blocks
	for _, tc := range []struct {
		content    string
		wantCached int
	}{
		{base, 0},
		{base, 48},                      // 64 tokens: the block of the last token is recomputed
		{base + " more words here", 48}, // the 4th block differs: it ends with the chat template's tail
		{"different " + base, 0},        // another first block: nothing shared
		{strings.Join(strings.Fields(base)[:21], " ") + " zzz", 16}, // the first block is <|user|> and 15 words
	} {
		var got completion
		require.Equal(t, http.StatusOK, postJSON(t, e.URL()+"/v1/chat/completions", chatBody(tc.content, 2, false), nil, &got))
		assert.Equal(t, tc.wantCached, got.Usage.PromptTokensDetails.CachedTokens, "%q", tc.content)
	}
	st := e.Stats(0)
	assert.Equal(t, uint64(48+48+16), st.CachedPromptTokens)
}

func TestTokenize(t *testing.T) {
	e := start(t, Options{Model: "m", MaxModelLen: 1000, KVEvents: KVEventsOptions{Disabled: true}})
	type answer struct {
		Count       int      `json:"count"`
		MaxModelLen int      `json:"max_model_len"`
		Tokens      []uint32 `json:"tokens"`
	}
	msgs := []Message{{Role: "system", Content: "Be brief."}, {Role: "user", Content: "Hello, world!"}}
	for _, tc := range []struct {
		body string
		want []uint32
	}{
		{`{"model":"m","prompt":"Hello, world!"}`, Tokenize("Hello, world!")},
		{`{"prompt":"Hello, world!"}`, Tokenize("Hello, world!")},
		{`{"model":"m","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Hello, world!"}]}`, Tokenize(ChatPrompt(msgs, true))},
		{`{"model":"m","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Hello, world!"}],"add_generation_prompt":false}`, Tokenize(ChatPrompt(msgs, false))},
	} {
		var got answer
		require.Equal(t, http.StatusOK, postJSON(t, e.URL()+"/tokenize", tc.body, nil, &got), tc.body)
		assert.Equal(t, tc.want, got.Tokens, tc.body)
		assert.Equal(t, len(tc.want), got.Count)
		assert.Equal(t, 1000, got.MaxModelLen)
	}
	assert.Equal(t, http.StatusNotFound, postJSON(t, e.URL()+"/tokenize", `{"model":"other","prompt":"x"}`, nil, nil))
}

// The chat request's prompt is exactly what /tokenize answers for its messages, which is what a
// router hashes.
func TestTokenizeMatchesTheServedPrompt(t *testing.T) {
	e := start(t, Options{KVEvents: KVEventsOptions{Disabled: true}})
	body := `{"messages":[{"role":"user","content":"What is the capital of France?"}]}`
	var tok struct {
		Tokens []uint32 `json:"tokens"`
	}
	require.Equal(t, http.StatusOK, postJSON(t, e.URL()+"/tokenize", body, nil, &tok))
	var got completion
	require.Equal(t, http.StatusOK, postJSON(t, e.URL()+"/v1/chat/completions", body, nil, &got))
	assert.Equal(t, len(tok.Tokens), got.Usage.PromptTokens)
	assert.Equal(t, DefaultMaxTokens, got.Usage.CompletionTokens)
	assert.Equal(t, strings.Join(Generate(tok.Tokens, DefaultMaxTokens), ""), got.Choices[0].Message.Content)
}

func TestModelsAndHealth(t *testing.T) {
	e := start(t, Options{Model: "m", KVEvents: KVEventsOptions{Disabled: true}})
	code, body := get(t, e.URL()+"/v1/models")
	require.Equal(t, http.StatusOK, code)
	var models struct {
		Object string `json:"object"`
		Data   []struct {
			ID          string `json:"id"`
			MaxModelLen int    `json:"max_model_len"`
		} `json:"data"`
	}
	require.NoError(t, json.Unmarshal([]byte(body), &models))
	assert.Equal(t, "list", models.Object)
	require.Len(t, models.Data, 1)
	assert.Equal(t, "m", models.Data[0].ID)
	assert.Equal(t, DefaultMaxModelLen, models.Data[0].MaxModelLen)
	code, _ = get(t, e.URL()+"/health")
	assert.Equal(t, http.StatusOK, code)
}

// Invalid requests get vLLM's status and an OpenAI error body; nothing is recorded or run.
func TestRequestErrors(t *testing.T) {
	e := start(t, Options{Model: "m", DPRanks: 2, MaxModelLen: 100, MaxBodyBytes: 1000, KVEvents: KVEventsOptions{Disabled: true}})
	for _, tc := range []struct {
		name, path, body string
		header           map[string]string
		status           int
	}{
		{"unknown model", "/v1/completions", `{"model":"x","prompt":"hi"}`, nil, http.StatusNotFound},
		{"not JSON", "/v1/completions", `{`, nil, http.StatusBadRequest},
		{"empty prompt", "/v1/completions", `{"prompt":""}`, nil, http.StatusBadRequest},
		{"no prompt", "/v1/completions", `{"model":"m"}`, nil, http.StatusBadRequest},
		{"batch", "/v1/completions", `{"prompt":["a","b"]}`, nil, http.StatusBadRequest},
		{"negative token", "/v1/completions", `{"prompt":[1,-2]}`, nil, http.StatusBadRequest},
		{"no messages", "/v1/chat/completions", `{"model":"m"}`, nil, http.StatusBadRequest},
		{"bad content", "/v1/chat/completions", `{"messages":[{"role":"user","content":5}]}`, nil, http.StatusBadRequest},
		{"zero max_tokens", "/v1/completions", `{"prompt":"hi","max_tokens":0}`, nil, http.StatusBadRequest},
		{"too long", "/v1/completions", `{"prompt":"hi","max_tokens":100}`, nil, http.StatusBadRequest},
		{"bad rank", "/v1/completions", `{"prompt":"hi"}`, map[string]string{RankHeader: "2"}, http.StatusBadRequest},
		{"rank not a number", "/v1/completions", `{"prompt":"hi"}`, map[string]string{RankHeader: "one"}, http.StatusBadRequest},
		{"body too large", "/v1/completions", `{"prompt":"` + strings.Repeat("a", 1000) + `"}`, nil, http.StatusRequestEntityTooLarge},
		{"tokenize body too large", "/tokenize", `{"prompt":"` + strings.Repeat("a", 1000) + `"}`, nil, http.StatusRequestEntityTooLarge},
	} {
		t.Run(tc.name, func(t *testing.T) {
			resp := post(t, context.Background(), e.URL()+tc.path, tc.body, tc.header)
			defer resp.Body.Close()
			assert.Equal(t, tc.status, resp.StatusCode)
			assert.Equal(t, "application/json", resp.Header.Get("Content-Type"))
			var body struct {
				Error struct {
					Message string `json:"message"`
					Code    int    `json:"code"`
				} `json:"error"`
			}
			require.NoError(t, json.NewDecoder(resp.Body).Decode(&body))
			assert.Equal(t, tc.status, body.Error.Code)
			assert.NotEmpty(t, body.Error.Message)
		})
	}
	assert.Empty(t, e.Requests())
	assert.Equal(t, RankStats{}, e.Stats(0))
}

// FuzzRequestBody: reading the prompt of any request body never panics; it gives tokens below
// 2^31 (at least one for a completions prompt) or a 400.
func FuzzRequestBody(f *testing.F) {
	for _, s := range []string{`{"prompt":"hi","max_tokens":2}`, `{"messages":[{"role":"user","content":"hi"}],"max_tokens":1}`,
		`{"prompt":[1,2,3],"max_tokens":1}`, `{"messages":[{"content":[{"type":"text","text":"a"},{"type":"image"}]}],"max_tokens":1}`,
		`{"prompt":null}`, `[]`, `{"messages":[{"role":"user","content":null}],"max_tokens":1}`} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, body string) {
		for _, chat := range []bool{false, true} {
			var req request
			if json.Unmarshal([]byte(body), &req) != nil {
				continue
			}
			tokens, err := promptTokens(&req, chat)
			if err != nil {
				require.Equal(t, http.StatusBadRequest, err.status)
				continue
			}
			if !chat {
				require.NotEmpty(t, tokens)
			}
			for _, id := range tokens {
				require.Less(t, id, uint32(1)<<31)
			}
		}
	})
}
