// Package bucket turns a request's token-length facts into an ordered list of compatible buckets
// and a bucket into a complete engine selection.
//
// Start with NewEngineGroup (a policy over the healthy engines of a stage, or a fixed
// membership), NewPlainBucket or NewPDBucket (a context range over one group, or a prefill and a
// decode group), and NewResolver (a model's buckets in order); the root Router runs Select over
// them. StatusCode maps a selection error to its HTTP status.
//
// It holds the Resolver (length, context capacity and SLO
// ordering, docs/design.md §2), the Bucket (one plain group, or a prefill and a decode
// group, never mixed), the EngineGroup (model, health, stage and membership filtering, ID sort,
// exact-candidate validation), the bucket loop Select, and the error → HTTP status mapping.
//
// It does not choose engines itself (the policy attached to a group does), and it does not
// dispatch, hold in-flight guards or read load: hosts (or the root Router) do the
// first two after a complete Selection, and policies read their own state.
package bucket
