package affinity_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/enginepick/enginepick/affinity"
	"github.com/enginepick/enginepick/affinity/affinitytest"
	"github.com/enginepick/enginepick/state"
)

func benchScopes(n int) []affinity.Scope {
	out := make([]affinity.Scope, n)
	for i := range out {
		out[i] = affinity.Scope{Namespace: "session", Model: "llama", BucketID: "short", Stage: state.StagePrefill,
			Key: fmt.Sprintf("conversation-%08d", i)}
	}
	return out
}

// BenchmarkMemoryStore measures the memory store with 100,000 live bindings on the real clock
// (so every hit moves its binding in the expiry B-tree): a hit cycling through all of them, the
// same from every core, and a first bind of a new scope.
func BenchmarkMemoryStore(b *testing.B) {
	scopes := benchScopes(100_000)
	st, err := affinity.NewMemoryStore(affinity.Options{IdleTimeout: time.Hour})
	if err != nil {
		b.Fatal(err)
	}
	for i, s := range scopes {
		if _, err := st.Bind(bg, s, state.EngineID(fmt.Sprintf("http://e%02d", i%64))); err != nil {
			b.Fatal(err)
		}
	}
	b.Run("lookup_hit", func(b *testing.B) {
		b.ReportAllocs()
		i := 0
		for b.Loop() {
			if _, ok, _ := st.Lookup(bg, scopes[i]); !ok {
				b.Fatal("miss")
			}
			if i++; i == len(scopes) {
				i = 0
			}
		}
	})
	b.Run("lookup_hit_parallel", func(b *testing.B) {
		b.ReportAllocs()
		b.RunParallel(func(pb *testing.PB) {
			i := 0
			for pb.Next() {
				if _, ok, _ := st.Lookup(bg, scopes[i]); !ok {
					b.Error("miss")
					return
				}
				if i += 7; i >= len(scopes) {
					i -= len(scopes)
				}
			}
		})
	})
	b.Run("bind_new", func(b *testing.B) {
		fresh := benchScopes(1)[0]
		b.ReportAllocs()
		i := 0
		for b.Loop() {
			fresh.Key = scopes[i%len(scopes)].Key
			fresh.BucketID = "long" // a scope not bound yet the first time round
			if _, err := st.Replace(bg, fresh, "x", "http://e00"); err != nil {
				b.Fatal(err)
			}
			i++
		}
	})
}

// BenchmarkSweep measures a sweep that finds nothing expired among 10,000 and 1,000,000 live
// bindings: it reads each shard's earliest expiry and stops, so its cost does not grow with the
// live bindings.
func BenchmarkSweep(b *testing.B) {
	for _, n := range []int{10_000, 1_000_000} {
		b.Run(fmt.Sprintf("live=%d", n), func(b *testing.B) {
			clk := affinitytest.NewClock()
			st, err := affinity.NewMemoryStore(affinity.Options{Now: clk.Now, IdleTimeout: time.Hour})
			if err != nil {
				b.Fatal(err)
			}
			s := benchScopes(1)[0]
			for i := range n {
				s.Key = fmt.Sprintf("k%d", i)
				if _, err := st.Bind(bg, s, "http://e"); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportAllocs()
			for b.Loop() {
				if st.Sweep() != 0 {
					b.Fatal("swept a live binding")
				}
			}
		})
	}
}
