package config

import (
	"context"

	"github.com/enginepick/enginepick"
	"github.com/enginepick/enginepick/bucket"
	"github.com/enginepick/enginepick/state"
)

// Select is enginepick.Router.Select with the configuration's LoRA adapter names mapped: a
// request whose Model is one of a model's Adapters and whose Adapter is empty is selected as
// {Model: that model's ID, Adapter: the name}, on that model's buckets (docs/design.md §18). A
// request that sets Adapter is selected as it is. req is not modified. Errors are
// enginepick.Router.Select's.
func (r *Router) Select(ctx context.Context, req *bucket.Request) (*enginepick.Dispatch, error) {
	if req != nil && req.Adapter == "" {
		if base, ok := r.adapters[req.Model]; ok {
			mapped := *req
			mapped.Model, mapped.Adapter = base, string(req.Model)
			req = &mapped
		}
	}
	return r.Router.Select(ctx, req)
}

// adapterBases maps every model's adapter names to the model's ID; nil when no model has
// adapters.
func adapterBases(cfg *Config) map[state.ModelID]state.ModelID {
	var m map[state.ModelID]state.ModelID
	for _, md := range cfg.Models {
		for _, a := range md.Adapters {
			if m == nil {
				m = map[state.ModelID]state.ModelID{}
			}
			m[state.ModelID(a)] = state.ModelID(md.ID)
		}
	}
	return m
}
