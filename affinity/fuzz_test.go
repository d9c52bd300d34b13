package affinity_test

import (
	"bytes"
	"testing"

	"github.com/enginepick/enginepick/affinity"
	"github.com/enginepick/enginepick/state"
)

// FuzzScopeEncoding checks the no-aliasing rule: two scopes have equal encodings exactly when they
// are equal, whatever separators, digits or NUL bytes their fields hold; and a scope the store
// rejects is rejected by both stores' validation before any state changes.
func FuzzScopeEncoding(f *testing.F) {
	// Seeds: the delimiter cases of the conformance suite.
	f.Add("", "a\x00b", "c", uint8(0), "k", "", "a", "\x00bc", uint8(0), "k")
	f.Add("", "1:a", "", uint8(0), "k", "", "", "1:a", uint8(0), "k")
	f.Add("", "", "", uint8(0), "1:a0k", "1:a", "", "", uint8(0), "k")
	f.Add("s", "m", "b", uint8(1), "k", "s", "m", "b", uint8(2), "k")
	f.Add("s", "m", "b0", uint8(0), "k", "s", "m", "b", uint8(0), "0k")
	f.Fuzz(func(t *testing.T, ns1, m1, b1 string, st1 uint8, k1, ns2, m2, b2 string, st2 uint8, k2 string) {
		s1 := affinity.Scope{Namespace: ns1, Model: state.ModelID(m1), BucketID: b1, Stage: state.Stage(st1 % 3), Key: k1}
		s2 := affinity.Scope{Namespace: ns2, Model: state.ModelID(m2), BucketID: b2, Stage: state.Stage(st2 % 3), Key: k2}
		e1, e2 := s1.AppendEncoded(nil), s2.AppendEncoded(nil)
		if (s1 == s2) != bytes.Equal(e1, e2) {
			t.Fatalf("scopes %+v and %+v: equal %v, encodings equal %v", s1, s2, s1 == s2, bytes.Equal(e1, e2))
		}
		if s1.Validate() != nil {
			return
		}
		st, err := affinity.NewMemoryStore(affinity.Options{})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := st.Bind(bg, s1, "e1"); err != nil {
			t.Fatal(err)
		}
		got, ok, err := st.Lookup(bg, s2)
		if err != nil && s2.Validate() == nil {
			t.Fatal(err)
		}
		if ok != (s1 == s2) || (ok && got != "e1") {
			t.Fatalf("bound %+v, looked up %+v: got %q, %v", s1, s2, got, ok)
		}
	})
}
