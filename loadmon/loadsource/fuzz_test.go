package loadsource_test

import (
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/loadmon/loadsource"
)

// checkPage asserts the parser properties every input must keep: an error is a *PageError
// matching ErrMalformed with no reports; a success yields reports with the engine set, ranks
// ascending, distinct and below loadmon.MaxRanks, used KV within a known capacity, a native
// extension only with a known capacity and running cap, and a table accepts the whole batch.
func checkPage(t *testing.T, format loadsource.Format, body []byte) {
	page, err := loadsource.Parse(format, "e", body)
	if err != nil {
		var pe *loadsource.PageError
		if !errors.As(err, &pe) || !errors.Is(err, loadsource.ErrMalformed) {
			t.Fatalf("Parse(%v, %q) error %v is not a *PageError matching ErrMalformed", format, body, err)
		}
		if len(page.Reports) != 0 || page.BlockTokens != 0 {
			t.Fatalf("Parse(%v, %q) failed but returned %+v", format, body, page)
		}
		return
	}
	if len(page.Reports) == 0 {
		t.Fatalf("Parse(%v, %q) succeeded with no rank", format, body)
	}
	for i, r := range page.Reports {
		if r.Engine != "e" {
			t.Fatalf("report %d engine %q", i, r.Engine)
		}
		if r.DPRank < 0 || r.DPRank >= loadmon.MaxRanks || (i > 0 && r.DPRank <= page.Reports[i-1].DPRank) {
			t.Fatalf("Parse(%v, %q): ranks not ascending, distinct and in range: %+v", format, body, page.Reports)
		}
		if r.KVCapacityTokens == 0 && r.UsedKVTokens != 0 {
			t.Fatalf("Parse(%v, %q): used KV %d with unknown capacity", format, body, r.UsedKVTokens)
		}
		if r.UsedKVTokens > r.KVCapacityTokens {
			t.Fatalf("Parse(%v, %q): used KV %d above capacity %d", format, body, r.UsedKVTokens, r.KVCapacityTokens)
		}
		if r.Native != nil && (r.KVCapacityTokens == 0 || r.Native.MaxRunningRequests == 0) {
			t.Fatalf("Parse(%v, %q): native extension without capacity or running cap: %+v", format, body, r)
		}
		if l := r.LoRA; l != nil {
			for _, name := range append(slices.Clone(l.Running), l.Waiting...) {
				if name == "" || name != strings.TrimSpace(name) || strings.Contains(name, ",") {
					t.Fatalf("Parse(%v, %q): adapter name %q is empty, untrimmed or holds a comma", format, body, name)
				}
			}
			if l.MaxAdapters < 0 {
				t.Fatalf("Parse(%v, %q): negative adapter slots %d", format, body, l.MaxAdapters)
			}
		}
	}
	tab := loadmon.NewTable()
	if err := tab.Expect("e", loadmon.MaxRanks); err != nil {
		t.Fatal(err)
	}
	if err := tab.ReportBatch(page.Reports); err != nil {
		t.Fatalf("Parse(%v, %q) reports rejected by the table: %v", format, body, err)
	}
}

// FuzzParseVLLMMetrics: the corpus under testdata/fuzz/FuzzParseVLLMMetrics holds a full page, a
// page with NaN, negative and fractional values, missing series, and truncated lines.
func FuzzParseVLLMMetrics(f *testing.F) {
	f.Add([]byte(vllmPage))
	f.Add([]byte("vllm:num_requests_running 1\nvllm:num_requests_waiting NaN\n"))
	f.Add([]byte("vllm:num_requests_running{engine=\"0\"} 1\nvllm:num_requests_waiting{engine=\"0\"} -2\nvllm:kv_cache_usage_perc 0.5\n"))
	f.Add([]byte("vllm:num_requests_running{engine=\"1\"} 1\nvllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"None\"} 1\n"))
	// LoRA residency: the newest series wins, ties merge, bad slots and values are refused.
	f.Add([]byte(vllmLoRAPage))
	f.Add([]byte("vllm:num_requests_running 1\nvllm:num_requests_waiting 0\nvllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\" a, ,b\",waiting_lora_adapters=\"\"} 5\nvllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\"c\",waiting_lora_adapters=\"a\"} 5\n"))
	f.Add([]byte("vllm:num_requests_running 1\nvllm:num_requests_waiting 0\nvllm:lora_requests_info{max_lora=\"-1\",running_lora_adapters=\"a\"} 1\n"))
	f.Add([]byte("vllm:num_requests_running 1\nvllm:num_requests_waiting 0\nvllm:lora_requests_info{max_lora=\"1\",engine=\"0\"} NaN\n"))
	f.Fuzz(func(t *testing.T, body []byte) { checkPage(t, loadsource.FormatVLLMMetrics, body) })
}

// FuzzParseSGLangGetLoad: the corpus under testdata/fuzz/FuzzParseSGLangGetLoad holds multi-rank
// arrays, null ranks, missing and negative counts.
func FuzzParseSGLangGetLoad(f *testing.F) {
	f.Add([]byte(`[{"dp_rank": 1, "num_reqs": 9, "num_waiting_reqs": 4, "num_tokens": 1234}, {"dp_rank": 0, "num_reqs": 2, "num_waiting_reqs": 0}]`))
	f.Add([]byte(`[{"dp_rank": null, "num_reqs": 1.0, "num_waiting_reqs": 1}]`))
	f.Add([]byte(`[{"num_reqs": -1, "num_waiting_reqs": 0}]`))
	f.Add([]byte(`[{"dp_rank": 0, "num_reqs": 1}]`))
	f.Fuzz(func(t *testing.T, body []byte) { checkPage(t, loadsource.FormatSGLangGetLoad, body) })
}

// FuzzParseSGLangLoads: the corpus under testdata/fuzz/FuzzParseSGLangLoads holds a full body, a
// native entry, used above capacity and repeated ranks.
func FuzzParseSGLangLoads(f *testing.F) {
	f.Add([]byte(sglangLoads))
	f.Add([]byte(`{"loads": [{"num_running_reqs": 3, "num_waiting_reqs": 1, "num_used_tokens": 10, "max_total_num_tokens": 20, "num_waiting_uncached_tokens": 5, "max_running_requests": 8}]}`))
	f.Add([]byte(`{"loads": [{"num_running_reqs": 0, "num_waiting_reqs": 0, "num_used_tokens": 11, "max_total_num_tokens": 10}]}`))
	f.Add([]byte(`{"loads": [{"dp_rank": 1, "num_running_reqs": 0, "num_waiting_reqs": 0}, {"dp_rank": 1, "num_running_reqs": 0, "num_waiting_reqs": 0}]}`))
	f.Fuzz(func(t *testing.T, body []byte) { checkPage(t, loadsource.FormatSGLangLoads, body) })
}
