package policy_test

import (
	"context"
	"fmt"
	"strings"

	"github.com/enginepick/enginepick/bucket"
	"github.com/enginepick/enginepick/config"
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

// lowestID picks the candidate whose ID sorts first after dropping a configured prefix; its
// configuration block is lowestIDOptions.
type lowestID struct {
	cfg    policy.Config
	prefix string
}

// lowestIDOptions is the lowest_id block: `lowest_id: {trim_prefix: "http://"}`.
type lowestIDOptions struct {
	TrimPrefix string `json:"trim_prefix"`
}

// Validate is called once, when the configuration is validated.
func (o *lowestIDOptions) Validate() error {
	if strings.Contains(o.TrimPrefix, " ") {
		return &policy.OptionError{Policy: "lowest_id", Field: "trim_prefix", Msg: fmt.Sprintf("%q: no spaces", o.TrimPrefix), Cause: state.ErrBadValue}
	}
	return nil
}

func (p *lowestID) Pick(_ context.Context, engines []state.Engine, _ *policy.Request) (policy.Pick, error) {
	if len(engines) == 0 {
		return policy.Pick{}, policy.ErrNoCandidates
	}
	best := engines[0]
	for _, e := range engines[1:] {
		if strings.TrimPrefix(string(e.ID()), p.prefix) < strings.TrimPrefix(string(best.ID()), p.prefix) {
			best = e
		}
	}
	return policy.Pick{Engine: best, Reason: "lowest_id"}, nil
}

// A host registers a policy type of its own, with its own options block, and names it in the
// configuration like a built-in one; a field the block does not have is refused with its path.
func ExampleRegister() {
	err := policy.Register(policy.NewBuilder("lowest_id", func(o *lowestIDOptions, env policy.Env) (policy.Policy, error) {
		return &lowestID{cfg: env.Config, prefix: o.TrimPrefix}, nil
	}))
	fmt.Println("register:", err)

	cfg, err := config.Parse([]byte(`
engines: [{id: "http://b:8000", model: m}, {id: "http://a:8000", model: m}]
models:
  - id: m
    buckets: [{id: all, groups: {plain: {policy: {type: lowest_id, lowest_id: {trim_prefix: "http://"}}}}}]
`))
	if err != nil {
		fmt.Println(err)
		return
	}
	r, err := config.New(cfg, nil, config.WithHealthInterval(0))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer r.Close()
	d, err := r.Select(context.Background(), &bucket.Request{Model: "m", Signals: bucket.Signals{InputTokens: 10}})
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(d.Selection.Plain.Engine.ID(), d.Selection.Plain.Reason)
	d.Release()

	_, err = config.Parse([]byte(`models: [{id: m, buckets: [{id: all, groups: {plain: {policy: {type: lowest_id, lowest_id: {trim: x}}}}}]}]`))
	fmt.Println(err)
	// Output:
	// register: <nil>
	// http://a:8000 lowest_id
	// config: line 1: models[0].buckets[0].groups.plain.policy.lowest_id.trim: unknown field: want one of trim_prefix
}
