package loadsource_test

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/loadmon/loadsource"
	"github.com/enginepick/enginepick/state"
)

// vllmPage is a trimmed vLLM V1 /metrics page for two DP ranks (engine="0", engine="1"), with
// the families routing reads and a few it ignores (a histogram, a counter), as vLLM prints them.
const vllmPage = `# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 5.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",engine="0",num_gpu_blocks="1000",num_cpu_blocks="None"} 1.0
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",engine="1",num_gpu_blocks="2000",num_cpu_blocks="None"} 1.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 12345.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="m"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 7.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 7.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 1.5
`

func TestParseVLLMMetricsReadsEveryRank(t *testing.T) {
	t.Parallel()
	page, err := loadsource.Parse(loadsource.FormatVLLMMetrics, "http://v", []byte(vllmPage))
	require.NoError(t, err)
	assert.Equal(t, uint64(16), page.BlockTokens)
	assert.Equal(t, []loadmon.Report{
		{Engine: "http://v", DPRank: 0, RunningRequests: 3, WaitingRequests: 2, UsedKVTokens: 4000, KVCapacityTokens: 16000},
		{Engine: "http://v", DPRank: 1, RunningRequests: 5, WaitingRequests: 0, UsedKVTokens: 16000, KVCapacityTokens: 32000},
	}, page.Reports)
}

func TestParseVLLMMetricsVariants(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name  string
		page  string
		want  []loadmon.Report
		block uint64
	}{
		{
			// vLLM before V1 (and single-engine pages) carry no engine label: rank 0.
			name: "no_engine_label_is_rank_0",
			page: "vllm:num_requests_running{model_name=\"m\"} 1\nvllm:num_requests_waiting{model_name=\"m\"} 4\n",
			want: []loadmon.Report{{Engine: "e", RunningRequests: 1, WaitingRequests: 4}},
		},
		{
			// The deprecated name is read only when the new one is absent.
			name: "deprecated_usage_name_fallback",
			page: "vllm:num_requests_running 1\nvllm:num_requests_waiting 0\nvllm:gpu_cache_usage_perc 0.5\n" +
				"vllm:cache_config_info{block_size=\"32\",num_gpu_blocks=\"10\"} 1\n",
			want:  []loadmon.Report{{Engine: "e", RunningRequests: 1, UsedKVTokens: 160, KVCapacityTokens: 320}},
			block: 32,
		},
		{
			name: "new_usage_name_wins",
			page: "vllm:num_requests_running 1\nvllm:num_requests_waiting 0\nvllm:gpu_cache_usage_perc 0.5\nvllm:kv_cache_usage_perc 0.25\n" +
				"vllm:cache_config_info{block_size=\"32\",num_gpu_blocks=\"10\"} 1\n",
			want:  []loadmon.Report{{Engine: "e", RunningRequests: 1, UsedKVTokens: 80, KVCapacityTokens: 320}},
			block: 32,
		},
		{
			// num_gpu_blocks="None" (not yet profiled): capacity unknown, so used stays unknown too.
			name:  "unknown_capacity",
			page:  "vllm:num_requests_running 2\nvllm:num_requests_waiting 1\nvllm:kv_cache_usage_perc 0.5\nvllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"None\"} 1\n",
			want:  []loadmon.Report{{Engine: "e", RunningRequests: 2, WaitingRequests: 1}},
			block: 16,
		},
		{
			// Capacity known but no usage series: both stay unknown rather than claiming an empty cache.
			name:  "no_usage_series",
			page:  "vllm:num_requests_running 2\nvllm:num_requests_waiting 1\nvllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"8\"} 1\n",
			want:  []loadmon.Report{{Engine: "e", RunningRequests: 2, WaitingRequests: 1}},
			block: 16,
		},
		{
			name: "untyped_samples",
			page: "# TYPE vllm:num_requests_running untyped\nvllm:num_requests_running{engine=\"0\"} 7\nvllm:num_requests_waiting{engine=\"0\"} 8\n",
			want: []loadmon.Report{{Engine: "e", RunningRequests: 7, WaitingRequests: 8}},
		},
		{
			name: "full_usage",
			page: "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 1\nvllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"3\"} 1\n",
			want: []loadmon.Report{{Engine: "e", UsedKVTokens: 48, KVCapacityTokens: 48}}, block: 16,
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			page, err := loadsource.Parse(loadsource.FormatVLLMMetrics, "e", []byte(tc.page))
			require.NoError(t, err)
			assert.Equal(t, tc.want, page.Reports)
			assert.Equal(t, tc.block, page.BlockTokens)
		})
	}
}

