package testengine

import (
	"strconv"

	"github.com/prometheus/client_golang/prometheus"
)

// The series of GET /metrics: vLLM's names and labels (vllm-project/vllm
// vllm/v1/metrics/loggers.py, PrometheusStatLogger), one sample per DP rank in the engine label
// with the served model in model_name, and vllm:cache_config_info's labels with the cache
// geometry. Only series vLLM itself exports are served.
var (
	metricLabels = []string{"model_name", "engine"}
	runningDesc  = prometheus.NewDesc("vllm:num_requests_running", "Number of requests in model execution batches.", metricLabels, nil)
	waitingDesc  = prometheus.NewDesc("vllm:num_requests_waiting", "Number of requests waiting to be processed.", metricLabels, nil)
	kvUsageDesc  = prometheus.NewDesc("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", metricLabels, nil)
	queriesDesc  = prometheus.NewDesc("vllm:prefix_cache_queries_total", "Prefix cache queries, in terms of number of queried tokens.", metricLabels, nil)
	hitsDesc     = prometheus.NewDesc("vllm:prefix_cache_hits_total", "Prefix cache hits, in terms of number of cached tokens.", metricLabels, nil)
	promptDesc   = prometheus.NewDesc("vllm:prompt_tokens_total", "Number of prefill tokens processed.", metricLabels, nil)
	genDesc      = prometheus.NewDesc("vllm:generation_tokens_total", "Number of generation tokens processed.", metricLabels, nil)
	cacheDesc    = prometheus.NewDesc("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
		[]string{"block_size", "enable_prefix_caching", "engine", "num_gpu_blocks"}, nil)
)

// collector exports the state of a server's ranks at each scrape.
type collector struct {
	opts  *Options
	ranks []*rank
}

func (c collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{runningDesc, waitingDesc, kvUsageDesc, queriesDesc, hitsDesc, promptDesc, genDesc, cacheDesc} {
		ch <- d
	}
}

func (c collector) Collect(ch chan<- prometheus.Metric) {
	o := c.opts
	for _, r := range c.ranks {
		st := r.stats()
		l := []string{o.Model, strconv.Itoa(r.id)}
		gauge := func(d *prometheus.Desc, v float64) {
			ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, l...)
		}
		counter := func(d *prometheus.Desc, v uint64) {
			ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), l...)
		}
		gauge(runningDesc, float64(st.Running))
		gauge(waitingDesc, float64(st.Waiting))
		gauge(kvUsageDesc, float64(st.UsedBlocks)/float64(o.NumBlocks))
		counter(queriesDesc, st.PromptTokens)
		counter(hitsDesc, st.CachedPromptTokens)
		counter(promptDesc, st.PromptTokens)
		counter(genDesc, st.GenerationTokens)
		ch <- prometheus.MustNewConstMetric(cacheDesc, prometheus.GaugeValue, 1,
			strconv.Itoa(o.BlockSize), "True", strconv.Itoa(r.id), strconv.Itoa(o.NumBlocks))
	}
}
