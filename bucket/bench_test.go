package bucket_test

import (
	"fmt"
	"testing"

	"github.com/enginepick/enginepick/admission"
	"github.com/enginepick/enginepick/bucket"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

// benchFleet builds 64 engines per stage with fresh native reports, shuffled in the registry so
// that groups must sort.
func benchFleet(b *testing.B) (*state.StaticRegistry, policy.Config, []state.Engine) {
	b.Helper()
	load := loadmon.NewTable()
	cfg := policy.Config{Load: load, InFlight: loadmon.NewInFlight(nil),
		Admission: admission.Limits{MaxRunningRequests: admission.Cap(1 << 20), MaxInFlightRequests: admission.Cap(1 << 20)}}
	reg := &state.StaticRegistry{}
	var plain []state.Engine
	for _, stage := range []state.Stage{state.StagePlain, state.StagePrefill, state.StageDecode} {
		for i := range 64 {
			j := (i * 37) % 64 // a permutation: registry order is not ID order
			id := state.EngineID(fmt.Sprintf("http://%s-%02d", stage, j))
			e := state.NewStaticEngine(id, "m", stage)
			if err := reg.Add(e); err != nil {
				b.Fatal(err)
			}
			if err := load.Report(loadmon.Report{Engine: id, WaitingRequests: uint64(j % 7), KVCapacityTokens: 1 << 20,
				Native: &loadmon.NativeLoad{MaxRunningRequests: 256, WaitingUncachedTokens: uint64(j * 100)}}); err != nil {
				b.Fatal(err)
			}
			if stage == state.StagePlain {
				plain = append(plain, e)
			}
		}
	}
	return reg, cfg, plain
}

// BenchmarkPowerOfNBare is the baseline: a bare power-of-two pick over 64 sorted candidates.
func BenchmarkPowerOfNBare(b *testing.B) {
	_, cfg, plain := benchFleet(b)
	p, _ := policy.NewPowerOfN(cfg, 2)
	req := &policy.Request{Model: "m", Stage: state.StagePlain}
	b.ReportAllocs()
	for b.Loop() {
		if _, err := p.Pick(ctx, plain, req); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkEngineGroupPick filters 192 registry engines down to 64 of one stage, sorts them and
// runs power-of-two.
func BenchmarkEngineGroupPick(b *testing.B) {
	reg, cfg, _ := benchFleet(b)
	p, _ := policy.NewPowerOfN(cfg, 2)
	for _, members := range []struct {
		name string
		ids  []state.EngineID
	}{{"all", nil}, {"membership32", memberIDs(32)}} {
		b.Run(members.name, func(b *testing.B) {
			g, _ := bucket.NewEngineGroup(p, members.ids)
			req := &policy.Request{Model: "m", Stage: state.StagePlain}
			b.ReportAllocs()
			for b.Loop() {
				if _, err := g.Pick(ctx, reg, req); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

func memberIDs(n int) []state.EngineID {
	out := make([]state.EngineID, n)
	for i := range out {
		out[i] = state.EngineID(fmt.Sprintf("http://plain-%02d", i*2))
	}
	return out
}

// BenchmarkSelect runs the whole bucket loop (resolve + every stage's group pick) for a plain and
// a PD deployment, each with a rejected first bucket variant.
func BenchmarkSelect(b *testing.B) {
	reg, cfg, _ := benchFleet(b)
	p, _ := policy.NewPowerOfN(cfg, 2)
	g, _ := bucket.NewEngineGroup(p, nil)
	plainB, _ := bucket.NewPlainBucket(bucket.Spec{ID: "plain", MaxInputTokens: 8192}, g)
	pdB, _ := bucket.NewPDBucket(bucket.Spec{ID: "pd", MaxInputTokens: 8192}, g, g)
	for _, tc := range []struct {
		name string
		b    *bucket.Bucket
	}{{"plain", plainB}, {"pd", pdB}} {
		b.Run(tc.name, func(b *testing.B) {
			r, _ := bucket.NewResolver([]*bucket.Bucket{tc.b}, bucket.ResolverOptions{})
			req := &bucket.Request{Model: "m", Signals: bucket.Signals{InputTokens: 1000}}
			b.ReportAllocs()
			for b.Loop() {
				if _, err := bucket.Select(ctx, r, reg, req); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
