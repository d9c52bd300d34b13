package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/state"
)

// TestConfigFileRoutesLoRAAdapters: a request whose model is one of a model's adapters is routed
// on the base model's buckets to the engine that reports the adapter running (vLLM's
// vllm:lora_requests_info), where the other engine, as loaded, has no slot for it, and is
// forwarded with its model field unchanged, as vLLM expects an adapter; GET /v1/models lists the
// adapter under its base model. Either engine may hold the adapter.
func TestConfigFileRoutesLoRAAdapters(t *testing.T) {
	t.Parallel()
	for _, holder := range []int{0, 1} {
		engs := [2]interface {
			URL() string
			SetLoad(string)
		}{}
		a, b := newEngine(t), newEngine(t)
		engs[0], engs[1] = a, b
		for i, e := range engs {
			residency := `max_lora="1",running_lora_adapters="other",waiting_lora_adapters=""`
			if i == holder {
				residency = `max_lora="1",running_lora_adapters="sql-lora",waiting_lora_adapters=""`
			}
			e.SetLoad("vllm:num_requests_running 1\nvllm:num_requests_waiting 0\n" +
				"vllm:lora_requests_info{" + residency + "} 1.7e9\n")
		}
		path := writeConfig(t, fmt.Sprintf(`
load: {poll_interval: 50ms, poll_timeout: 50ms}
engines:
  - {id: %q, model: m, load: {url: "%s/metrics", format: vllm_metrics}}
  - {id: %q, model: m, load: {url: "%s/metrics", format: vllm_metrics}}
models:
  - id: m
    adapters: [sql-lora]
    buckets: [{id: all, groups: {plain: {policy: {type: power_of_two}}}}]
`, a.URL(), a.URL(), b.URL(), b.URL()))
		g, gwSrv := startGateway(t, "--config="+path, "--tokenize=false")
		require.Eventually(t, func() bool {
			for _, e := range engs {
				l, ok := g.table.Snapshot().Load(state.EngineID(e.URL()))
				if !ok || l.LoRA == nil {
					return false
				}
			}
			return true
		}, 20*time.Second, 5*time.Millisecond, "the residency is polled")

		resp := post(t, context.Background(), gwSrv.URL+"/v1/completions", `{"model":"sql-lora","prompt":"hello"}`, nil)
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		require.Equal(t, http.StatusOK, resp.StatusCode)
		got := [2]int{len(a.Requests()), len(b.Requests())}
		want := [2]int{}
		want[holder] = 1
		assert.Equal(t, want, got, "holder %d: the request went to the engine running the adapter", holder)
		sent := append(a.Requests(), b.Requests()...)
		require.Len(t, sent, 1)
		assert.JSONEq(t, `"sql-lora"`, string(sent[0].Body["model"]), "the adapter's name is forwarded as the model")

		resp, err := http.Get(gwSrv.URL + "/v1/models")
		require.NoError(t, err)
		var models struct {
			Data []struct{ ID, Parent string } `json:"data"`
		}
		require.NoError(t, json.NewDecoder(resp.Body).Decode(&models))
		resp.Body.Close()
		require.Len(t, models.Data, 2)
		assert.Equal(t, "m", models.Data[0].ID)
		assert.Equal(t, []string{"sql-lora", "m"}, []string{models.Data[1].ID, models.Data[1].Parent})
	}
}
