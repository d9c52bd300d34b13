package bucket

import (
	"context"

	"github.com/enginepick/enginepick/state"
)

// Advances exposes advances to tests.
var Advances = advances

// ResolveInto exposes resolveInto to tests.
func (r *Resolver) ResolveInto(dst []*Bucket, s Signals) ([]*Bucket, error) {
	return r.resolveInto(dst, s)
}

// PickEngines exposes pickEngines to tests.
func (b *Bucket) PickEngines(ctx context.Context, registry state.Registry, req *Request) (Selection, error) {
	return b.pickEngines(ctx, registry, req)
}
