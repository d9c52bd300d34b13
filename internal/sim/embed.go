package sim

import (
	"bytes"
	"compress/gzip"
	_ "embed"
	"sync"
)

// mooncakeConversationGz is kvcache-ai/Mooncake `FAST25-release/traces/conversation_trace.jsonl`
// (Apache-2.0; see the module's NOTICE), compressed with gzip -9 -n. Read-only.
//
//go:embed traces/mooncake_conversation.jsonl.gz
var mooncakeConversationGz []byte

// parsedMooncakeConversation parses the embedded trace once; callers get copies.
var parsedMooncakeConversation = sync.OnceValues(func() (*Trace, error) {
	zr, err := gzip.NewReader(bytes.NewReader(mooncakeConversationGz))
	if err != nil {
		return nil, wrapf(err, "embedded mooncake_conversation")
	}
	t, err := ReadMooncake(zr)
	if err != nil {
		return nil, wrapf(err, "embedded mooncake_conversation")
	}
	if err := zr.Close(); err != nil {
		return nil, wrapf(err, "embedded mooncake_conversation")
	}
	t.Name = "mooncake_conversation"
	return t, nil
})

// MooncakeConversation returns the Mooncake conversation trace, embedded in the module: 12,031
// requests over about one hour of a real chat service (Kimi), 512-token prefix blocks, every
// request starting with hash ID 0, a shared system prompt (docs/traces.md; Qin et al.,
// "Mooncake: A KVCache-centric Disaggregated Architecture for LLM Serving", FAST 2025;
// Apache-2.0, see NOTICE). Its Name is "mooncake_conversation" and its Format FormatMooncake.
//
// The embedded file is decompressed and parsed on the first call only (about 3 MB of JSONL);
// every call returns a fresh deep copy (Trace.Clone), which the caller owns and may modify. Safe
// for concurrent use. An error would mean a corrupt build and is returned on every call.
func MooncakeConversation() (*Trace, error) {
	t, err := parsedMooncakeConversation()
	if err != nil {
		return nil, err
	}
	return t.Clone(), nil
}
