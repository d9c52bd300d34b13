// Package sim replays real request traces against simulated engines so routing decisions can be
// measured offline.
//
// It reads the public request traces described in docs/traces.md: Mooncake JSONL
// (arrival time, prompt and output lengths in tokens, and chained 512-token prefix-block IDs) and
// Azure LLM inference CSV (arrival time and lengths only). A Mooncake request turns into
// deterministic synthetic token IDs in which equal block-ID prefixes become equal token prefixes,
// so a prefix-aware router sees exactly the reuse the trace records. The Mooncake conversation
// trace is embedded (see [MooncakeConversation]) so tests and benchmarks need no external file.
// Workload generators ([Chats], [PrefixGroups], [ParseWorkload]) produce synthetic traces of the
// same requests, whose prompts share prefixes token for token.
//
// The package also holds the simulated engines and the replay driver that feed these requests to
// a router and report what it decided.
//
// Its baseline policies (the heuristics of other routers) are measuring sticks for the replay, not
// production policies; the library's policies live in package policy.
//
// It is not a performance-accurate GPU model: simulated engines follow only their documented time
// and cache model, so replay results compare routing policies against each other and say nothing
// absolute about latency on real hardware. The synthetic token IDs carry no text and are not
// meant for a real tokenizer or a real engine.
package sim
