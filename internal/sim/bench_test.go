package sim

import (
	"context"
	"fmt"
	"testing"
)

// BenchmarkReplay measures one policy run over the first n requests of the embedded Mooncake
// conversation trace, on 16 plain engines at 4× speed (the default load point of
// examples/replay). b.N counts runs; requests/s is simulated requests per second of wall time.
func BenchmarkReplay(b *testing.B) {
	tr, err := MooncakeConversation()
	if err != nil {
		b.Fatal(err)
	}
	for _, n := range []int{500, 2000} {
		for _, name := range []string{NameRoundRobin, NameCacheAware} {
			b.Run(fmt.Sprintf("requests=%d,policy=%s", n, name), func(b *testing.B) {
				cfg := Config{Trace: tr, Fleet: Fleet{Plain: 16}, Speed: 4, Limit: n, Seed: 1, Policies: []string{name}}
				b.ReportAllocs()
				for b.Loop() {
					if _, err := Replay(context.Background(), cfg); err != nil {
						b.Fatal(err)
					}
				}
				b.ReportMetric(float64(n)*float64(b.N)/b.Elapsed().Seconds(), "requests/s")
			})
		}
	}
}
