package kvindex

// MatchTokensInto lets the external tests (scale_test.go) measure and check matchTokensInto.
func (x *Index) MatchTokensInto(tokens []uint32, m *Matches) { x.matchTokensInto(tokens, m) }
