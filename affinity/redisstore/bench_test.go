package redisstore_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/enginepick/enginepick/internal/label"
	"github.com/enginepick/enginepick/policy"
)

// BenchmarkSessionPick measures a SessionAware pick over 16 engines on Redis (one server, and a
// three-master cluster), on loopback: a hit (one of 10,000 bound sessions, cycled) and a new
// session (lookup and bind), against a bare PING as the baseline. It reports Redis round trips per
// pick (roundtrips/op).
func BenchmarkSessionPick(b *testing.B) {
	for _, srv := range servers() {
		b.Run(srv.name, func(b *testing.B) {
			c := srv.client(b)
			cnt := &commandCounter{}
			c.AddHook(cnt)
			st := newStore(b, c, nil, time.Hour)
			p, cands := sessionPolicy(b, st, 16)
			reqs := make([]policy.Request, 10_000)
			for i := range reqs {
				reqs[i] = policy.Request{Model: "m", SessionKey: fmt.Sprintf("conversation-%08d", i)}
				if _, err := p.Pick(bg, cands, &reqs[i]); err != nil {
					b.Fatal(err)
				}
			}
			b.Run("ping", func(b *testing.B) { // the baseline: one bare round trip to a node
				b.ReportAllocs()
				for b.Loop() {
					if err := c.Ping(bg).Err(); err != nil {
						b.Fatal(err)
					}
				}
			})
			b.Run("hit", func(b *testing.B) {
				b.ReportAllocs()
				start := cnt.n.Load()
				i := 0
				for b.Loop() {
					pk, err := p.Pick(bg, cands, &reqs[i])
					if err != nil || pk.Reason != label.ReasonSessionPrimary {
						b.Fatal(pk.Reason, err)
					}
					if i++; i == len(reqs) {
						i = 0
					}
				}
				b.ReportMetric(float64(cnt.n.Load()-start)/float64(b.N), "roundtrips/op")
			})
			b.Run("new", func(b *testing.B) {
				b.ReportAllocs()
				start := cnt.n.Load()
				i := 0
				for b.Loop() {
					req := policy.Request{Model: "m", SessionKey: fmt.Sprintf("new-%d-%d", time.Now().UnixNano(), i)}
					i++
					pk, err := p.Pick(bg, cands, &req)
					if err != nil || pk.Reason != label.ReasonAssigned {
						b.Fatal(pk.Reason, err)
					}
				}
				b.ReportMetric(float64(cnt.n.Load()-start)/float64(b.N), "roundtrips/op")
			})
		})
	}
}