func TestParseVLLMMetricsRejectsBadValues(t *testing.T) {
	t.Parallel()
	const ok = "vllm:num_requests_running{engine=\"0\"} 1\nvllm:num_requests_waiting{engine=\"0\"} 1\n"
	cases := []struct {
		name, page, field string
	}{
		{"not_prometheus_text", "{\"running\": 1}", ""},
		{"truncated_line", "vllm:num_requests_running{engine=\"0\"", ""},
		{"running_series_missing", "vllm:num_requests_waiting 1\n", "vllm:num_requests_running"},
		{"waiting_missing_for_a_rank", ok + "vllm:num_requests_running{engine=\"1\"} 1\n", "vllm:num_requests_waiting"},
		{"running_missing_for_a_rank", ok + "vllm:num_requests_waiting{engine=\"1\"} 1\n", "vllm:num_requests_running"},
		{"usage_names_an_unknown_rank", ok + "vllm:kv_cache_usage_perc{engine=\"1\"} 0.1\n", "vllm:num_requests_running"},
		{"nan_running", "vllm:num_requests_running NaN\nvllm:num_requests_waiting 1\n", "vllm:num_requests_running"},
		{"inf_waiting", "vllm:num_requests_running 1\nvllm:num_requests_waiting +Inf\n", "vllm:num_requests_waiting"},
		{"negative_waiting", "vllm:num_requests_running 1\nvllm:num_requests_waiting -1\n", "vllm:num_requests_waiting"},
		{"fractional_running", "vllm:num_requests_running 1.5\nvllm:num_requests_waiting 1\n", "vllm:num_requests_running"},
		{"huge_running", "vllm:num_requests_running 1e300\nvllm:num_requests_waiting 1\n", "vllm:num_requests_running"},
		{"nan_usage", ok + "vllm:kv_cache_usage_perc{engine=\"0\"} NaN\n", "vllm:kv_cache_usage_perc"},
		{"negative_usage", ok + "vllm:kv_cache_usage_perc{engine=\"0\"} -0.1\n", "vllm:kv_cache_usage_perc"},
		{"usage_above_one", ok + "vllm:kv_cache_usage_perc{engine=\"0\"} 1.5\n", "vllm:kv_cache_usage_perc"},
		{"rank_label_not_a_number", "vllm:num_requests_running{engine=\"a\"} 1\nvllm:num_requests_waiting{engine=\"a\"} 1\n", "vllm:num_requests_running"},
		{"rank_label_too_large", "vllm:num_requests_running{engine=\"4096\"} 1\nvllm:num_requests_waiting{engine=\"4096\"} 1\n", "vllm:num_requests_running"},
		{"rank_twice", ok + "vllm:num_requests_running{engine=\"0\",model_name=\"other\"} 1\n", "vllm:num_requests_running"},
		{"histogram_as_running", "# TYPE vllm:num_requests_running histogram\nvllm:num_requests_running_bucket{le=\"+Inf\"} 1\nvllm:num_requests_running_count 1\nvllm:num_requests_running_sum 1\nvllm:num_requests_waiting 1\n", "vllm:num_requests_running"},
		{"bad_block_size", ok + "vllm:cache_config_info{engine=\"0\",block_size=\"x\",num_gpu_blocks=\"1\"} 1\n", "vllm:cache_config_info"},
		{"cache_config_twice", ok + "vllm:cache_config_info{engine=\"0\",block_size=\"16\"} 1\nvllm:cache_config_info{engine=\"0\",block_size=\"32\",x=\"y\"} 1\n", "vllm:cache_config_info"},
		{"block_sizes_disagree", ok + "vllm:num_requests_running{engine=\"1\"} 1\nvllm:num_requests_waiting{engine=\"1\"} 1\n" +
			"vllm:cache_config_info{engine=\"0\",block_size=\"16\"} 1\nvllm:cache_config_info{engine=\"1\",block_size=\"32\"} 1\n", "vllm:cache_config_info"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			page, err := loadsource.Parse(loadsource.FormatVLLMMetrics, "e", []byte(tc.page))
			require.Error(t, err, "page:\n%s", tc.page)
			assert.ErrorIs(t, err, loadsource.ErrMalformed)
			var pe *loadsource.PageError
			require.True(t, errors.As(err, &pe))
			assert.Equal(t, tc.field, pe.Field, "error: %v", err)
			assert.Equal(t, state.EngineID("e"), pe.Engine)
			assert.Equal(t, loadsource.FormatVLLMMetrics, pe.Format)
			assert.Empty(t, page.Reports, "a rejected page yields no report")
		})
	}
}

