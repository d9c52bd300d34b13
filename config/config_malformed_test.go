package config_test

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/config"
	"github.com/enginepick/enginepick/kvindex"
	"github.com/enginepick/enginepick/state"
)

// malformedCase is one invalid configuration and the exact error it must produce.
type malformedCase struct {
	name   string
	format config.Format
	input  string
	cause  error  // the sentinel the *config.Error wraps
	path   string // config.Error.Path
	msg    string // the whole Error()
}

// aliasBomb expands to 10^8 values through nested YAML aliases.
var aliasBomb = func() string {
	s := "a: &a [x, x, x, x, x, x, x, x, x, x]\n"
	prev := "a"
	for _, n := range []string{"b", "c", "d", "e", "f", "g", "h"} {
		s += n + ": &" + n + " [" + strings.TrimSuffix(strings.Repeat("*"+prev+", ", 10), ", ") + "]\n"
		prev = n
	}
	return s + "models: *h\n"
}()

// plainModel is a valid model prefix the cases extend.
const plainModel = `models:
  - id: m
    buckets:
`

var malformedCases = []malformedCase{
	{name: "empty document", input: "", cause: state.ErrMissingField,
		path: "", msg: `config: empty document: want a mapping with models`},
	{name: "not YAML", input: "models: [\n", cause: state.ErrBadValue,
		path: "", msg: `config: not valid YAML: line 1: did not find expected node content`},
	{name: "not JSON", format: config.FormatJSON, input: `{"models": [}`, cause: state.ErrBadValue,
		path: "", msg: `config: line 1: not valid JSON: invalid character '}' looking for beginning of value`},
	{name: "two YAML documents", input: "models: []\n---\nmodels: []\n", cause: state.ErrBadValue,
		path: "", msg: `config: line 2: more than one YAML document`},
	{name: "root is a list", input: "- models\n", cause: state.ErrBadValue,
		path: "", msg: `config: line 1: the document is a list: want a mapping with models`},
	{name: "unknown top-level field", input: "modles: []\n", cause: state.ErrUnknownField,
		path: "modles", msg: `config: line 1: modles: unknown field: want one of affinity, engines, flow_control, kv, load, models, replicas`},
	{name: "unknown field in JSON names its line", format: config.FormatJSON, input: "{\n  \"models\": [\n    {\"id\": \"m\", \"buckest\": []}\n  ]\n}\n", cause: state.ErrUnknownField,
		path: "models[0].buckest", msg: `config: line 3: models[0].buckest: unknown field: want one of adapters, buckets, default_policy, id, slo, stage_policies`},
	{name: "YAML key set twice", input: "models: []\nmodels: []\n", cause: state.ErrDuplicate,
		path: "models", msg: `config: line 2: models: field set twice`},
	{name: "JSON key set twice", format: config.FormatJSON, input: `{"kv": {"block_tokens": 16, "block_tokens": 32}, "models": []}`, cause: state.ErrDuplicate,
		path: "kv.block_tokens", msg: `config: line 1: kv.block_tokens: field set twice`},
	{name: "custom YAML tag", input: "models: !custom []\n", cause: state.ErrBadValue,
		path: "", msg: `config: line 1: list has tag !custom: want a plain list`},
	{name: "alias expansion bomb", input: aliasBomb, cause: state.ErrBadValue,
		path: "", msg: `config: line 1: document has more than 200000 values`},
	{name: "YAML merge key", input: "base: &b {type: round_robin}\nmodels:\n  - id: m\n    default_policy: {<<: *b}\n", cause: state.ErrBadValue,
		path: "", msg: `config: line 4: YAML merge keys (<<) are not supported: write the fields out, or use default_policy and stage_policies`},
	{name: "nesting too deep", input: "models: " + strings.Repeat("[", 100) + strings.Repeat("]", 100) + "\n", cause: state.ErrBadValue,
		path: "", msg: `config: line 1: document nests deeper than 64 levels`},
	{name: "sticky fallback unknown", input: plainModel + "      - id: a\n        groups: {plain: {policy: {type: sticky, sticky: {fallback: cache_aware}}}}\n", cause: state.ErrBadValue,
		path: "models[0].buckets[0].groups.plain.policy.sticky.fallback", msg: `config: line 5: models[0].buckets[0].groups.plain.policy.sticky.fallback: "cache_aware": want round_robin, random, power_of_two or least_load`},
	{name: "load factor without rendezvous", input: plainModel + "      - id: a\n        groups: {plain: {policy: {type: sticky, sticky: {load_factor: 1.5}}}}\n", cause: state.ErrConflict,
		path: "models[0].buckets[0].groups.plain.policy.sticky.load_factor", msg: `config: line 5: models[0].buckets[0].groups.plain.policy.sticky.load_factor: 1.5: bounds rendezvous hashing, so it needs Rendezvous`},
	{name: "load factor below one", input: plainModel + "      - id: a\n        groups: {plain: {policy: {type: sticky, sticky: {rendezvous: true, load_factor: 0.5}}}}\n", cause: state.ErrOutOfRange,
		path: "models[0].buckets[0].groups.plain.policy.sticky.load_factor", msg: `config: line 5: models[0].buckets[0].groups.plain.policy.sticky.load_factor: 0.5: must be a finite number >= 1`},
	{name: "pressure guard tuning on session_aware", input: plainModel + "      - id: a\n        groups: {plain: {policy: {type: session_aware, cache_aware: {pressure_rel_threshold: 2}}}}\n", cause: state.ErrConflict,
		path: "models[0].buckets[0].groups.plain.policy.cache_aware", msg: `config: line 5: models[0].buckets[0].groups.plain.policy.cache_aware: options for policy type cache_aware, but the type is "session_aware": name the block after the type`},
	{name: "fallback on a policy without one", input: plainModel + "      - id: a\n        groups: {plain: {policy: {type: round_robin, sticky: {fallback: random}}}}\n", cause: state.ErrConflict,
		path: "models[0].buckets[0].groups.plain.policy.sticky", msg: `config: line 5: models[0].buckets[0].groups.plain.policy.sticky: options for policy type sticky, but the type is "round_robin": name the block after the type`},
	{name: "replicas unknown key", input: "replicas: {redis: {addr: 'r:6379'}, chanel: x}\n" + plainModel + "      - {id: a, groups: {plain: {}}}\n", cause: state.ErrUnknownField,
		path: "replicas.chanel", msg: `config: line 1: replicas.chanel: unknown field: want one of channel, flush_interval, lease, redis`},
	{name: "replicas redis unknown key", input: "replicas: {redis: {addrs: ['r:6379']}}\n" + plainModel + "      - {id: a, groups: {plain: {}}}\n", cause: state.ErrUnknownField,
		path: "replicas.redis.addrs", msg: `config: line 1: replicas.redis.addrs: unknown field: want one of addr, db, password`},
	{name: "replicas without a broker", input: "replicas: {channel: x}\n" + plainModel + "      - {id: a, groups: {plain: {}}}\n", cause: state.ErrMissingField,
		path: "replicas.redis.addr", msg: `config: line 1: replicas.redis.addr: replicas need the broker's address (host:port)`},
	{name: "replicas broker without port", input: "replicas:\n  redis: {addr: redis}\n" + plainModel + "      - {id: a, groups: {plain: {}}}\n", cause: state.ErrBadValue,
		path: "replicas.redis.addr", msg: `config: line 2: replicas.redis.addr: "redis": want host:port`},
	{name: "replicas negative database", input: "replicas:\n  redis: {addr: 'r:6379', db: -1}\n" + plainModel + "      - {id: a, groups: {plain: {}}}\n", cause: state.ErrOutOfRange,
		path: "replicas.redis.db", msg: `config: line 2: replicas.redis.db: -1 is negative`},
	{name: "replicas negative lease", input: "replicas: {redis: {addr: 'r:6379'}, lease: -1s}\n" + plainModel + "      - {id: a, groups: {plain: {}}}\n", cause: state.ErrOutOfRange,
		path: "replicas.lease", msg: `config: line 1: replicas.lease: -1s is negative`},
	{name: "replicas flush not a duration", input: "replicas: {redis: {addr: 'r:6379'}, flush_interval: 5}\n" + plainModel + "      - {id: a, groups: {plain: {}}}\n", cause: state.ErrBadValue,
		path: "replicas.flush_interval", msg: `config: line 1: replicas.flush_interval: an integer 5: want a duration such as 5s or 250ms`},
	{name: "replicas flush beyond the heartbeat", input: "replicas:\n  redis: {addr: 'r:6379'}\n  lease: 1s\n  flush_interval: 300ms\n" + plainModel + "      - {id: a, groups: {plain: {}}}\n", cause: state.ErrConflict,
		path: "replicas.flush_interval", msg: `config: line 4: replicas.flush_interval: 300ms: at most a quarter of the lease (1s), the heartbeat period`},
	{name: "replicas lease shorter than four default flushes", input: "replicas: {redis: {addr: 'r:6379'}, lease: 10ms}\n" + plainModel + "      - {id: a, groups: {plain: {}}}\n", cause: state.ErrConflict,
		path: "replicas.lease", msg: `config: line 1: replicas.lease: 10ms: at least 4 × flush_interval (5ms, the default)`},
	{name: "replicas flush beyond the default lease's heartbeat", input: "replicas:\n  redis: {addr: 'r:6379'}\n  flush_interval: 600ms\n" + plainModel + "      - {id: a, groups: {plain: {}}}\n", cause: state.ErrConflict,
		path: "replicas.flush_interval", msg: `config: line 3: replicas.flush_interval: 600ms: at most a quarter of the lease (2s, the default), the heartbeat period`},
	{name: "flow control unknown key", input: "flow_control: {max_queue: 10}\n" + plainModel + "      - {id: a, groups: {plain: {}}}\n", cause: state.ErrUnknownField,
		path: "flow_control.max_queue", msg: `config: line 1: flow_control.max_queue: unknown field: want one of bands, flow_weights, half_life, kv_threshold, max_queued, queue_threshold`},
	{name: "flow band unknown key", input: "flow_control:\n  bands:\n    - {priority: 1, shed: true}\n" + plainModel + "      - {id: a, groups: {plain: {}}}\n", cause: state.ErrUnknownField,
		path: "flow_control.bands[0].shed", msg: `config: line 3: flow_control.bands[0].shed: unknown field: want one of max_queued, priority, sheddable, ttl`},
	{name: "flow bands of one priority", input: "flow_control:\n  bands:\n    - {priority: 1}\n    - {priority: 1, sheddable: true}\n" + plainModel + "      - {id: a, groups: {plain: {}}}\n", cause: state.ErrDuplicate,
		path: "flow_control.bands[1].priority", msg: `config: line 4: flow_control.bands[1].priority: duplicate band priority 1 (also flow_control.bands[0])`},
	{name: "empty adapter name", input: plainModel + "      - {id: a, groups: {plain: {}}}\n    adapters: [sql, \"\"]\n", cause: state.ErrMissingField,
		path: "models[0].adapters[1]", msg: `config: line 5: models[0].adapters[1]: an adapter needs a name`},
	{name: "adapter named as a model", input: plainModel + "      - {id: a, groups: {plain: {}}}\n    adapters: [m]\n", cause: state.ErrDuplicate,
		path: "models[0].adapters[0]", msg: `config: line 5: models[0].adapters[0]: adapter "m" is also models[0].id: a request's model names one model or adapter`},
	{name: "adapter of two models", input: plainModel + "      - {id: a, groups: {plain: {}}}\n    adapters: [sql]\n  - id: n\n    adapters: [sql]\n    buckets: [{id: a, groups: {plain: {}}}]\n", cause: state.ErrDuplicate,
		path: "models[1].adapters[0]", msg: `config: line 7: models[1].adapters[0]: adapter "sql" is also models[0].adapters[0]: a request's model names one model or adapter`},
	{name: "adapter ID of no adapter", input: "kv: {adapter_ids: {sqll: 1}}\n" + plainModel + "      - {id: a, groups: {plain: {}}}\n    adapters: [sql]\n", cause: state.ErrBadValue,
		path: "kv.adapter_ids.sqll", msg: `config: line 1: kv.adapter_ids.sqll: "sqll" is not an adapter of any model (models[].adapters)`},
	{name: "negative adapter ID", input: "kv: {adapter_ids: {sql: -1}}\n" + plainModel + "      - {id: a, groups: {plain: {}}}\n    adapters: [sql]\n", cause: state.ErrOutOfRange,
		path: "kv.adapter_ids.sql", msg: `config: line 1: kv.adapter_ids.sql: -1 is negative`},
	{name: "adapter ID twice", input: "kv: {adapter_ids: {a1: 3, a2: 3}}\n" + plainModel + "      - {id: a, groups: {plain: {}}}\n    adapters: [a1, a2]\n", cause: state.ErrDuplicate,
		path: "kv.adapter_ids.a2", msg: `config: line 1: kv.adapter_ids.a2: lora_id 3 is also kv.adapter_ids.a1`},
	{name: "flow band negative TTL", input: "flow_control: {bands: [{priority: 0, ttl: -1s}]}\n" + plainModel + "      - {id: a, groups: {plain: {}}}\n", cause: state.ErrOutOfRange,
		path: "flow_control.bands[0].ttl", msg: `config: line 1: flow_control.bands[0].ttl: -1s is negative`},
	{name: "flow control negative max_queued", input: "flow_control: {max_queued: -1}\n" + plainModel + "      - {id: a, groups: {plain: {}}}\n", cause: state.ErrOutOfRange,
		path: "flow_control.max_queued", msg: `config: line 1: flow_control.max_queued: -1 is negative`},
	{name: "flow control half-life not a duration", input: "flow_control: {half_life: 60}\n" + plainModel + "      - {id: a, groups: {plain: {}}}\n", cause: state.ErrBadValue,
		path: "flow_control.half_life", msg: `config: line 1: flow_control.half_life: an integer 60: want a duration such as 5s or 250ms`},
	{name: "flow control negative KV threshold", input: "flow_control: {kv_threshold: -0.5}\n" + plainModel + "      - {id: a, groups: {plain: {}}}\n", cause: state.ErrOutOfRange,
		path: "flow_control.kv_threshold", msg: `config: line 1: flow_control.kv_threshold: -0.5 is negative`},
	{name: "flow control negative queue threshold", input: "flow_control: {queue_threshold: -1}\n" + plainModel + "      - {id: a, groups: {plain: {}}}\n", cause: state.ErrBadValue,
		path: "flow_control.queue_threshold", msg: `config: line 1: flow_control.queue_threshold: an integer -1: want a non-negative integer`},
	{name: "flow weight zero", input: "flow_control:\n  flow_weights:\n    gold: 4\n    free: 0\n" + plainModel + "      - {id: a, groups: {plain: {}}}\n", cause: state.ErrOutOfRange,
		path: "flow_control.flow_weights.free", msg: `config: line 4: flow_control.flow_weights.free: 0: want a finite weight > 0`},
	{name: "flow weight not a number", input: "flow_control: {flow_weights: {gold: high}}\n" + plainModel + "      - {id: a, groups: {plain: {}}}\n", cause: state.ErrBadValue,
		path: "flow_control.flow_weights.gold", msg: `config: line 1: flow_control.flow_weights.gold: string "high": want a number`},
	{name: "flow weights a list", input: "flow_control: {flow_weights: [gold]}\n" + plainModel + "      - {id: a, groups: {plain: {}}}\n", cause: state.ErrBadValue,
		path: "flow_control.flow_weights", msg: `config: line 1: flow_control.flow_weights: a list: want a mapping`},
	{name: "flow weight set twice in JSON", format: config.FormatJSON, input: `{"flow_control": {"flow_weights": {"gold": 2, "gold": 3}}, "models": []}`, cause: state.ErrDuplicate,
		path: "flow_control.flow_weights.gold", msg: `config: line 1: flow_control.flow_weights.gold: key set twice`},
	{name: "redis store without addresses", input: "affinity: {store: redis}\n" + plainModel + "      - {id: a, groups: {plain: {}}}\n", cause: state.ErrMissingField,
		path: "affinity.redis.addrs", msg: `config: line 1: affinity.redis.addrs: store redis needs at least one Redis address`},
	{name: "redis settings with the memory store", input: "affinity: {redis: {addrs: [\"r:6379\"]}}\n" + plainModel + "      - {id: a, groups: {plain: {}}}\n", cause: state.ErrConflict,
		path: "affinity.redis", msg: `config: line 1: affinity.redis: redis settings need store redis`},
	{name: "redis address without a port", input: "affinity: {store: redis, redis: {addrs: [redis]}}\n" + plainModel + "      - {id: a, groups: {plain: {}}}\n", cause: state.ErrBadValue,
		path: "affinity.redis.addrs[0]", msg: `config: line 1: affinity.redis.addrs[0]: "redis": want host:port`},
	{name: "unknown affinity store", input: "affinity: {store: etcd}\n" + plainModel + "      - {id: a, groups: {plain: {}}}\n", cause: state.ErrBadValue,
		path: "affinity.store", msg: `config: line 1: affinity.store: "etcd": want memory or redis`},
	{name: "KV events without an endpoint", input: "engines: [{id: e1, model: m, kv_events: {topic: kv}}]\n" + plainModel + "      - {id: a, groups: {plain: {}}}\n", cause: state.ErrMissingField,
		path: "engines[0].kv_events.endpoint", msg: `config: line 1: engines[0].kv_events.endpoint: kv_events needs the publisher's endpoint`},
	{name: "KV events on an http URL", input: "engines: [{id: e1, model: m, kv_events: {endpoint: \"http://e1:5557\"}}]\n" + plainModel + "      - {id: a, groups: {plain: {}}}\n", cause: state.ErrBadValue,
		path: "engines[0].kv_events.endpoint", msg: `config: line 1: engines[0].kv_events.endpoint: "http://e1:5557": want tcp://host:port, ipc:// or inproc://`},
	{name: "KV events of several ranks on ipc", input: "engines: [{id: e1, model: m, dp_ranks: 2, kv_events: {endpoint: \"ipc:///tmp/kv\"}}]\n" + plainModel + "      - {id: a, groups: {plain: {}}}\n", cause: state.ErrBadValue,
		path: "engines[0].kv_events.endpoint", msg: `config: line 1: engines[0].kv_events.endpoint: "ipc:///tmp/kv": an engine with several DP ranks needs a tcp://host:port endpoint (rank r publishes on port + r)`},
	{name: "KV event port past 65535", input: "engines: [{id: e1, model: m, dp_ranks: 4, kv_events: {endpoint: \"tcp://e1:5557\", replay: \"tcp://e1:65534\"}}]\n" + plainModel + "      - {id: a, groups: {plain: {}}}\n", cause: state.ErrBadValue,
		path: "engines[0].kv_events.replay", msg: `config: line 1: engines[0].kv_events.replay: "tcp://e1:65534": port 65534 + rank 3 is above 65535`},
	{name: "ranks and an engine load", input: "engines: [{id: e1, model: m, load: {url: \"http://e1/metrics\", format: vllm_metrics}, ranks: [{url: \"http://e1:8000\"}]}]\n" + plainModel + "      - {id: a, groups: {plain: {}}}\n", cause: state.ErrConflict,
		path: "engines[0].load", msg: `config: line 1: engines[0].load: the engine lists ranks: give each rank its load in ranks, not the engine`},
	{name: "ranks and engine KV events", input: "engines: [{id: e1, model: m, kv_events: {endpoint: \"tcp://e1:5557\"}, ranks: [{url: \"http://e1:8000\"}]}]\n" + plainModel + "      - {id: a, groups: {plain: {}}}\n", cause: state.ErrConflict,
		path: "engines[0].kv_events", msg: `config: line 1: engines[0].kv_events: the engine lists ranks: give each rank its kv_events in ranks, not the engine`},
	{name: "dp_ranks disagrees with ranks", input: "engines: [{id: e1, model: m, dp_ranks: 3, ranks: [{url: \"http://e1:8000\"}, {url: \"http://e1:8001\"}]}]\n" + plainModel + "      - {id: a, groups: {plain: {}}}\n", cause: state.ErrConflict,
		path: "engines[0].dp_ranks", msg: `config: line 1: engines[0].dp_ranks: 3, but ranks lists 2 ranks`},
	{name: "negative dp_rank_start", input: "engines: [{id: e1, model: m, dp_rank_start: -1}]\n" + plainModel + "      - {id: a, groups: {plain: {}}}\n", cause: state.ErrOutOfRange,
		path: "engines[0].dp_rank_start", msg: `config: line 1: engines[0].dp_rank_start: -1: must be >= 0`},
	{name: "dp_rank_start past the last rank", input: "engines: [{id: e1, model: m, dp_ranks: 8, dp_rank_start: 1020}]\n" + plainModel + "      - {id: a, groups: {plain: {}}}\n", cause: state.ErrOutOfRange,
		path: "engines[0].dp_rank_start", msg: `config: line 1: engines[0].dp_rank_start: 1020: the engine's global ranks 1020..1027 must be below 1024`},
	{name: "empty rank", input: "engines: [{id: e1, model: m, ranks: [{}, {}]}]\n" + plainModel + "      - {id: a, groups: {plain: {}}}\n", cause: state.ErrMissingField,
		path: "engines[0].ranks[0]", msg: `config: line 1: engines[0].ranks[0]: a rank needs url, load or kv_events (for a rank count alone, use dp_ranks)`},
	{name: "rank without the url of the others", input: "engines: [{id: e1, model: m, ranks: [{url: \"http://e1:8000\"}, {load: {url: \"http://e1:8001/metrics\", format: vllm_metrics}}]}]\n" + plainModel + "      - {id: a, groups: {plain: {}}}\n", cause: state.ErrMissingField,
		path: "engines[0].ranks[1].url", msg: `config: line 1: engines[0].ranks[1].url: ranks[0] has url: every rank needs its own`},
	{name: "rank with a load the others lack", input: "engines: [{id: e1, model: m, ranks: [{url: \"http://e1:8000\"}, {url: \"http://e1:8001\", load: {url: \"http://e1:8001/metrics\", format: vllm_metrics}}]}]\n" + plainModel + "      - {id: a, groups: {plain: {}}}\n", cause: state.ErrConflict,
		path: "engines[0].ranks[1].load", msg: `config: line 1: engines[0].ranks[1].load: ranks[0] has no load: set it for every rank or none`},
	{name: "rank load formats differ", input: "engines: [{id: e1, model: m, ranks: [{load: {url: \"http://e1:8000/metrics\", format: vllm_metrics}}, {load: {url: \"http://e1:8001/v1/loads\", format: sglang_loads}}]}]\n" + plainModel + "      - {id: a, groups: {plain: {}}}\n", cause: state.ErrConflict,
		path: "engines[0].ranks[1].load.format", msg: `config: line 1: engines[0].ranks[1].load.format: "sglang_loads", but ranks[0]'s is "vllm_metrics": one format per engine`},
	{name: "relative rank url", input: "engines: [{id: e1, model: m, ranks: [{url: /r0}]}]\n" + plainModel + "      - {id: a, groups: {plain: {}}}\n", cause: state.ErrBadValue,
		path: "engines[0].ranks[0].url", msg: `config: line 1: engines[0].ranks[0].url: "/r0": want an absolute http or https URL`},
	{name: "rank KV events without an endpoint", input: "engines: [{id: e1, model: m, ranks: [{kv_events: {endpoint: \"tcp://e1:5557\"}}, {kv_events: {topic: kv}}]}]\n" + plainModel + "      - {id: a, groups: {plain: {}}}\n", cause: state.ErrMissingField,
		path: "engines[0].ranks[1].kv_events.endpoint", msg: `config: line 1: engines[0].ranks[1].kv_events.endpoint: kv_events needs the publisher's endpoint`},
	{name: "unknown rank field", input: "engines: [{id: e1, model: m, ranks: [{port: 8000}]}]\n" + plainModel + "      - {id: a, groups: {plain: {}}}\n", cause: state.ErrUnknownField,
		path: "engines[0].ranks[0].port", msg: `config: line 1: engines[0].ranks[0].port: unknown field: want one of kv_events, load, url`},
	{name: "no models", input: "models: []\n", cause: state.ErrMissingField,
		path: "models", msg: `config: line 1: models: at least one model is required`},
	{name: "model without id", input: "models:\n  - buckets: []\n", cause: state.ErrMissingField,
		path: "models[0].id", msg: `config: line 2: models[0].id: a model needs an id`},
	{name: "duplicate model id", input: "models:\n  - id: m\n    buckets: [{id: a, groups: {plain: {}}}]\n  - id: m\n    buckets: [{id: a, groups: {plain: {}}}]\n", cause: state.ErrDuplicate,
		path: "models[1].id", msg: `config: line 4: models[1].id: duplicate model ID "m" (also models[0])`},
	{name: "model without buckets", input: "models:\n  - id: m\n", cause: state.ErrMissingField,
		path: "models[0].buckets", msg: `config: line 2: models[0].buckets: model "m" needs at least one bucket`},
	{name: "bucket without id", input: plainModel + "      - groups: {plain: {}}\n", cause: state.ErrMissingField,
		path: "models[0].buckets[0].id", msg: `config: line 4: models[0].buckets[0].id: a bucket needs an id`},
	{name: "bucket id is a number", input: plainModel + "      - id: 7\n        groups: {plain: {}}\n", cause: state.ErrBadValue,
		path: "models[0].buckets[0].id", msg: `config: line 4: models[0].buckets[0].id: an integer 7: want a string (quote it)`},
	{name: "duplicate bucket id", input: plainModel + "      - {id: a, groups: {plain: {}}}\n      - {id: a, groups: {plain: {}}}\n", cause: state.ErrDuplicate,
		path: "models[0].buckets[1].id", msg: `config: line 5: models[0].buckets[1].id: duplicate bucket ID "a" in model "m" (also models[0].buckets[0])`},
	{name: "negative affinity binding cap", input: "affinity: {max_bindings: -1}\n" + plainModel + "      - {id: a, groups: {plain: {}}}\n", cause: state.ErrOutOfRange,
		path: "affinity.max_bindings", msg: `config: line 1: affinity.max_bindings: -1 is negative`},
	{name: "inverted input range", input: plainModel + "      - id: a\n        limits: {min: 5000, max: 4096}\n        groups: {plain: {}}\n", cause: state.ErrOutOfRange,
		path: "models[0].buckets[0].limits", msg: `config: line 5: models[0].buckets[0].limits: inverted range: min 5000 is above max 4096`},
	{name: "min input above context capacity", input: plainModel + "      - id: a\n        limits: {min: 9000}\n        max_context_tokens: 8192\n        groups: {plain: {}}\n", cause: state.ErrOutOfRange,
		path: "models[0].buckets[0].limits.min", msg: `config: line 5: models[0].buckets[0].limits.min: min 9000 is above max_context_tokens 8192: no request fits`},
	{name: "negative context capacity", input: plainModel + "      - id: a\n        max_context_tokens: -1\n        groups: {plain: {}}\n", cause: state.ErrBadValue,
		path: "models[0].buckets[0].max_context_tokens", msg: `config: line 5: models[0].buckets[0].max_context_tokens: an integer -1: want a non-negative integer`},
	{name: "rank does not fit", input: plainModel + "      - id: a\n        rank: 99999999999999999999\n        groups: {plain: {}}\n", cause: state.ErrOutOfRange,
		path: "models[0].buckets[0].rank", msg: `config: line 5: models[0].buckets[0].rank: 99999999999999999999 does not fit in 64 bits`},
	{name: "TPS estimate is NaN", input: plainModel + "      - id: a\n        tps_estimate: .nan\n        groups: {plain: {}}\n", cause: state.ErrBadValue,
		path: "models[0].buckets[0].tps_estimate", msg: `config: line 5: models[0].buckets[0].tps_estimate: a number NaN: want a finite number`},
	{name: "TTFT estimate is not a duration", input: plainModel + "      - id: a\n        ttft_estimate: 500\n        groups: {plain: {}}\n", cause: state.ErrBadValue,
		path: "models[0].buckets[0].ttft_estimate", msg: `config: line 5: models[0].buckets[0].ttft_estimate: an integer 500: want a duration such as 5s or 250ms`},
	{name: "plain and pd together", input: plainModel + "      - id: a\n        groups: {plain: {}, pd: {prefill: {}, decode: {}}}\n", cause: state.ErrConflict,
		path: "models[0].buckets[0].groups", msg: `config: line 5: models[0].buckets[0].groups: a bucket is plain or PD: set plain or pd, not both`},
	{name: "no group", input: plainModel + "      - id: a\n        groups: {}\n", cause: state.ErrMissingField,
		path: "models[0].buckets[0].groups", msg: `config: line 5: models[0].buckets[0].groups: set plain or pd`},
	{name: "PD bucket without decode", input: plainModel + "      - id: a\n        groups:\n          pd:\n            prefill: {engine_ids: [p1]}\n", cause: state.ErrMissingField,
		path: "models[0].buckets[0].groups.pd.decode", msg: `config: line 6: models[0].buckets[0].groups.pd.decode: a PD bucket needs both a prefill and a decode group`},
	{name: "PD bucket without prefill", input: plainModel + "      - id: a\n        groups:\n          pd:\n            decode: {engine_ids: [d1]}\n", cause: state.ErrMissingField,
		path: "models[0].buckets[0].groups.pd.prefill", msg: `config: line 6: models[0].buckets[0].groups.pd.prefill: a PD bucket needs both a prefill and a decode group`},
	{name: "unknown group field", input: plainModel + "      - id: a\n        groups: {plain: {workers: [e1]}}\n", cause: state.ErrUnknownField,
		path: "models[0].buckets[0].groups.plain.workers", msg: `config: line 5: models[0].buckets[0].groups.plain.workers: unknown field: want one of engine_ids, policy`},
	{name: "engine_ids is not a list", input: plainModel + "      - id: a\n        groups: {plain: {engine_ids: e1}}\n", cause: state.ErrBadValue,
		path: "models[0].buckets[0].groups.plain.engine_ids", msg: `config: line 5: models[0].buckets[0].groups.plain.engine_ids: string "e1": want a list`},
	{name: "empty worker ID", input: plainModel + "      - id: a\n        groups: {plain: {engine_ids: [e1, \"\"]}}\n", cause: state.ErrMissingField,
		path: "models[0].buckets[0].groups.plain.engine_ids[1]", msg: `config: line 5: models[0].buckets[0].groups.plain.engine_ids[1]: empty engine ID`},
	{name: "worker listed twice", input: plainModel + "      - id: a\n        groups: {plain: {engine_ids: [e1, e1]}}\n", cause: state.ErrDuplicate,
		path: "models[0].buckets[0].groups.plain.engine_ids[1]", msg: `config: line 5: models[0].buckets[0].groups.plain.engine_ids[1]: engine "e1" listed twice`},
	{name: "engine in both PD roles", input: plainModel + "      - id: a\n        groups:\n          pd:\n            prefill: {engine_ids: [x, p1]}\n            decode: {engine_ids: [d1, x]}\n", cause: state.ErrWrongStage,
		path: "models[0].buckets[0].groups.pd.decode.engine_ids[1]", msg: `config: line 8: models[0].buckets[0].groups.pd.decode.engine_ids[1]: engine "x" is also a member of the prefill group: an engine has one stage`},
	{name: "policy without type", input: plainModel + "      - id: a\n        groups: {plain: {policy: {admission: {max_running_requests: 8}}}}\n", cause: state.ErrMissingField,
		path: "models[0].buckets[0].groups.plain.policy.type", msg: `config: line 5: models[0].buckets[0].groups.plain.policy.type: want one of cache_aware, least_load, power_of_n, power_of_two, random, round_robin, session_aware, sticky`},
	{name: "unknown policy type", input: plainModel + "      - id: a\n        groups: {plain: {policy: {type: least_loaded}}}\n", cause: state.ErrBadValue,
		path: "models[0].buckets[0].groups.plain.policy.type", msg: `config: line 5: models[0].buckets[0].groups.plain.policy.type: unknown policy type "least_loaded": want one of cache_aware, least_load, power_of_n, power_of_two, random, round_robin, session_aware, sticky`},
	{name: "fused_score removed", input: plainModel + "      - id: a\n        groups: {plain: {policy: {type: fused_score}}}\n", cause: state.ErrRemovedOption,
		path: "models[0].buckets[0].groups.plain.policy.type", msg: `config: line 5: models[0].buckets[0].groups.plain.policy.type: policy type "fused_score" was removed: use cache_aware, which weighs prefix hits against load, instead`},
	{name: "score_policy removed", input: "models:\n  - id: m\n    default_policy: {type: score_policy}\n    buckets: [{id: a, groups: {plain: {}}}]\n", cause: state.ErrRemovedOption,
		path: "models[0].default_policy.type", msg: `config: line 3: models[0].default_policy.type: policy type "score_policy" was removed: use cache_aware, which weighs prefix hits against load, instead`},
	{name: "load_based renamed", input: plainModel + "      - id: a\n        groups: {plain: {policy: {type: load_based}}}\n", cause: state.ErrRemovedOption,
		path: "models[0].buckets[0].groups.plain.policy.type", msg: `config: line 5: models[0].buckets[0].groups.plain.policy.type: policy type "load_based" was renamed least_load: use least_load instead`},
	{name: "load_based fallback renamed", input: plainModel + "      - id: a\n        groups: {plain: {policy: {type: sticky, sticky: {fallback: load_based}}}}\n", cause: state.ErrRemovedOption,
		path: "models[0].buckets[0].groups.plain.policy.sticky.fallback", msg: `config: line 5: models[0].buckets[0].groups.plain.policy.sticky.fallback: fallback "load_based" was renamed least_load: use least_load instead`},
	{name: "worker_ids renamed", input: plainModel + "      - id: a\n        groups: {plain: {worker_ids: [e1]}}\n", cause: state.ErrRemovedOption,
		path: "models[0].buckets[0].groups.plain.worker_ids", msg: `config: line 5: models[0].buckets[0].groups.plain.worker_ids: "worker_ids" was renamed engine_ids: use engine_ids instead`},
	{name: "worker_queue_limit renamed", input: plainModel + "      - id: a\n        groups: {plain: {policy: {type: cache_aware, worker_queue_limit: 4}}}\n", cause: state.ErrRemovedOption,
		path: "models[0].buckets[0].groups.plain.policy.worker_queue_limit", msg: `config: line 5: models[0].buckets[0].groups.plain.policy.worker_queue_limit: "worker_queue_limit" was renamed engine_queue_limit: use engine_queue_limit instead`},
	{name: "fuse terms removed", input: plainModel + "      - id: a\n        groups: {plain: {policy: {type: cache_aware, fuse_terms: [prefix_cache, load_based]}}}\n", cause: state.ErrRemovedOption,
		path: "models[0].buckets[0].groups.plain.policy.fuse_terms", msg: `config: line 5: models[0].buckets[0].groups.plain.policy.fuse_terms: "fuse_terms" was removed with the fused_score policy: use policy type cache_aware instead`},
	{name: "fuse weights removed", input: plainModel + "      - id: a\n        groups: {plain: {policy: {type: cache_aware, fuse_weights: [1, 2]}}}\n", cause: state.ErrRemovedOption,
		path: "models[0].buckets[0].groups.plain.policy.fuse_weights", msg: `config: line 5: models[0].buckets[0].groups.plain.policy.fuse_weights: "fuse_weights" was removed with the fused_score policy: use policy type cache_aware instead`},
	{name: "legacy_host_affinity removed", input: plainModel + "      - id: a\n        groups:\n          pd:\n            prefill: {}\n            decode: {policy: {type: legacy_host_affinity}}\n", cause: state.ErrRemovedOption,
		path: "models[0].buckets[0].groups.pd.decode.policy.type", msg: `config: line 8: models[0].buckets[0].groups.pd.decode.policy.type: policy type "legacy_host_affinity" was removed: use power_of_two on the decode group instead`},
	{name: "stable_pair removed", input: "stable_pair: true\n" + plainModel + "      - {id: a, groups: {plain: {}}}\n", cause: state.ErrRemovedOption,
		path: "stable_pair", msg: `config: line 1: stable_pair: "stable_pair" was removed: both engines of a PD pair always come from one bucket; use policy type session_aware on the prefill and decode groups instead`},
	{name: "soft affinity mode removed", input: "affinity: {affinity_mode: soft}\n" + plainModel + "      - {id: a, groups: {plain: {}}}\n", cause: state.ErrRemovedOption,
		path: "affinity.affinity_mode", msg: `config: line 1: affinity.affinity_mode: affinity mode "soft" was removed: an admitted binding is always reused; use strict (or omit affinity_mode) instead`},
	{name: "unknown affinity mode", input: "affinity: {affinity_mode: global}\n" + plainModel + "      - {id: a, groups: {plain: {}}}\n", cause: state.ErrBadValue,
		path: "affinity.affinity_mode", msg: `config: line 1: affinity.affinity_mode: "global": want strict`},
	{name: "prefix_cache filter removed", input: plainModel + "      - id: a\n        groups: {plain: {policy: {type: round_robin, filter: [overloaded, prefix_cache], max_in_flight: 4}}}\n", cause: state.ErrRemovedOption,
		path: "models[0].buckets[0].groups.plain.policy.filter[1]", msg: `config: line 5: models[0].buckets[0].groups.plain.policy.filter[1]: filter "prefix_cache" was removed: it is not equivalent to cache_aware's hit gate; use policy type cache_aware (with min_matched_tokens or min_match_ratio) instead`},
	{name: "prefix_cache_min_share removed", input: plainModel + "      - id: a\n        groups: {plain: {policy: {type: round_robin, prefix_cache_min_share: 0.5}}}\n", cause: state.ErrRemovedOption,
		path: "models[0].buckets[0].groups.plain.policy.prefix_cache_min_share", msg: `config: line 5: models[0].buckets[0].groups.plain.policy.prefix_cache_min_share: "prefix_cache_min_share" was removed with filter prefix_cache, and cache_aware's gate is not equivalent to it: use policy type cache_aware with min_match_ratio instead`},
	{name: "cache_aware on a decode group", input: plainModel + "      - id: a\n        groups:\n          pd:\n            prefill: {policy: {type: cache_aware}}\n            decode: {policy: {type: cache_aware}}\n", cause: state.ErrWrongStage,
		path: "models[0].buckets[0].groups.pd.decode.policy.type", msg: `config: line 8: models[0].buckets[0].groups.pd.decode.policy.type: "cache_aware" cannot serve the decode stage: use one of least_load, power_of_n, power_of_two, random, round_robin, session_aware, sticky`},
	{name: "decode group inherits cache_aware", input: "models:\n  - id: m\n    default_policy: {type: cache_aware}\n    buckets:\n      - id: a\n        groups: {pd: {prefill: {}, decode: {}}}\n", cause: state.ErrWrongStage,
		path: "models[0].buckets[0].groups.pd.decode", msg: `config: line 6: models[0].buckets[0].groups.pd.decode: the decode group inherits "cache_aware" from models[0].default_policy, which cannot serve the decode stage: set a policy on the group or in stage_policies.decode`},
	{name: "cache_aware as the decode stage default", input: "models:\n  - id: m\n    stage_policies: {decode: {type: cache_aware}}\n    buckets: [{id: a, groups: {plain: {}}}]\n", cause: state.ErrWrongStage,
		path: "models[0].stage_policies.decode.type", msg: `config: line 3: models[0].stage_policies.decode.type: "cache_aware" cannot serve the decode stage: use one of least_load, power_of_n, power_of_two, random, round_robin, session_aware, sticky`},
	{name: "saturation floor without queue limit", input: plainModel + "      - id: a\n        groups: {plain: {policy: {type: cache_aware, cache_aware: {saturation_queue_floor: 2}}}}\n", cause: state.ErrConflict,
		path: "models[0].buckets[0].groups.plain.policy.cache_aware.saturation_queue_floor", msg: `config: line 5: models[0].buckets[0].groups.plain.policy.cache_aware.saturation_queue_floor: 2: requires EngineQueueLimit`},
	{name: "saturation floor above queue limit", input: plainModel + "      - id: a\n        groups: {plain: {policy: {type: cache_aware, cache_aware: {engine_queue_limit: 4, saturation_queue_floor: 5}}}}\n", cause: state.ErrOutOfRange,
		path: "models[0].buckets[0].groups.plain.policy.cache_aware.saturation_queue_floor", msg: `config: line 5: models[0].buckets[0].groups.plain.policy.cache_aware.saturation_queue_floor: 5: must be in [1, 4]`},
	{name: "queue limit zero", input: plainModel + "      - id: a\n        groups: {plain: {policy: {type: cache_aware, cache_aware: {engine_queue_limit: 0}}}}\n", cause: state.ErrOutOfRange,
		path: "models[0].buckets[0].groups.plain.policy.cache_aware.engine_queue_limit", msg: `config: line 5: models[0].buckets[0].groups.plain.policy.cache_aware.engine_queue_limit: 0: must be >= 1`},
	{name: "match ratio above one", input: plainModel + "      - id: a\n        groups: {plain: {policy: {type: cache_aware, cache_aware: {min_match_ratio: 1.5}}}}\n", cause: state.ErrOutOfRange,
		path: "models[0].buckets[0].groups.plain.policy.cache_aware.min_match_ratio", msg: `config: line 5: models[0].buckets[0].groups.plain.policy.cache_aware.min_match_ratio: 1.5: must be in (0, 1]`},
	{name: "candidate max below default min", input: plainModel + "      - id: a\n        groups: {plain: {policy: {type: cache_aware, cache_aware: {candidate_max_engines: 4}}}}\n", cause: state.ErrOutOfRange,
		path: "models[0].buckets[0].groups.plain.policy.cache_aware.candidate_max_engines", msg: `config: line 5: models[0].buckets[0].groups.plain.policy.cache_aware.candidate_max_engines: 4: must be >= CandidateMinEngines`},
	{name: "pressure rel threshold not above one", input: plainModel + "      - id: a\n        groups: {plain: {policy: {type: cache_aware, cache_aware: {pressure_rel_threshold: 1}}}}\n", cause: state.ErrOutOfRange,
		path: "models[0].buckets[0].groups.plain.policy.cache_aware.pressure_rel_threshold", msg: `config: line 5: models[0].buckets[0].groups.plain.policy.cache_aware.pressure_rel_threshold: 1: must be finite and > 1`},
	{name: "pressure tuning with the guard off", input: plainModel + "      - id: a\n        groups: {plain: {policy: {type: cache_aware, cache_aware: {pressure_guard: false, pressure_abs_threshold_tokens: 2048}}}}\n", cause: state.ErrConflict,
		path: "models[0].buckets[0].groups.plain.policy.cache_aware.pressure_abs_threshold_tokens", msg: `config: line 5: models[0].buckets[0].groups.plain.policy.cache_aware.pressure_abs_threshold_tokens: pressure_abs_threshold_tokens tunes what pressure_guard false turns off`},
	{name: "cost tuning with the comparison off", input: plainModel + "      - id: a\n        groups: {plain: {policy: {type: cache_aware, cache_aware: {cost_comparison: false, recompute_factor: 3}}}}\n", cause: state.ErrConflict,
		path: "models[0].buckets[0].groups.plain.policy.cache_aware.recompute_factor", msg: `config: line 5: models[0].buckets[0].groups.plain.policy.cache_aware.recompute_factor: recompute_factor tunes what cost_comparison false turns off`},
	{name: "recompute factor not above zero", input: plainModel + "      - id: a\n        groups: {plain: {policy: {type: cache_aware, cache_aware: {recompute_factor: 0}}}}\n", cause: state.ErrOutOfRange,
		path: "models[0].buckets[0].groups.plain.policy.cache_aware.recompute_factor", msg: `config: line 5: models[0].buckets[0].groups.plain.policy.cache_aware.recompute_factor: 0: out of range (unset means the default)`},
	{name: "route placements on power_of_two", input: plainModel + "      - id: a\n        groups: {plain: {policy: {type: power_of_two, cache_aware: {route_placements: false}}}}\n", cause: state.ErrConflict,
		path: "models[0].buckets[0].groups.plain.policy.cache_aware", msg: `config: line 5: models[0].buckets[0].groups.plain.policy.cache_aware: options for policy type cache_aware, but the type is "power_of_two": name the block after the type`},
	{name: "options for a type without options", input: plainModel + "      - id: a\n        groups: {plain: {policy: {type: power_of_two, power_of_two: {min_matched_tokens: 512}}}}\n", cause: state.ErrUnknownField,
		path: "models[0].buckets[0].groups.plain.policy.power_of_two.min_matched_tokens", msg: `config: line 5: models[0].buckets[0].groups.plain.policy.power_of_two.min_matched_tokens: unknown field: policy type power_of_two takes no options`},
	{name: "a second block for another type", input: plainModel + "      - id: a\n        groups: {plain: {policy: {type: sticky, sticky: {rendezvous: true}, cache_aware: {min_matched_tokens: 512}}}}\n", cause: state.ErrConflict,
		path: "models[0].buckets[0].groups.plain.policy.cache_aware", msg: `config: line 5: models[0].buckets[0].groups.plain.policy.cache_aware: options for policy type cache_aware, but the type is "sticky": name the block after the type`},
	{name: "unknown field in the type's block", input: plainModel + "      - id: a\n        groups: {plain: {policy: {type: power_of_n, power_of_n: {choises: 3}}}}\n", cause: state.ErrUnknownField,
		path: "models[0].buckets[0].groups.plain.policy.power_of_n.choises", msg: `config: line 5: models[0].buckets[0].groups.plain.policy.power_of_n.choises: unknown field: want one of choices`},
	{name: "unknown field in the type's block in JSON", format: config.FormatJSON, input: "{\"models\": [{\"id\": \"m\", \"buckets\": [{\"id\": \"a\", \"groups\": {\"plain\": {\"policy\": {\"type\": \"sticky\",\n  \"sticky\": {\"fallback\": \"random\", \"loadfactor\": 2}}}}}]}]}", cause: state.ErrUnknownField,
		path: "models[0].buckets[0].groups.plain.policy.sticky.loadfactor", msg: `config: line 2: models[0].buckets[0].groups.plain.policy.sticky.loadfactor: unknown field: want one of fallback, fallback_on_unavailable, load_factor, rendezvous`},
	{name: "bad prefix source", input: plainModel + "      - id: a\n        groups: {plain: {policy: {type: cache_aware, cache_aware: {prefix_source: redis}}}}\n", cause: state.ErrBadValue,
		path: "models[0].buckets[0].groups.plain.policy.cache_aware.prefix_source", msg: `config: line 5: models[0].buckets[0].groups.plain.policy.cache_aware.prefix_source: "redis": want local or remote`},
	{name: "power_of_n with zero choices", input: plainModel + "      - id: a\n        groups: {plain: {policy: {type: power_of_n, power_of_n: {choices: 0}}}}\n", cause: state.ErrOutOfRange,
		path: "models[0].buckets[0].groups.plain.policy.power_of_n.choices", msg: `config: line 5: models[0].buckets[0].groups.plain.policy.power_of_n.choices: 0: must be >= 1`},
	{name: "overloaded filter without max_in_flight", input: plainModel + "      - id: a\n        groups: {plain: {policy: {type: round_robin, filter: overloaded}}}\n", cause: state.ErrMissingField,
		path: "models[0].buckets[0].groups.plain.policy.max_in_flight", msg: `config: line 5: models[0].buckets[0].groups.plain.policy.max_in_flight: filter overloaded needs max_in_flight`},
	{name: "max_in_flight without filter", input: plainModel + "      - id: a\n        groups: {plain: {policy: {type: round_robin, max_in_flight: 8}}}\n", cause: state.ErrConflict,
		path: "models[0].buckets[0].groups.plain.policy.max_in_flight", msg: `config: line 5: models[0].buckets[0].groups.plain.policy.max_in_flight: max_in_flight needs filter overloaded; or use admission.max_inflight_requests`},
	{name: "legacy and new in-flight caps together", input: plainModel + "      - id: a\n        groups: {plain: {policy: {type: least_load, filter: overloaded, max_in_flight: 8, admission: {max_inflight_requests: 8}}}}\n", cause: state.ErrConflict,
		path: "models[0].buckets[0].groups.plain.policy.max_in_flight", msg: `config: line 5: models[0].buckets[0].groups.plain.policy.max_in_flight: filter overloaded with max_in_flight is the legacy spelling of admission.max_inflight_requests: set one of them`},
	{name: "unknown filter", input: plainModel + "      - id: a\n        groups: {plain: {policy: {type: round_robin, filter: healthy}}}\n", cause: state.ErrBadValue,
		path: "models[0].buckets[0].groups.plain.policy.filter", msg: `config: line 5: models[0].buckets[0].groups.plain.policy.filter: unknown filter "healthy": want overloaded (with max_in_flight)`},
	{name: "unknown admission limit", input: plainModel + "      - id: a\n        groups: {plain: {policy: {type: round_robin, admission: {max_queue: 8}}}}\n", cause: state.ErrUnknownField,
		path: "models[0].buckets[0].groups.plain.policy.admission.max_queue", msg: `config: line 5: models[0].buckets[0].groups.plain.policy.admission.max_queue: unknown field: want one of max_inflight_requests, max_kv_tokens, max_pending_prefill_tokens, max_running_requests, max_waiting_requests`},
	{name: "negative admission cap", input: plainModel + "      - id: a\n        groups: {plain: {policy: {type: round_robin, admission: {max_kv_tokens: -5}}}}\n", cause: state.ErrBadValue,
		path: "models[0].buckets[0].groups.plain.policy.admission.max_kv_tokens", msg: `config: line 5: models[0].buckets[0].groups.plain.policy.admission.max_kv_tokens: an integer -5: want a non-negative integer`},
	{name: "admission cap as a string", format: config.FormatJSON, input: `{"models": [{"id": "m", "buckets": [{"id": "a", "groups": {"plain": {"policy": {"type": "random", "admission": {"max_running_requests": "64"}}}}}]}]}`, cause: state.ErrBadValue,
		path: "models[0].buckets[0].groups.plain.policy.admission.max_running_requests", msg: `config: line 1: models[0].buckets[0].groups.plain.policy.admission.max_running_requests: string "64": want a non-negative integer`},
	{name: "unknown SLO preference", input: "models:\n  - id: m\n    slo: {ttft_preference: fastest}\n    buckets: [{id: a, groups: {plain: {}}}]\n", cause: state.ErrBadValue,
		path: "models[0].slo.ttft_preference", msg: `config: line 3: models[0].slo.ttft_preference: "fastest": want disabled, best_effort or slo_first`},
	{name: "freshness is not a duration", input: "load: {freshness: 5}\n" + plainModel + "      - {id: a, groups: {plain: {}}}\n", cause: state.ErrBadValue,
		path: "load.freshness", msg: `config: line 1: load.freshness: an integer 5: want a duration such as 5s or 250ms`},
	{name: "negative freshness", input: "load: {freshness: -1s}\n" + plainModel + "      - {id: a, groups: {plain: {}}}\n", cause: state.ErrOutOfRange,
		path: "load.freshness", msg: `config: line 1: load.freshness: -1s is negative`},
	{name: "poll timeout above interval", input: "load: {poll_interval: 200ms}\n" + plainModel + "      - {id: a, groups: {plain: {}}}\n", cause: state.ErrOutOfRange,
		path: "load.poll_timeout", msg: `config: line 1: load.poll_timeout: 500ms is longer than poll_interval 200ms`},
	{name: "block size too large", input: "kv: {block_tokens: 100000}\n" + plainModel + "      - {id: a, groups: {plain: {}}}\n", cause: state.ErrOutOfRange,
		path: "kv.block_tokens", msg: `config: line 1: kv.block_tokens: 100000: must be in [1, 65536] (unset means 16)`},
	{name: "expected blocks above max_blocks", input: "kv: {max_blocks: 1000, expected_blocks: 1001}\n" + plainModel + "      - {id: a, groups: {plain: {}}}\n", cause: state.ErrOutOfRange,
		path: "kv.expected_blocks", msg: `config: line 1: kv.expected_blocks: 1001: must be in [0, max_blocks = 1000]`},
	{name: "expected holder blocks above the default max_blocks", input: "kv: {expected_holder_blocks: 4194305}\n" + plainModel + "      - {id: a, groups: {plain: {}}}\n", cause: state.ErrOutOfRange,
		path: "kv.expected_holder_blocks", msg: `config: line 1: kv.expected_holder_blocks: 4194305: must be in [0, max_blocks = 4194304]`},
	{name: "session header is not a header name", input: "affinity: {session_header: \"x session\"}\n" + plainModel + "      - {id: a, groups: {plain: {}}}\n", cause: state.ErrBadValue,
		path: "affinity.session_header", msg: `config: line 1: affinity.session_header: "x session" is not an HTTP header name`},
	{name: "engine of an unknown model", input: "engines: [{id: e1, model: other}]\n" + plainModel + "      - {id: a, groups: {plain: {}}}\n", cause: state.ErrBadValue,
		path: "engines[0].model", msg: `config: line 1: engines[0].model: model "other" is not one of models`},
	{name: "engine with a bad stage", input: "engines: [{id: e1, model: m, stage: Prefill}]\n" + plainModel + "      - {id: a, groups: {plain: {}}}\n", cause: state.ErrBadValue,
		path: "engines[0].stage", msg: `config: line 1: engines[0].stage: "Prefill": want plain, prefill or decode`},
	{name: "duplicate engine id", input: "engines: [{id: e1, model: m}, {id: e1, model: m}]\n" + plainModel + "      - {id: a, groups: {plain: {}}}\n", cause: state.ErrDuplicate,
		path: "engines[1].id", msg: `config: line 1: engines[1].id: duplicate engine ID "e1" (also engines[0])`},
	{name: "relative load URL", input: "engines: [{id: e1, model: m, load: {url: /metrics, format: vllm_metrics}}]\n" + plainModel + "      - {id: a, groups: {plain: {}}}\n", cause: state.ErrBadValue,
		path: "engines[0].load.url", msg: `config: line 1: engines[0].load.url: "/metrics": want an absolute http or https URL`},
	{name: "unknown load format", input: "engines: [{id: e1, model: m, load: {url: \"http://e1/metrics\", format: prometheus}}]\n" + plainModel + "      - {id: a, groups: {plain: {}}}\n", cause: state.ErrBadValue,
		path: "engines[0].load.format", msg: `config: line 1: engines[0].load.format: "prometheus": want vllm_metrics, sglang_get_load or sglang_loads`},
	{name: "member of the wrong role", input: "engines: [{id: p1, model: m, stage: prefill}, {id: d1, model: m, stage: decode}]\n" + plainModel + "      - id: a\n        groups: {pd: {prefill: {engine_ids: [d1]}, decode: {engine_ids: [p1]}}}\n", cause: state.ErrWrongStage,
		path: "models[0].buckets[0].groups.pd.prefill.engine_ids[0]", msg: `config: line 6: models[0].buckets[0].groups.pd.prefill.engine_ids[0]: engine "d1" is a decode engine, not prefill`},
	{name: "member of another model", input: "engines: [{id: e1, model: m}, {id: e2, model: n}]\nmodels:\n  - {id: m, buckets: [{id: a, groups: {plain: {engine_ids: [e2]}}}]}\n  - {id: n, buckets: [{id: a, groups: {plain: {}}}]}\n", cause: state.ErrWrongStage,
		path: "models[0].buckets[0].groups.plain.engine_ids[0]", msg: `config: line 3: models[0].buckets[0].groups.plain.engine_ids[0]: engine "e2" serves model "n", not "m"`},
}

