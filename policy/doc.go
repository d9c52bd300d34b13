// Package policy chooses one engine from one engine group's candidates. Name a built-in policy in
// the configuration (round_robin, random, power_of_two, power_of_n, least_load, cache_aware,
// session_aware, sticky; Names lists every registered one) or build one with its constructor
// (NewLeastLoad, NewCacheAware, NewSessionAware, NewSticky, NewPowerOfN, NewRoundRobin,
// NewRandom) from a Config; the Router calls its Pick with the Request facts and records the Pick
// it returns.
//
// A policy owns its selection, its within-group fallback, its admission checks and its state
// dependencies, which it receives at construction in a Config (docs/design.md §1). It never chooses
// a bucket, crosses a PD role, or substitutes an engine after admission rejects the one it chose.
// Errors: ErrNoCandidates, ErrAdmissionRejected (*AdmissionRejectedError,
// *NoAdmissibleEngineError), ErrOutsideCandidates and ErrInvalidConfiguration, matched with
// errors.Is.
//
// Every policy type has a Builder, which names it in the configuration, owns its options block
// and builds it from the state a Router shares (Env). A host adds its own with Register and names
// it in the configuration like a built-in one (ExampleRegister; docs/design.md §14.2).
package policy