func TestParseSGLangGetLoad(t *testing.T) {
	t.Parallel()
	// num_reqs counts running and waiting together; num_tokens is not KV usage and is ignored.
	body := `[{"dp_rank": 1, "num_reqs": 9, "num_waiting_reqs": 4, "num_tokens": 1234, "ts_tic": 1.5},
	          {"dp_rank": 0, "num_reqs": 2, "num_waiting_reqs": 0, "num_pages": 7, "extra": {"x": 1}}]`
	page, err := loadsource.Parse(loadsource.FormatSGLangGetLoad, "s", []byte(body))
	require.NoError(t, err)
	assert.Equal(t, []loadmon.Report{
		{Engine: "s", DPRank: 0, RunningRequests: 2, WaitingRequests: 0},
		{Engine: "s", DPRank: 1, RunningRequests: 5, WaitingRequests: 4},
	}, page.Reports)

	page, err = loadsource.Parse(loadsource.FormatSGLangGetLoad, "s", []byte(`[{"dp_rank": null, "num_reqs": 1.0, "num_waiting_reqs": 1}]`))
	require.NoError(t, err, "a null rank is rank 0 and 1.0 is a whole count")
	assert.Equal(t, []loadmon.Report{{Engine: "s", WaitingRequests: 1}}, page.Reports)
}

func TestParseSGLangGetLoadRejectsBadValues(t *testing.T) {
	t.Parallel()
	cases := []struct{ name, body, field string }{
		{"not_json", `running=1`, ""},
		{"object_not_array", `{"num_reqs": 1, "num_waiting_reqs": 0}`, ""},
		{"empty", `[]`, ""},
		{"nan", `[{"num_reqs": NaN, "num_waiting_reqs": 0}]`, ""},
		{"num_reqs_missing", `[{"dp_rank": 0, "num_waiting_reqs": 0}]`, "num_reqs"},
		{"num_waiting_null", `[{"dp_rank": 0, "num_reqs": 1, "num_waiting_reqs": null}]`, "num_waiting_reqs"},
		{"negative", `[{"num_reqs": -1, "num_waiting_reqs": 0}]`, "num_reqs"},
		{"fractional", `[{"num_reqs": 1.5, "num_waiting_reqs": 0}]`, "num_reqs"},
		{"string_count", `[{"num_reqs": 1, "num_waiting_reqs": "0"}]`, "num_waiting_reqs"},
		{"waiting_above_total", `[{"num_reqs": 1, "num_waiting_reqs": 2}]`, "num_waiting_reqs"},
		{"negative_rank", `[{"dp_rank": -1, "num_reqs": 1, "num_waiting_reqs": 0}]`, "dp_rank"},
		{"rank_twice", `[{"dp_rank": 0, "num_reqs": 1, "num_waiting_reqs": 0}, {"num_reqs": 1, "num_waiting_reqs": 0}]`, "dp_rank"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			page, err := loadsource.Parse(loadsource.FormatSGLangGetLoad, "s", []byte(tc.body))
			require.ErrorIs(t, err, loadsource.ErrMalformed)
			var pe *loadsource.PageError
			require.True(t, errors.As(err, &pe))
			assert.Equal(t, tc.field, pe.Field, "error: %v", err)
			assert.Empty(t, page.Reports)
		})
	}
}

