package testengine

import (
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/loadmon/loadsource"
	"github.com/enginepick/enginepick/state"
)

// GET /metrics is vLLM's page: the router's vLLM parser reads each rank's running and waiting
// requests, KV usage and cache geometry, and the page holds vLLM's series only.
func TestMetricsAreVLLMs(t *testing.T) {
	e := start(t, Options{Model: "m", DPRanks: 2, BlockSize: 4, NumBlocks: 100, MaxNumSeqs: 1,
		DecodePerToken: 20 * time.Millisecond, KVEvents: KVEventsOptions{Disabled: true}})
	var wg sync.WaitGroup
	for i := range 3 { // rank 1: one running (10 blocks reserved), two waiting
		wg.Go(func() {
			assert.Equal(t, http.StatusOK, postJSON(t, e.URL()+"/v1/completions", idsPrompt(seqIDs(100*i, 19), 20), map[string]string{RankHeader: "1"}, nil))
		})
		require.Eventually(t, func() bool { st := e.Stats(1); return st.Running+st.Waiting == i+1 }, 10*time.Second, time.Millisecond)
	}
	code, body := get(t, e.URL()+"/metrics")
	require.Equal(t, http.StatusOK, code)
	page, err := loadsource.Parse(loadsource.FormatVLLMMetrics, "e", []byte(body))
	require.NoError(t, err)
	assert.Equal(t, uint64(4), page.BlockTokens)
	assert.Equal(t, []loadmon.Report{
		{Engine: state.EngineID("e"), DPRank: 0, KVCapacityTokens: 400},
		{Engine: state.EngineID("e"), DPRank: 1, RunningRequests: 1, WaitingRequests: 2, UsedKVTokens: 40, KVCapacityTokens: 400},
	}, page.Reports)

	parser := expfmt.NewTextParser(model.UTF8Validation)
	families, err := parser.TextToMetricFamilies(strings.NewReader(body))
	require.NoError(t, err)
	var names []string
	for name, mf := range families {
		names = append(names, name)
		for _, m := range mf.GetMetric() {
			labels := map[string]string{}
			for _, lp := range m.GetLabel() {
				labels[lp.GetName()] = lp.GetValue()
			}
			assert.Contains(t, []string{"0", "1"}, labels["engine"], "%s: every series names its rank", name)
			if name != "vllm:cache_config_info" {
				assert.Equal(t, "m", labels["model_name"], name)
			}
		}
	}
	slices.Sort(names)
	assert.Equal(t, []string{"vllm:cache_config_info", "vllm:generation_tokens_total", "vllm:kv_cache_usage_perc",
		"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:prefix_cache_hits_total",
		"vllm:prefix_cache_queries_total", "vllm:prompt_tokens_total"}, names)
	wg.Wait()
}
