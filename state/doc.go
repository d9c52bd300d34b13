// Package state holds the vocabulary every other enginepick package shares: model and engine
// identities, the engine Stage (plain, prefill, decode), the Engine and Registry interfaces, and
// the sentinel errors for invalid input.
//
// Start with Registry: a host implements it over its own engine inventory, or uses
// NewStaticRegistry with NewStaticEngine values (concurrency-safe, for tests and simple hosts).
//
// It is not a service-discovery system: the host's registry is authoritative for role and health,
// and enginepick only reads it. Package state imports nothing else from enginepick.
package state