// sglangLoads is a /v1/loads body as sgl-project/sglang python/sglang/srt/entrypoints/v1_loads.py
// writes it, for two DP ranks.
const sglangLoads = `{
  "timestamp": "2026-01-15T10:30:00+00:00", "version": "0.5.9", "dp_rank_count": 2,
  "loads": [
    {"dp_rank": 0, "timestamp": 1.0, "num_running_reqs": 5, "num_waiting_reqs": 2, "num_waiting_uncached_tokens": 900,
     "num_total_reqs": 7, "num_used_tokens": 5000, "num_total_tokens": 9000, "max_total_num_tokens": 100000,
     "token_usage": 0.05, "gen_throughput": 120.5, "cache_hit_rate": 0.3, "utilization": 0.75, "max_running_requests": 256,
     "memory": {"weight_gb": 15.0, "kv_cache_gb": 40.0, "graph_gb": 1.0, "token_capacity": 100000}},
    {"dp_rank": 1, "timestamp": 1.0, "num_running_reqs": 1, "num_waiting_reqs": 0, "num_waiting_uncached_tokens": 0,
     "num_total_reqs": 1, "num_used_tokens": 100, "num_total_tokens": 100, "max_total_num_tokens": 100000,
     "token_usage": 0.001, "gen_throughput": 10.0, "cache_hit_rate": 0.0, "utilization": 0.1, "max_running_requests": 256}
  ],
  "aggregate": {"total_running_reqs": 6, "total_waiting_reqs": 2}
}`

func TestParseSGLangLoads(t *testing.T) {
	t.Parallel()
	page, err := loadsource.Parse(loadsource.FormatSGLangLoads, "s", []byte(sglangLoads))
	require.NoError(t, err)
	assert.Equal(t, []loadmon.Report{
		{Engine: "s", DPRank: 0, RunningRequests: 5, WaitingRequests: 2, UsedKVTokens: 5000, KVCapacityTokens: 100000,
			Native: &loadmon.NativeLoad{WaitingUncachedTokens: 900, MaxRunningRequests: 256}},
		{Engine: "s", DPRank: 1, RunningRequests: 1, UsedKVTokens: 100, KVCapacityTokens: 100000,
			Native: &loadmon.NativeLoad{MaxRunningRequests: 256}},
	}, page.Reports)
}

func TestParseSGLangLoadsOptionalFields(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name, entry string
		want        loadmon.Report
	}{
		{"core_only", `"num_running_reqs": 3, "num_waiting_reqs": 1`,
			loadmon.Report{Engine: "s", RunningRequests: 3, WaitingRequests: 1}},
		{"kv_without_uncached_is_not_native", `"num_running_reqs": 3, "num_waiting_reqs": 1, "num_used_tokens": 10, "max_total_num_tokens": 20, "max_running_requests": 8`,
			loadmon.Report{Engine: "s", RunningRequests: 3, WaitingRequests: 1, UsedKVTokens: 10, KVCapacityTokens: 20}},
		{"zero_running_cap_is_not_native", `"num_running_reqs": 3, "num_waiting_reqs": 1, "num_used_tokens": 10, "max_total_num_tokens": 20, "num_waiting_uncached_tokens": 5, "max_running_requests": 0`,
			loadmon.Report{Engine: "s", RunningRequests: 3, WaitingRequests: 1, UsedKVTokens: 10, KVCapacityTokens: 20}},
		{"used_without_capacity_is_unknown", `"num_running_reqs": 3, "num_waiting_reqs": 1, "num_used_tokens": 10, "num_waiting_uncached_tokens": 5, "max_running_requests": 8`,
			loadmon.Report{Engine: "s", RunningRequests: 3, WaitingRequests: 1}},
		{"zero_capacity_is_unknown", `"num_running_reqs": 3, "num_waiting_reqs": 1, "num_used_tokens": 0, "max_total_num_tokens": 0`,
			loadmon.Report{Engine: "s", RunningRequests: 3, WaitingRequests: 1}},
		{"nulls_are_absent", `"dp_rank": null, "num_running_reqs": 3, "num_waiting_reqs": 1, "num_used_tokens": null, "max_total_num_tokens": 20`,
			loadmon.Report{Engine: "s", RunningRequests: 3, WaitingRequests: 1}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			page, err := loadsource.Parse(loadsource.FormatSGLangLoads, "s", []byte(`{"loads": [{`+tc.entry+`}]}`))
			require.NoError(t, err)
			assert.Equal(t, []loadmon.Report{tc.want}, page.Reports)
		})
	}
}

