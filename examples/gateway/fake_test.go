package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/state"
)

// syncBuffer is a bytes.Buffer safe for a writer and a reader in different goroutines.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// gatewaySeries sums each gateway_* series of the page at url over its labels.
func gatewaySeries(t *testing.T, url string) map[string]float64 {
	t.Helper()
	resp, err := http.Get(url)
	require.NoError(t, err)
	defer resp.Body.Close()
	parser := expfmt.NewTextParser(model.UTF8Validation)
	families, err := parser.TextToMetricFamilies(resp.Body)
	require.NoError(t, err)
	out := map[string]float64{}
	for name, mf := range families {
		for _, m := range mf.GetMetric() {
			out[name] += m.GetCounter().GetValue() + m.GetGauge().GetValue()
		}
	}
	return out
}

// go run ./examples/gateway --fake-engines 2 starts two test engines, routes a chat request of the
// model "fake" to one of them, polls their load and follows their KV events; the engines stop with
// the gateway.
func TestFakeEngines(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var stdout syncBuffer
	addr, done := make(chan string, 1), make(chan error, 1)
	go func() {
		done <- run(ctx, []string{"--listen=127.0.0.1:0", "--fake-engines=2", "--load-interval=100ms", "--load-timeout=100ms"}, &stdout, io.Discard,
			func(a string) { addr <- a })
	}()
	var base string
	select {
	case a := <-addr:
		base = "http://" + a
	case err := <-done:
		require.FailNow(t, "the gateway stopped", "%v", err)
	case <-time.After(20 * time.Second):
		require.FailNow(t, "the gateway did not start")
	}
	engines := regexp.MustCompile(`fake engine \d \(model "fake"\): (http://[0-9.:]+),`).FindAllStringSubmatch(stdout.String(), -1)
	require.Len(t, engines, 2, "stdout: %s", stdout.String())
	assert.Contains(t, stdout.String(), "serving 2 engines on "+base)

	resp := post(t, context.Background(), base+"/v1/chat/completions", `{"model":"fake","messages":[{"role":"user","content":"Hello!"}],"max_tokens":4}`, nil)
	raw, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, resp.StatusCode, "%s", raw)
	var answer struct {
		Model   string `json:"model"`
		Choices []struct {
			Message struct {
				Content string `json:"content"`
			} `json:"message"`
		} `json:"choices"`
		Usage struct {
			CompletionTokens int `json:"completion_tokens"`
		} `json:"usage"`
	}
	require.NoError(t, json.Unmarshal(raw, &answer))
	assert.Equal(t, "fake", answer.Model)
	require.Len(t, answer.Choices, 1)
	assert.Len(t, strings.Fields(answer.Choices[0].Message.Content), 4)
	assert.Equal(t, 4, answer.Usage.CompletionTokens)

	// The load of both engines is polled and their KV events are followed: requests with prompts
	// of full blocks are sent until the events of one reach the gateway (the first ones may be
	// published before the gateway's subscriber has connected).
	i := 0
	require.Eventually(t, func() bool {
		i++
		body := fmt.Sprintf(`{"model":"fake","messages":[{"role":"user","content":"%s"}],"max_tokens":1}`, strings.Repeat(fmt.Sprintf("prompt %d ", i), 20))
		resp, err := http.Post(base+"/v1/chat/completions", "application/json", strings.NewReader(body))
		if err != nil {
			return false
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		s := gatewaySeries(t, base+"/metrics")
		// a poll may time out on a loaded machine: what counts is the polls that succeeded
		return s["gateway_load_polls_total"]-s["gateway_load_poll_failures_total"] >= 4 &&
			s["gateway_kv_events_total"] >= 1 && s["gateway_kv_stream_trusted"] == 2
	}, 20*time.Second, 20*time.Millisecond)

	cancel()
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(20 * time.Second):
		require.FailNow(t, "the gateway did not stop")
	}
	for _, m := range engines {
		_, err := http.Get(m[1] + "/health")
		assert.Error(t, err, "engine %s stopped", m[1])
	}
}

// --fake-engines refuses a count outside [1, 64] and the flags it replaces.
func TestFakeEnginesRefusals(t *testing.T) {
	t.Parallel()
	for _, args := range [][]string{
		{"--fake-engines=-1"},
		{"--fake-engines=65"},
		{"--fake-engines=1", "--engine=url=http://127.0.0.1:1,model=m,kind=vllm"},
		{"--fake-engines=1", "--config=x.yaml"},
	} {
		err := run(context.Background(), args, io.Discard, io.Discard, nil)
		assert.ErrorIs(t, err, state.ErrInvalidConfiguration, "%v", args)
	}
}
