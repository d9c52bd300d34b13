// Package admission decides whether one engine may take one more request.
//
// Start with Limits: set the caps you want (Cap(8) for at most 8 waiting requests, say; a nil
// cap is no cap) and pass them as policy.Config.Admission. Limits decodes strictly from JSON and
// YAML, with the field names of its caps; an unknown or invalid field is a *FieldError. A host
// that needs other rules implements Checker.
//
// It holds the per-engine caps of docs/design.md §5, the Metrics they read (engine-reported values that may
// be unknown, plus the always-known router-local in-flight count), and the Checker interface that
// policies call explicitly where their selection algorithm places the check.
//
// Admission never ranks engines, chooses replacements, changes buckets or touches affinity. The
// in-flight cap is held exactly: an admitting Verdict carries it (InFlightCap) and the dispatch is
// counted under it atomically (loadmon.InFlight.TryAcquire). Caps on reported metrics are
// checked against the latest report, so concurrent requests may pass against the same report.
// It is not a rate limiter or a request queue: a rejected request is not held anywhere, the bucket
// loop tries the next bucket.
package admission
