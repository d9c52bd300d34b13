package testengine

import (
	"encoding/binary"
	"regexp"
	"strings"

	"github.com/cespare/xxhash/v2"
)

// pieceRE splits text into tokens, the first alternative that matches winning: a special token
// such as <|user|>; a run of letters or digits with at most one leading whitespace character; one
// other character (but "<") with at most one leading whitespace character; "<"; a run of
// whitespace. Every byte of the text belongs to exactly one piece (invalid UTF-8 bytes are single
// pieces), so the pieces concatenate back to the text.
var pieceRE = regexp.MustCompile(`<\|[a-z_]+\|>|\s?[\p{L}\p{N}]+|\s?[^\s\p{L}\p{N}<]|<|\s+`)

// Pieces returns the tokenizer's pieces of text, in order; they concatenate to text.
func Pieces(text string) []string { return pieceRE.FindAllString(text, -1) }

// TokenID returns the ID of one piece: the low 31 bits of its 64-bit xxHash, so IDs are stable
// across runs and below 2^31.
func TokenID(piece string) uint32 { return uint32(xxhash.Sum64String(piece) & (1<<31 - 1)) }

// Tokenize returns the token IDs of text: the IDs of its Pieces. The same text always gives the
// same IDs; the empty text gives none.
func Tokenize(text string) []uint32 {
	pieces := Pieces(text)
	ids := make([]uint32, len(pieces))
	for i, p := range pieces {
		ids[i] = TokenID(p)
	}
	return ids
}

// Message is one chat message as the chat template reads it.
type Message struct {
	Role    string
	Content string
}

// ChatPrompt applies the engine's chat template: each message as "<|role|>\n" + content + "\n",
// then "<|assistant|>\n" when addGenerationPrompt is set (vLLM's add_generation_prompt, true by
// default on /v1/chat/completions and /tokenize). A role is kept to lower-case letters and
// underscores, so that its tag is one special token.
func ChatPrompt(messages []Message, addGenerationPrompt bool) string {
	var b strings.Builder
	for _, m := range messages {
		b.WriteString("<|" + roleTag(m.Role) + "|>\n")
		b.WriteString(m.Content)
		b.WriteString("\n")
	}
	if addGenerationPrompt {
		b.WriteString("<|assistant|>\n")
	}
	return b.String()
}

func roleTag(role string) string {
	tag := strings.Map(func(r rune) rune {
		switch {
		case r >= 'a' && r <= 'z', r == '_':
			return r
		case r >= 'A' && r <= 'Z':
			return r + ('a' - 'A')
		}
		return -1
	}, role)
	if tag == "" {
		return "user"
	}
	return tag
}

// outputWords are the pieces the engine generates.
var outputWords = strings.Fields(`lorem ipsum dolor sit amet consectetur adipiscing elit sed do
eiusmod tempor incididunt ut labore et dolore magna aliqua enim ad minim veniam quis nostrud
exercitation ullamco laboris nisi aliquip ex ea commodo consequat duis aute irure in
reprehenderit voluptate velit esse cillum fugiat nulla pariatur excepteur sint occaecat cupidatat
non proident sunt culpa qui officia deserunt mollit anim id est laborum`)

// Generate returns the n output pieces the engine generates for a prompt: words with a leading
// space, chosen by a hash of the prompt's tokens and the position, so the same prompt always
// gets the same output. Each piece is one token (TokenID).
func Generate(prompt []uint32, n int) []string {
	d := xxhash.New()
	var b [8]byte
	for _, t := range prompt {
		binary.LittleEndian.PutUint32(b[:4], t)
		_, _ = d.Write(b[:4])
	}
	seed := d.Sum64()
	out := make([]string, n)
	for i := range out {
		binary.LittleEndian.PutUint64(b[:], seed+uint64(i))
		out[i] = " " + outputWords[xxhash.Sum64(b[:])%uint64(len(outputWords))]
	}
	return out
}
