package loadsource_test

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/loadmon/loadsource"
)

// vllmLoRAPage is a vLLM page with LoRA enabled, as vllm-project/vllm vllm/v1/metrics/loggers.py
// writes it: one vllm:lora_requests_info series per label set it ever had, each set to the time of
// the scheduler step that last had it; the newest (1.7e9+30) is the current state.
const vllmLoRAPage = `# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="4",running_lora_adapters="sql-lora",waiting_lora_adapters=""} 1.70000001e+09
vllm:lora_requests_info{max_lora="4",running_lora_adapters="sql-lora,tenant-a",waiting_lora_adapters="tenant-b"} 1.70000003e+09
vllm:lora_requests_info{max_lora="4",running_lora_adapters="",waiting_lora_adapters=""} 1.70000002e+09
`

func TestParseVLLMLoRA(t *testing.T) {
	t.Parallel()
	base := "vllm:num_requests_running{engine=\"0\"} 1\nvllm:num_requests_waiting{engine=\"0\"} 0\n" +
		"vllm:num_requests_running{engine=\"1\"} 2\nvllm:num_requests_waiting{engine=\"1\"} 0\n"
	two := func(l0, l1 *loadmon.LoRALoad) []loadmon.Report {
		return []loadmon.Report{{Engine: "e", RunningRequests: 1, LoRA: l0}, {Engine: "e", DPRank: 1, RunningRequests: 2, LoRA: l1}}
	}
	cases := []struct {
		name string
		page string
		want []loadmon.Report
	}{
		{"the newest series is current", vllmLoRAPage, []loadmon.Report{{Engine: "e", RunningRequests: 3, WaitingRequests: 1,
			LoRA: &loadmon.LoRALoad{MaxAdapters: 4, Running: []string{"sql-lora", "tenant-a"}, Waiting: []string{"tenant-b"}}}}},
		{"no series: residency unknown", base, two(nil, nil)},
		{"a newest empty series: no adapter in use",
			base + "vllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\"a\",waiting_lora_adapters=\"\"} 10\n" +
				"vllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\"\",waiting_lora_adapters=\"\"} 11\n",
			two(&loadmon.LoRALoad{MaxAdapters: 2}, &loadmon.LoRALoad{MaxAdapters: 2})},
		{"ties merge; spaces and empty entries go",
			base + "vllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\" b, ,a\",waiting_lora_adapters=\"\"} 10\n" +
				"vllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\"c\",waiting_lora_adapters=\"a\"} 10\n",
			two(&loadmon.LoRALoad{MaxAdapters: 2, Running: []string{"a", "b", "c"}, Waiting: []string{"a"}},
				&loadmon.LoRALoad{MaxAdapters: 2, Running: []string{"a", "b", "c"}, Waiting: []string{"a"}})},
		{"an engine label names its rank; the unlabelled series covers the rest",
			base + "vllm:lora_requests_info{engine=\"1\",max_lora=\"3\",running_lora_adapters=\"x\"} 5\n" +
				"vllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\"y\"} 9\n",
			two(&loadmon.LoRALoad{MaxAdapters: 2, Running: []string{"y"}}, &loadmon.LoRALoad{MaxAdapters: 3, Running: []string{"x"}})},
		{"max_lora absent: slots unknown",
			base + "vllm:lora_requests_info{running_lora_adapters=\"x\"} 5\n",
			two(&loadmon.LoRALoad{Running: []string{"x"}}, &loadmon.LoRALoad{Running: []string{"x"}})},
	}
	for _, tc := range cases {
		page, err := loadsource.Parse(loadsource.FormatVLLMMetrics, "e", []byte(tc.page))
		require.NoError(t, err, tc.name)
		assert.Equal(t, tc.want, page.Reports, tc.name)
	}
}

func TestParseVLLMLoRARejectsBadValues(t *testing.T) {
	t.Parallel()
	const ok = "vllm:num_requests_running 1\nvllm:num_requests_waiting 0\n"
	for _, tc := range []struct{ name, page string }{
		{"max_lora not a count", ok + "vllm:lora_requests_info{max_lora=\"x\",running_lora_adapters=\"a\"} 1\n"},
		{"negative max_lora", ok + "vllm:lora_requests_info{max_lora=\"-1\"} 1\n"},
		{"NaN value", ok + "vllm:lora_requests_info{max_lora=\"1\"} NaN\n"},
		{"infinite value", ok + "vllm:lora_requests_info{max_lora=\"1\"} +Inf\n"},
		{"bad rank", ok + "vllm:lora_requests_info{engine=\"x\",max_lora=\"1\"} 1\n"},
	} {
		page, err := loadsource.Parse(loadsource.FormatVLLMMetrics, "e", []byte(tc.page))
		var pe *loadsource.PageError
		require.True(t, errors.As(err, &pe), "%s: error %v", tc.name, err)
		assert.Equal(t, "vllm:lora_requests_info", pe.Field, tc.name)
		assert.Empty(t, page.Reports, tc.name)
	}
}
