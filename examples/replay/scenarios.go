package main

import (
	"flag"
	"fmt"

	"github.com/enginepick/enginepick/sim"
)

// scenarioFlags are the replay's scenario flags, kept apart from the basic ones: a shared system
// prompt in front of every request (-system-prompt), router replicas (-routers) and the engines'
// prefill time model (-prefill-model).
type scenarioFlags struct {
	systemPrompt *int
	routers      *int
	prefillModel *string
}

// addScenarioFlags defines the scenario flags on fs.
func addScenarioFlags(fs *flag.FlagSet) *scenarioFlags {
	return &scenarioFlags{
		systemPrompt: fs.Int("system-prompt", 0, "prepend one shared prompt of N tokens to every request (0: none)"),
		routers: fs.Int("routers", 1, fmt.Sprintf("N independent router replicas (at most %d), requests round-robin over them, "+
			"every engine's events and load reports delivered to all", sim.MaxRouters)),
		prefillModel: fs.String("prefill-model", string(sim.PrefillAttention), fmt.Sprintf(
			"prefill time model: %q (attention over the whole context, cached tokens included) or %q (one rate for uncached tokens, the earlier model)",
			sim.PrefillAttention, sim.PrefillFlat)),
	}
}

// apply sets the scenario fields of cfg. A bad value is a command-line mistake (usage error).
func (s *scenarioFlags) apply(cfg *sim.Config) error {
	if *s.systemPrompt < 0 || *s.systemPrompt > sim.MaxTraceTokens {
		return usage(fmt.Errorf("-system-prompt %d: must be in [0, %d]", *s.systemPrompt, sim.MaxTraceTokens))
	}
	if *s.routers < 1 || *s.routers > sim.MaxRouters {
		return usage(fmt.Errorf("-routers %d: must be in [1, %d]", *s.routers, sim.MaxRouters))
	}
	switch pm := sim.PrefillModel(*s.prefillModel); pm {
	case sim.PrefillAttention, sim.PrefillFlat:
		cfg.Model.PrefillModel = pm
	default:
		return usage(fmt.Errorf("-prefill-model %q: must be %q or %q", *s.prefillModel, sim.PrefillAttention, sim.PrefillFlat))
	}
	cfg.SystemPromptTokens = *s.systemPrompt
	cfg.Routers = *s.routers
	return nil
}
