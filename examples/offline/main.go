// Command offline shows how to test a routing decision without any engine running: a static
// registry, hand-written load reports and the real bucket loop. Run it with
//
//	go run ./examples/offline
//
// The same code, as a test with checked output, is in example_test.go.
package main

import (
	"context"
	"fmt"
	"io"
	"os"

	"github.com/enginepick/enginepick"
	"github.com/enginepick/enginepick/admission"
	"github.com/enginepick/enginepick/bucket"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

func main() {
	if err := run(os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "offline:", err)
		os.Exit(1)
	}
}

// run builds a two-bucket PD deployment, feeds it load reports and prints three decisions.
func run(w io.Writer) error {
	const model state.ModelID = "llama-8b"
	reg := &state.StaticRegistry{}
	for _, e := range []struct {
		id    state.EngineID
		stage state.Stage
	}{
		{"http://p-short-0", state.StagePrefill}, {"http://p-short-1", state.StagePrefill},
		{"http://d-short-0", state.StageDecode}, {"http://p-long-0", state.StagePrefill},
		{"http://d-long-0", state.StageDecode},
	} {
		if err := reg.Add(state.NewStaticEngine(e.id, model, e.stage)); err != nil {
			return err
		}
	}

	load := loadmon.NewTable()
	inflight := loadmon.NewInFlight(nil)
	// Hand-written reports: p-short-0 has a long prefill queue, p-short-1 is idle.
	reports := []loadmon.Report{
		{Engine: "http://p-short-0", WaitingRequests: 6, KVCapacityTokens: 500_000,
			Native: &loadmon.NativeLoad{WaitingUncachedTokens: 40_000, MaxRunningRequests: 64}},
		{Engine: "http://p-short-1", WaitingRequests: 0, KVCapacityTokens: 500_000,
			Native: &loadmon.NativeLoad{WaitingUncachedTokens: 0, MaxRunningRequests: 64}},
		{Engine: "http://d-short-0", RunningRequests: 64, KVCapacityTokens: 500_000, UsedKVTokens: 200_000,
			Native: &loadmon.NativeLoad{MaxRunningRequests: 64}},
	}
	for _, r := range reports {
		if err := load.Report(r); err != nil {
			return err
		}
	}

	// power_of_two over the exact minimum of each group (N covers the small groups), with a
	// running-requests cap on decode.
	cfg := policy.Config{Load: load, InFlight: inflight}
	prefillPolicy, err := policy.NewPowerOfN(cfg, 2)
	if err != nil {
		return err
	}
	cfg.Admission = admission.Limits{MaxRunningRequests: admission.Cap(64)}
	decodePolicy, err := policy.NewPowerOfN(cfg, 2)
	if err != nil {
		return err
	}
	group := func(p policy.Policy, members ...state.EngineID) *bucket.EngineGroup {
		g, _ := bucket.NewEngineGroup(p, members)
		return g
	}
	short, err := bucket.NewPDBucket(bucket.Spec{ID: "short", MaxInputTokens: 4096, MaxContextTokens: 8192},
		group(prefillPolicy, "http://p-short-0", "http://p-short-1"), group(decodePolicy, "http://d-short-0"))
	if err != nil {
		return err
	}
	long, err := bucket.NewPDBucket(bucket.Spec{ID: "long", MaxContextTokens: 131072, Rank: 1},
		group(prefillPolicy, "http://p-long-0"), group(decodePolicy, "http://d-long-0"))
	if err != nil {
		return err
	}
	resolver, err := bucket.NewResolver([]*bucket.Bucket{short, long}, bucket.ResolverOptions{})
	if err != nil {
		return err
	}
	router, err := enginepick.NewRouter(enginepick.Options{Registry: reg, Load: load, InFlight: inflight,
		Resolvers: map[state.ModelID]*bucket.Resolver{model: resolver}})
	if err != nil {
		return err
	}

	for _, req := range []struct {
		name       string
		input, out int64
	}{
		{"2k prompt, 1k output", 2048, 1024},
		{"4k prompt, 16k output", 4096, 16384},
		{"200k prompt", 200_000, 0},
	} {
		peak, err := bucket.ExpectedPeak(req.input, req.out)
		if err != nil {
			return err
		}
		d, err := router.Select(context.Background(), &bucket.Request{Model: model,
			Signals: bucket.Signals{InputTokens: req.input, ExpectedPeakTokens: peak, HasExpectedPeak: true}})
		if err != nil {
			fmt.Fprintf(w, "%-22s -> HTTP %d: %v\n", req.name, bucket.StatusCode(err), err)
			continue
		}
		s := d.Selection
		fmt.Fprintf(w, "%-22s -> bucket %s: prefill %s (%s), decode %s (%s)\n", req.name, s.Bucket.ID(),
			s.Prefill.Engine.ID(), s.Prefill.Reason, s.Decode.Engine.ID(), s.Decode.Reason)
		d.Release() // a real host releases when the response stream ends
	}
	return nil
}
