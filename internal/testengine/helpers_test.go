package testengine

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

// TestMain fails the package's tests if a goroutine outlives them. zmq4's PUB writer is the one
// exception: closing a PUB socket does not stop it (go-zeromq/zmq4 pub.go, pubMWriter.run).
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4.(*pubMWriter).run"))
}

// start starts an engine that the test closes when it ends.
func start(t *testing.T, o Options) *Engine {
	t.Helper()
	e, err := Start(o)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, e.Close()) })
	return e
}

// client does not keep connections, so no transport goroutine outlives a test.
var client = &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}

// post sends body to the engine's path with the given headers.
func post(t *testing.T, ctx context.Context, url, body string, header map[string]string) *http.Response {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/json")
	for k, v := range header {
		req.Header.Set(k, v)
	}
	resp, err := client.Do(req)
	require.NoError(t, err)
	return resp
}

// postJSON sends body and decodes a 200 answer into out; it returns the status.
func postJSON(t *testing.T, url, body string, header map[string]string, out any) int {
	t.Helper()
	resp := post(t, context.Background(), url, body, header)
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	if out != nil && resp.StatusCode == http.StatusOK {
		require.NoError(t, json.Unmarshal(raw, out), "body %s", raw)
	}
	return resp.StatusCode
}

// get fetches url and returns its status and body.
func get(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := client.Get(url)
	require.NoError(t, err)
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp.StatusCode, string(raw)
}

// events reads a server-sent-event stream into its data lines.
func events(t *testing.T, r io.Reader) []string {
	t.Helper()
	var out []string
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		if data, ok := strings.CutPrefix(sc.Text(), "data: "); ok {
			out = append(out, data)
		}
	}
	require.NoError(t, sc.Err())
	return out
}

// completion is what the tests read of an answer or a chunk.
type completion struct {
	ID      string `json:"id"`
	Object  string `json:"object"`
	Model   string `json:"model"`
	Choices []struct {
		Index   int     `json:"index"`
		Text    *string `json:"text"`
		Message *struct {
			Role    string `json:"role"`
			Content string `json:"content"`
		} `json:"message"`
		Delta *struct {
			Role    string  `json:"role"`
			Content *string `json:"content"`
		} `json:"delta"`
		FinishReason *string `json:"finish_reason"`
	} `json:"choices"`
	Usage *struct {
		PromptTokens        int `json:"prompt_tokens"`
		CompletionTokens    int `json:"completion_tokens"`
		TotalTokens         int `json:"total_tokens"`
		PromptTokensDetails *struct {
			CachedTokens int `json:"cached_tokens"`
		} `json:"prompt_tokens_details"`
	} `json:"usage"`
}

// chatBody is a chat request for content with max_tokens n.
func chatBody(content string, n int, stream bool) string {
	b, _ := json.Marshal(map[string]any{"model": DefaultModel, "messages": []map[string]string{{"role": "user", "content": content}},
		"max_tokens": n, "stream": stream, "stream_options": map[string]bool{"include_usage": true}})
	return string(b)
}

// chatTokens is the prompt the engine builds for chatBody(content, …).
func chatTokens(content string) []uint32 {
	return Tokenize(ChatPrompt([]Message{{Role: "user", Content: content}}, true))
}

// words is n words, n tokens; chatTokens(words(…, n)) has n + 4 (the chat template's).
func words(prefix string, n int) string {
	var b strings.Builder
	for i := range n {
		if i > 0 {
			b.WriteByte(' ')
		}
		b.WriteString(prefix)
		b.WriteString(strings.Repeat("x", i%7))
		b.WriteByte(byte('a' + i%26))
	}
	return b.String()
}
