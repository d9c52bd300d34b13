package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/internal/cputime"
)

// latencies sends n requests to url with the given concurrency and returns each request's
// latency (until the whole body is read), sorted. With stagger > 0, client k starts after
// k × stagger ÷ concurrency, so that the clients' requests are spread over stagger instead of
// arriving in one burst (and, with an engine of constant service time, staying in step).
func latencies(tb testing.TB, client *http.Client, url, body string, n, concurrency int, stagger time.Duration) []time.Duration {
	out := make([]time.Duration, n)
	var wg sync.WaitGroup
	next := make(chan int)
	for k := range concurrency {
		wg.Go(func() {
			time.Sleep(stagger * time.Duration(k) / time.Duration(concurrency))
			for i := range next {
				start := time.Now()
				resp, err := client.Post(url, "application/json", strings.NewReader(body))
				if err != nil {
					tb.Error(err)
					continue
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if resp.StatusCode != http.StatusOK {
					tb.Errorf("status %d", resp.StatusCode)
				}
				out[i] = time.Since(start)
			}
		})
	}
	for i := range n {
		next <- i
	}
	close(next)
	wg.Wait()
	slices.Sort(out)
	return out
}

func pct(d []time.Duration, p float64) time.Duration { return d[int(p*float64(len(d)-1))] }

// BenchmarkGatewayAddedLatency measures the latency the gateway adds in front of a fake engine at
// 200 concurrent requests: each iteration sends n non-streamed chat requests straight to the
// engine and n through the gateway (plain bucket, power_of_two over two engines, load polling on),
// in the same run, and reports both distributions' p50 and p99 and their differences in µs, and
// the process's CPU time per request on each path (cpu-µs/req: clients, gateway and engines are
// all this process, so the difference is the gateway's own cost, whatever CPU share the machine
// gives the process). Variants: an engine that answers at once (the path saturates the CPU: every
// request queues behind the others, and the added latency is the gateway's share of that queue);
// an engine with a 1 s service time (200 requests in flight without saturating the CPU, as with
// real generation; the clients start spread over that second, as independent clients would); prompts tokenized through the engine's /tokenize (a second engine round trip
// per request) or estimated from the body size; and one request at a time (the per-request cost
// without queueing). Targets: added p50 ≤ 200 µs, p99 ≤ 2 ms at 200 concurrent requests.
//
//	go test -run '^$' -bench BenchmarkGatewayAddedLatency -benchtime 3x ./examples/gateway/
func BenchmarkGatewayAddedLatency(b *testing.B) {
	for _, v := range []struct {
		conc, n  int
		tokenize bool
		delay    time.Duration
	}{{200, 4000, false, 0}, {200, 4000, true, 0}, {200, 1000, false, time.Second}, {1, 1000, false, 0}} {
		conc, n, tokenize, delay := v.conc, v.n, v.tokenize, v.delay
		b.Run(fmt.Sprintf("concurrency=%d/tokenize=%v/engine=%v", conc, tokenize, delay), func(b *testing.B) {
			e1, e2 := newEngine(b), newEngine(b)
			for _, e := range []interface{ SetLoad(string) }{e1, e2} {
				e.SetLoad("vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n")
			}
			e1.SetDelay(delay)
			e2.SetDelay(delay)
			_, gwSrv := startGateway(b, "--engine=url="+e1.URL()+",model=m,kind=vllm", "--engine=url="+e2.URL()+",model=m,kind=vllm",
				"--policy=power_of_two", fmt.Sprintf("--tokenize=%v", tokenize))
			client := &http.Client{Transport: &http.Transport{MaxIdleConns: 1000, MaxIdleConnsPerHost: 1000}}
			defer client.CloseIdleConnections()
			body := `{"model":"m","messages":[{"role":"user","content":"Write a haiku about routers."}],"max_tokens":32}`
			warm := min(n, 1000)
			latencies(b, client, e1.URL()+"/v1/chat/completions", body, warm, conc, 0) // warm both paths' connections
			latencies(b, client, gwSrv.URL+"/v1/chat/completions", body, warm, conc, 0)
			var d50, d99, g50, g99, dcpu, gcpu []float64
			for b.Loop() {
				c0 := cputime.Process()
				direct := latencies(b, client, e1.URL()+"/v1/chat/completions", body, n, conc, delay)
				c1 := cputime.Process()
				via := latencies(b, client, gwSrv.URL+"/v1/chat/completions", body, n, conc, delay)
				c2 := cputime.Process()
				d50, d99 = append(d50, us(pct(direct, 0.5))), append(d99, us(pct(direct, 0.99)))
				g50, g99 = append(g50, us(pct(via, 0.5))), append(g99, us(pct(via, 0.99)))
				dcpu, gcpu = append(dcpu, us(c1-c0)/float64(n)), append(gcpu, us(c2-c1)/float64(n))
			}
			m := func(v []float64) float64 { slices.Sort(v); return v[len(v)/2] } // median over iterations
			b.ReportMetric(m(d50), "direct-p50-µs")
			b.ReportMetric(m(d99), "direct-p99-µs")
			b.ReportMetric(m(g50), "gateway-p50-µs")
			b.ReportMetric(m(g99), "gateway-p99-µs")
			b.ReportMetric(m(g50)-m(d50), "added-p50-µs")
			b.ReportMetric(m(g99)-m(d99), "added-p99-µs")
			b.ReportMetric(m(dcpu), "direct-cpu-µs/req")
			b.ReportMetric(m(gcpu), "gateway-cpu-µs/req")
		})
	}
}

func us(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }

// TestLatencyHarness checks the measurement helper on a short run (so the benchmark's code stays
// correct under go test).
func TestLatencyHarness(t *testing.T) {
	t.Parallel()
	e := newEngine(t)
	_, gwSrv := startGateway(t, engineFlag(e, ""), "--policy=round_robin")
	client := &http.Client{}
	got := latencies(t, client, gwSrv.URL+"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"x"}]}`, 40, 8, time.Millisecond)
	require.Len(t, got, 40)
	require.True(t, slices.IsSorted(got))
	require.Positive(t, pct(got, 0.5))
	require.Len(t, e.Requests(), 40)
	_ = context.Background()
}