func TestParseSGLangLoadsRejectsBadValues(t *testing.T) {
	t.Parallel()
	cases := []struct{ name, body, field string }{
		{"not_json", `<html>`, ""},
		{"array_not_object", `[{"num_running_reqs": 1, "num_waiting_reqs": 0}]`, ""},
		{"loads_missing", `{"dp_rank_count": 1}`, "loads"},
		{"loads_empty", `{"loads": []}`, "loads"},
		{"running_missing", `{"loads": [{"num_waiting_reqs": 0}]}`, "num_running_reqs"},
		{"waiting_missing", `{"loads": [{"num_running_reqs": 0}]}`, "num_waiting_reqs"},
		{"negative_waiting", `{"loads": [{"num_running_reqs": 0, "num_waiting_reqs": -3}]}`, "num_waiting_reqs"},
		{"fractional_used", `{"loads": [{"num_running_reqs": 0, "num_waiting_reqs": 0, "num_used_tokens": 0.5, "max_total_num_tokens": 1}]}`, "num_used_tokens"},
		{"negative_capacity", `{"loads": [{"num_running_reqs": 0, "num_waiting_reqs": 0, "max_total_num_tokens": -1}]}`, "max_total_num_tokens"},
		{"used_above_capacity", `{"loads": [{"num_running_reqs": 0, "num_waiting_reqs": 0, "num_used_tokens": 11, "max_total_num_tokens": 10}]}`, "num_used_tokens"},
		{"overflow", `{"loads": [{"num_running_reqs": 18446744073709551616, "num_waiting_reqs": 0}]}`, "num_running_reqs"},
		{"rank_twice", `{"loads": [{"dp_rank": 1, "num_running_reqs": 0, "num_waiting_reqs": 0}, {"dp_rank": 1, "num_running_reqs": 0, "num_waiting_reqs": 0}]}`, "dp_rank"},
		{"rank_fractional", `{"loads": [{"dp_rank": 0.5, "num_running_reqs": 0, "num_waiting_reqs": 0}]}`, "dp_rank"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			page, err := loadsource.Parse(loadsource.FormatSGLangLoads, "s", []byte(tc.body))
			require.ErrorIs(t, err, loadsource.ErrMalformed)
			var pe *loadsource.PageError
			require.True(t, errors.As(err, &pe))
			assert.Equal(t, tc.field, pe.Field, "error: %v", err)
			assert.Empty(t, page.Reports)
		})
	}
}

func TestFormatNamesAndParse(t *testing.T) {
	t.Parallel()
	for _, f := range []loadsource.Format{loadsource.FormatVLLMMetrics, loadsource.FormatSGLangGetLoad, loadsource.FormatSGLangLoads} {
		got, err := loadsource.ParseFormat(f.String())
		require.NoError(t, err)
		assert.Equal(t, f, got)
		assert.True(t, strings.HasPrefix(f.Path(), "/"))
	}
	assert.Equal(t, "/metrics", loadsource.FormatVLLMMetrics.Path())
	assert.Equal(t, "/get_load", loadsource.FormatSGLangGetLoad.Path())
	assert.Equal(t, "/v1/loads", loadsource.FormatSGLangLoads.Path())
	_, err := loadsource.ParseFormat("prometheus")
	assert.ErrorIs(t, err, state.ErrInvalidConfiguration)
	assert.False(t, loadsource.Format(0).Valid())
	assert.Equal(t, "format(9)", loadsource.Format(9).String())
	_, err = loadsource.Parse(loadsource.Format(0), "e", nil)
	assert.ErrorIs(t, err, state.ErrInvalidConfiguration)
	_, err = loadsource.Parse(loadsource.FormatSGLangLoads, "", nil)
	assert.ErrorIs(t, err, state.ErrInvalidConfiguration)
	page, err := loadsource.Parse(loadsource.FormatSGLangGetLoad, "e", []byte(`[{"num_reqs": 1, "num_waiting_reqs": 0}]`))
	require.NoError(t, err)
	assert.Equal(t, []loadmon.Report{{Engine: "e", RunningRequests: 1}}, page.Reports)
}

func ExampleParse() {
	page, err := loadsource.Parse(loadsource.FormatSGLangGetLoad, "http://10.0.0.7:30000",
		[]byte(`[{"dp_rank": 0, "num_reqs": 7, "num_waiting_reqs": 3, "num_tokens": 4096}]`))
	if err != nil {
		fmt.Println(err)
		return
	}
	r := page.Reports[0]
	fmt.Printf("rank %d: running %d, waiting %d\n", r.DPRank, r.RunningRequests, r.WaitingRequests)

	_, err = loadsource.Parse(loadsource.FormatSGLangGetLoad, "http://10.0.0.7:30000", []byte(`[{"dp_rank": 0, "num_reqs": 7}]`))
	fmt.Println(errors.Is(err, loadsource.ErrMalformed))
	// Output:
	// rank 0: running 4, waiting 3
	// true
}
