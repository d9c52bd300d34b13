// Package lora ranks an engine for a request's LoRA adapter by the adapters the engine reports
// (loadmon.LoRALoad), after llm-d's LoRA affinity scorer (kubernetes-sigs/gateway-api-inference-extension
// pkg/epp/scheduling/framework/plugins/scorer/lora_affinity.go: 1.0 when the adapter is active,
// 0.8 when the engine has a free adapter slot, 0.6 when the adapter is waiting, 0 otherwise). It
// is the rule's one implementation, shared by loadmon's pressure comparisons and the policies
// (docs/design.md §18). It knows nothing of load.
package lora

import "slices"

// The classes, worst first: a larger class is preferred.
const (
	// Full: the adapter is neither running nor waiting and every slot is taken: the request
	// waits for a slot, and then evicts an adapter others were using.
	Full = iota
	// Waiting: the adapter's requests wait on the engine, no slot is free.
	Waiting
	// FreeSlot: the engine can load the adapter without evicting one in use.
	FreeSlot
	// Running: the adapter serves requests on the engine now.
	Running
)

// Class returns the class of an engine for adapter, from the adapters of its running and waiting
// requests and its adapter slots (maxAdapters; 0 means unknown). A free slot is fewer distinct
// adapters, running or waiting, than slots (llm-d counts running plus waiting, so an adapter
// both running and waiting takes two; here it takes the one slot it uses). ok is false when the
// class is unknown: an adapter neither running nor waiting on an engine whose slots are unknown.
func Class(adapter string, running, waiting []string, maxAdapters int) (class int, ok bool) {
	switch {
	case slices.Contains(running, adapter):
		return Running, true
	case maxAdapters > 0 && distinct(running, waiting) < maxAdapters:
		return FreeSlot, true
	case slices.Contains(waiting, adapter):
		return Waiting, true
	case maxAdapters > 0:
		return Full, true
	}
	return 0, false
}

// distinct counts the distinct names of a and b together.
func distinct(a, b []string) int {
	n := len(a)
	for i, s := range a {
		if slices.Contains(a[:i], s) {
			n--
		}
	}
	for i, s := range b {
		if !slices.Contains(a, s) && !slices.Contains(b[:i], s) {
			n++
		}
	}
	return n
}

// Union returns the sorted distinct names of every list, nil when there are none.
func Union(lists ...[]string) []string {
	var out []string
	for _, l := range lists {
		out = append(out, l...)
	}
	if len(out) == 0 {
		return nil
	}
	slices.Sort(out)
	return slices.Compact(out)
}
