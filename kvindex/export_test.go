package kvindex

// Test-only exports for the external tests (scale_test.go), which measure and check the
// allocation-free forms behind Match and LocalSource.Lookup.

// Matches is the working memory matchInto and matchTokensInto fill.
type Matches = matches

// MatchInto is matchInto.
func (x *Index) MatchInto(keys []uint64, m *Matches) { x.matchInto(keys, m) }

// MatchTokensInto is matchTokensInto.
func (x *Index) MatchTokensInto(tokens []uint32, m *Matches) { x.matchTokensInto(tokens, m) }
