package loadmon

import "time"

// HasNative exposes hasNative to tests.
func (o *Observation) HasNative() bool { return o.hasNative() }

// TokensTime exposes tokensTime to tests.
func (l *EngineLoad) TokensTime(tokens uint64) time.Duration { return l.tokensTime(tokens) }
