package bucket

// Advances exposes advances to tests.
var Advances = advances

// ResolveInto exposes resolveInto to tests.
func (r *Resolver) ResolveInto(dst []*Bucket, s Signals) ([]*Bucket, error) {
	return r.resolveInto(dst, s)
}
