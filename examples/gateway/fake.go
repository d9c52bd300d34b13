package main

import (
	"fmt"
	"io"

	"github.com/enginepick/enginepick/internal/testengine"
	"github.com/enginepick/enginepick/state"
)

// fakeModel is the model the --fake-engines engines serve.
const fakeModel = "fake"

// maxFakeEngines bounds --fake-engines.
const maxFakeEngines = 64

// startFakeEngines starts o.fakeEngines in-process test engines (internal/testengine: vLLM-like
// servers on loopback, with a prefix cache, /metrics and KV events over ZMQ) and adds each to o as
// an --engine: model "fake", kind vllm, load polled from its /metrics, and, with the cache-aware
// policy, its KV events and replay socket followed, its block size --block-tokens. It prints the
// engines to stdout and returns a function that stops them. --fake-engines with --config,
// --engines-file or --engine, or outside [1, 64], is an error wrapping
// state.ErrInvalidConfiguration.
func startFakeEngines(o *options, stdout io.Writer) (stop func(), err error) {
	if o.config != "" || o.enginesFile != "" || len(o.engines) > 0 {
		return nil, fmt.Errorf("--fake-engines replaces --config, --engines-file and --engine: %w", state.ErrInvalidConfiguration)
	}
	if o.fakeEngines < 1 || o.fakeEngines > maxFakeEngines {
		return nil, fmt.Errorf("--fake-engines %d: want 1 to %d: %w", o.fakeEngines, maxFakeEngines, state.ErrInvalidConfiguration)
	}
	var engines []*testengine.Engine
	stop = func() {
		for _, e := range engines {
			_ = e.Close()
		}
	}
	for i := range o.fakeEngines {
		e, err := testengine.Start(testengine.Options{Model: fakeModel, BlockSize: o.blockTokens})
		if err != nil {
			stop()
			return nil, fmt.Errorf("--fake-engines: %w", err)
		}
		engines = append(engines, e)
		spec := "url=" + e.URL() + ",model=" + fakeModel + ",kind=vllm"
		if o.policy == "cache_aware" {
			spec += ",kv_events=" + e.KVEndpoint(0) + ",kv_replay=" + e.ReplayEndpoint(0)
		}
		o.engines = append(o.engines, spec)
		fmt.Fprintf(stdout, "gateway: fake engine %d (model %q): %s, KV events %s\n", i, fakeModel, e.URL(), e.KVEndpoint(0))
	}
	return stop, nil
}
