package testengine

import (
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestPieces(t *testing.T) {
	for _, tc := range []struct {
		text string
		want []string
	}{
		{"", nil},
		{"Hello, world!", []string{"Hello", ",", " world", "!"}},
		{"a  b\n\nc", []string{"a", "  ", "b", "\n\n", "c"}},
		{"<|user|>\nhi\n<|assistant|>\n", []string{"<|user|>", "\nhi", "\n", "<|assistant|>", "\n"}},
		{"x<y <|bad", []string{"x", "<", "y", " ", "<", "|", "bad"}},
		{"naïve 42é", []string{"naïve", " 42é"}},
		{"\xff\xfe", []string{"\xff", "\xfe"}},
	} {
		assert.Equal(t, tc.want, Pieces(tc.text), "%q", tc.text)
	}
}

// The IDs are stable across runs and releases: the values below were computed once and must not
// change, since routers hash them.
func TestTokenIDsAreStable(t *testing.T) {
	assert.Equal(t, []uint32{TokenID("Hello"), TokenID(","), TokenID(" world"), TokenID("!")}, Tokenize("Hello, world!"))
	for piece, want := range map[string]uint32{"Hello": 0x75b27d44, " world": 0x34d533a9, "<|user|>": 0x7635c25d} {
		assert.Equal(t, want, TokenID(piece), "%q", piece)
	}
}

func TestChatPrompt(t *testing.T) {
	msgs := []Message{{Role: "system", Content: "Be brief."}, {Role: "User", Content: "Hi"}, {Role: "tool-1", Content: ""}}
	assert.Equal(t, "<|system|>\nBe brief.\n<|user|>\nHi\n<|tool|>\n\n<|assistant|>\n", ChatPrompt(msgs, true))
	assert.Equal(t, "<|user|>\nHi\n", ChatPrompt(msgs[1:2], false))
	assert.Equal(t, "<|user|>\nx\n", ChatPrompt([]Message{{Role: "", Content: "x"}}, false), "no role is the user")
}

func TestGenerateIsDeterministic(t *testing.T) {
	a, b := Generate(Tokenize("one prompt"), 20), Generate(Tokenize("one prompt"), 20)
	require.Len(t, a, 20)
	assert.Equal(t, a, b)
	assert.NotEqual(t, a, Generate(Tokenize("another prompt"), 20))
	assert.Equal(t, a[:5], Generate(Tokenize("one prompt"), 5), "a shorter output is a prefix")
	for _, p := range a {
		assert.Equal(t, []string{p}, Pieces(p), "each generated piece is one token")
	}
}

func TestBlockHashesChain(t *testing.T) {
	tokens := Tokenize(words("w", 40))
	h := BlockHashes(tokens, 16)
	require.Len(t, h, 2, "40 tokens: 2 full blocks, the partial third has no hash")
	assert.Equal(t, chainHash(rootHash, tokens[:16]), h[0])
	assert.Equal(t, chainHash(h[0], tokens[16:32]), h[1])
	other := append([]uint32{tokens[0] + 1}, tokens[1:]...)
	h2 := BlockHashes(other, 16)
	assert.NotEqual(t, h[1], h2[1], "a different first block changes every later hash")
	assert.Empty(t, BlockHashes(tokens[:15], 16))
}

// FuzzTokenize: every text splits into pieces that concatenate back to it, each one token with an
// ID below 2^31, the same on every call.
func FuzzTokenize(f *testing.F) {
	for _, s := range []string{"", "Hello, world!", "<|user|>\nhi\n", "a  b\t\tc", "\xff<|", "日本語のテキスト。", "<|a|><|b|>"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, text string) {
		pieces := Pieces(text)
		require.Equal(t, text, strings.Join(pieces, ""))
		ids := Tokenize(text)
		require.Len(t, ids, len(pieces))
		for i, id := range ids {
			require.Less(t, id, uint32(1)<<31)
			require.Equal(t, TokenID(pieces[i]), id)
			require.NotEmpty(t, pieces[i])
		}
		require.Equal(t, ids, Tokenize(text))
		if utf8.ValidString(text) {
			for _, p := range pieces {
				require.True(t, utf8.ValidString(p), "a valid text splits on rune boundaries")
			}
		}
	})
}