// TestConfigMalformed checks every malformed configuration's exact error: its cause, its path and
// its whole message (docs/design.md §14.4). Each would be accepted, or rejected with a vaguer
// error, without the rule it names.
func TestConfigMalformed(t *testing.T) {
	t.Parallel()
	require.GreaterOrEqual(t, len(malformedCases), 30)
	names := map[string]bool{}
	for _, tc := range malformedCases {
		require.False(t, names[tc.name], "duplicate case name %q", tc.name)
		names[tc.name] = true
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			cfg, err := config.ParseAs([]byte(tc.input), tc.format)
			require.Error(t, err, "Parse(%q) accepted it", tc.input)
			assert.Nil(t, cfg)
			var ce *config.Error
			require.True(t, errors.As(err, &ce), "Parse = %T %v, want *config.Error", err, err)
			assert.ErrorIs(t, err, tc.cause)
			assert.ErrorIs(t, err, state.ErrInvalidConfiguration)
			assert.Equal(t, tc.path, ce.Path)
			assert.Equal(t, tc.msg, err.Error())
		})
	}
}

// TestKVLimitsAreTheIndexs checks that the kv limits Parse enforces (65,536-token blocks, and a
// default max_blocks of 4,194,304 that bounds expected_blocks) are kvindex's own.
func TestKVLimitsAreTheIndexs(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		blockTokens, expectedBlocks int
		ok                          bool
	}{
		{65536, 0, true},
		{65537, 0, false},
		{16, 4194304, true},
		{16, 4194305, false},
	} {
		_, parseErr := config.Parse([]byte(fmt.Sprintf("kv: {block_tokens: %d, expected_blocks: %d}\n", tc.blockTokens, tc.expectedBlocks) +
			plainModel + "      - {id: a, groups: {plain: {}}}\n"))
		h, err := kvindex.NewHasher(kvindex.HasherConfig{BlockTokens: tc.blockTokens})
		if err == nil {
			_, err = kvindex.NewIndex(h, kvindex.Options{ExpectedBlocks: tc.expectedBlocks})
		}
		assert.Equal(t, tc.ok, parseErr == nil, "Parse with %+v: %v", tc, parseErr)
		assert.Equal(t, tc.ok, err == nil, "kvindex with %+v: %v", tc, err)
	}
}
