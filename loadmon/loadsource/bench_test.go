package loadsource_test

import (
	"fmt"
	"strings"
	"testing"

	"github.com/enginepick/enginepick/loadmon/loadsource"
)

// vllmHistograms are the latency and size histograms a vLLM V1 /metrics page carries per engine
// core (vllm-project/vllm vllm/v1/metrics/loggers.py), which the parser must read past.
var vllmHistograms = []string{
	"time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
	"request_queue_time_seconds", "request_inference_time_seconds", "request_prefill_time_seconds",
	"request_decode_time_seconds", "request_prompt_tokens", "request_generation_tokens",
	"request_params_max_tokens", "request_params_n", "iteration_tokens_total", "request_time_per_output_token_seconds",
}

// realisticVLLMPage builds a vLLM V1 page for the given number of DP ranks: the load gauges, the
// cache info series, 6 counters and 13 histograms of 20 buckets per rank (about 60 KiB per rank,
// the size of a real page).
func realisticVLLMPage(ranks int) string {
	var b strings.Builder
	gauge := func(name string, v func(r int) string) {
		fmt.Fprintf(&b, "# HELP vllm:%s help text.\n# TYPE vllm:%s gauge\n", name, name)
		for r := range ranks {
			fmt.Fprintf(&b, "vllm:%s{engine=\"%d\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} %s\n", name, r, v(r))
		}
	}
	gauge("num_requests_running", func(r int) string { return fmt.Sprintf("%d.0", 10+r) })
	gauge("num_requests_waiting", func(r int) string { return fmt.Sprintf("%d.0", r) })
	gauge("kv_cache_usage_perc", func(r int) string { return "0.4375" })
	b.WriteString("# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n# TYPE vllm:cache_config_info gauge\n")
	for r := range ranks {
		fmt.Fprintf(&b, "vllm:cache_config_info{block_size=\"16\",cache_dtype=\"auto\",calculate_kv_scales=\"False\",cpu_offload_gb=\"0\",enable_prefix_caching=\"True\",engine=\"%d\",gpu_memory_utilization=\"0.9\",is_attention_free=\"False\",num_cpu_blocks=\"None\",num_gpu_blocks=\"27000\",prefix_caching_hash_algo=\"sha256\",sliding_window=\"None\",swap_space=\"4\"} 1.0\n", r)
	}
	for _, c := range []string{"prompt_tokens_total", "generation_tokens_total", "num_preemptions_total", "prefix_cache_queries_total", "prefix_cache_hits_total", "request_success_total"} {
		fmt.Fprintf(&b, "# HELP vllm:%s help text.\n# TYPE vllm:%s counter\n", c, c)
		for r := range ranks {
			fmt.Fprintf(&b, "vllm:%s{engine=\"%d\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} 1.234567e+06\n", c, r)
		}
	}
	for _, h := range vllmHistograms {
		fmt.Fprintf(&b, "# HELP vllm:%s help text.\n# TYPE vllm:%s histogram\n", h, h)
		for r := range ranks {
			n := 0
			for i := range 20 {
				n += i
				fmt.Fprintf(&b, "vllm:%s_bucket{engine=\"%d\",le=\"%g\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} %d.0\n", h, r, 0.001*float64(int(1)<<i), n)
			}
			fmt.Fprintf(&b, "vllm:%s_bucket{engine=\"%d\",le=\"+Inf\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} %d.0\n", h, r, n)
			fmt.Fprintf(&b, "vllm:%s_count{engine=\"%d\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} %d.0\n", h, r, n)
			fmt.Fprintf(&b, "vllm:%s_sum{engine=\"%d\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"} 123.456\n", h, r)
		}
	}
	return b.String()
}

func sglangGetLoadBody(ranks int) string {
	parts := make([]string, ranks)
	for r := range ranks {
		parts[r] = fmt.Sprintf(`{"dp_rank": %d, "num_reqs": %d, "num_waiting_reqs": %d, "num_tokens": 123456, "num_pending_tokens": 0, "ts_tic": 1234.5}`, r, 40+r, r)
	}
	return "[" + strings.Join(parts, ", ") + "]"
}

func sglangLoadsBody(ranks int) string {
	parts := make([]string, ranks)
	for r := range ranks {
		parts[r] = fmt.Sprintf(`{"dp_rank": %d, "timestamp": 1.0, "num_running_reqs": %d, "num_waiting_reqs": %d, "num_waiting_uncached_tokens": 900,
 "num_total_reqs": 7, "num_used_tokens": 5000, "num_total_tokens": 9000, "max_total_num_tokens": 100000, "token_usage": 0.05,
 "gen_throughput": 120.5, "cache_hit_rate": 0.3, "utilization": 0.75, "max_running_requests": 256,
 "memory": {"weight_gb": 15.0, "kv_cache_gb": 40.0, "graph_gb": 1.0, "token_capacity": 100000},
 "queues": {"waiting": 2, "grammar": 0, "paused": 0, "retracted": 0}}`, r, 40+r, r)
	}
	return `{"timestamp": "2026-01-15T10:30:00+00:00", "version": "0.5.9", "dp_rank_count": ` + fmt.Sprint(ranks) +
		`, "loads": [` + strings.Join(parts, ", ") + `], "aggregate": {"total_running_reqs": 6}}`
}

// BenchmarkParse measures one poll's parse cost per format and DP rank count.
func BenchmarkParse(b *testing.B) {
	for _, ranks := range []int{1, 8} {
		for _, c := range []struct {
			format loadsource.Format
			body   string
		}{
			{loadsource.FormatVLLMMetrics, realisticVLLMPage(ranks)},
			{loadsource.FormatSGLangGetLoad, sglangGetLoadBody(ranks)},
			{loadsource.FormatSGLangLoads, sglangLoadsBody(ranks)},
		} {
			body := []byte(c.body)
			page, err := loadsource.Parse(c.format, "e", body)
			if err != nil || len(page.Reports) != ranks {
				b.Fatalf("%v ranks=%d: %d reports, %v", c.format, ranks, len(page.Reports), err)
			}
			b.Run(fmt.Sprintf("%v/ranks=%d", c.format, ranks), func(b *testing.B) {
				b.ReportAllocs()
				b.SetBytes(int64(len(body)))
				for b.Loop() {
					if _, err := loadsource.Parse(c.format, "e", body); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}
