package policy_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/enginepick/enginepick/admission"
	"github.com/enginepick/enginepick/affinity"
	"github.com/enginepick/enginepick/internal/label"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

// benchSessions is the number of live sessions in the store during the session benchmarks.
const benchSessions = 100_000

// BenchmarkSessionAware measures a session pick over 64 engines with fresh native reports and an
// in-flight cap, against the memory store on the real clock (every hit moves the binding in the
// expiry B-tree):
//
//   - hit: one of 100,000 bound sessions, cycled (lookup, refresh, admission);
//   - miss: the binding has expired (1 ns idle timeout): lookup, power-of-two, admission, bind;
//   - power_of_two: the keyless baseline, the same policy's fallback alone.
func BenchmarkSessionAware(b *testing.B) {
	e := newEnv()
	cfg := e.cfg()
	cfg.Rand = nil
	cfg.Admission = admission.Limits{MaxInFlightRequests: admission.Cap(1 << 20)}
	cands := manyEngines(64)
	for i, c := range cands {
		e.native(c.ID(), loadmon.Report{WaitingRequests: uint64(i % 5)})
	}
	reqs := make([]policy.Request, benchSessions)
	for i := range reqs {
		reqs[i] = policy.Request{Model: "llama", BucketID: "short", Stage: state.StagePrefill,
			SessionKey: fmt.Sprintf("conversation-%08d", i)}
	}
	build := func(b *testing.B, idle time.Duration) policy.Policy {
		st, err := affinity.NewMemoryStore(affinity.Options{IdleTimeout: idle})
		if err != nil {
			b.Fatal(err)
		}
		p, err := policy.NewSessionAware(cfg, policy.SessionAwareOptions{Store: st})
		if err != nil {
			b.Fatal(err)
		}
		return p
	}
	b.Run("hit", func(b *testing.B) {
		p := build(b, time.Hour)
		for i := range reqs {
			if _, err := p.Pick(ctx, cands, &reqs[i]); err != nil {
				b.Fatal(err)
			}
		}
		b.ReportAllocs()
		i := 0
		for b.Loop() {
			pk, err := p.Pick(ctx, cands, &reqs[i])
			if err != nil || pk.Reason != label.ReasonSessionPrimary {
				b.Fatal(pk.Reason, err)
			}
			if i++; i == len(reqs) {
				i = 0
			}
		}
	})
	b.Run("miss", func(b *testing.B) {
		p := build(b, time.Nanosecond)
		b.ReportAllocs()
		i := 0
		for b.Loop() {
			pk, err := p.Pick(ctx, cands, &reqs[i])
			if err != nil || pk.Reason != label.ReasonAssigned {
				b.Fatal(pk.Reason, err)
			}
			if i++; i == len(reqs) {
				i = 0
			}
		}
	})
	b.Run("power_of_two", func(b *testing.B) {
		p, _ := policy.NewPowerOfN(cfg, 2)
		b.ReportAllocs()
		for b.Loop() {
			if _, err := p.Pick(ctx, cands, &reqs[0]); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// BenchmarkStickyRendezvous measures the stateless sticky pick (xxhash rendezvous over every
// candidate, then one admission check), unbounded and with a 1.25 load factor.
func BenchmarkStickyRendezvous(b *testing.B) {
	for _, n := range []int{16, 64, 256} {
		for _, factor := range []float64{0, 1.25} {
			b.Run(fmt.Sprintf("engines=%d/factor=%v", n, factor), func(b *testing.B) {
				e := newEnv()
				cfg := e.cfg()
				cfg.Admission = admission.Limits{MaxInFlightRequests: admission.Cap(1 << 20)}
				cands := manyEngines(n)
				for i, c := range cands {
					for range i % 4 {
						e.inflight.Acquire(c.ID(), -1, 0)
					}
				}
				p, err := policy.NewSticky(cfg, policy.StickyOptions{Rendezvous: true, LoadFactor: factor})
				if err != nil {
					b.Fatal(err)
				}
				req := &policy.Request{RoutingKey: "conversation-00004711"}
				b.ReportAllocs()
				for b.Loop() {
					if _, err := p.Pick(ctx, cands, req); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}
