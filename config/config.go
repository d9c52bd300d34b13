package config

import (
	"encoding/json"
	"fmt"
	"strconv"
	"time"

	"github.com/enginepick/enginepick/admission"
	"github.com/enginepick/enginepick/state"
)

// Config is the whole routing configuration of a Router: the served models with their buckets,
// engine groups and policies, an optional description of the engine fleet, and the settings of
// the state every policy shares (docs/design.md §14). It is loaded from YAML or JSON with
// Load or Parse, which reject unknown fields and every invalid value with a
// *Error naming the field's path; New builds a Router from it.
//
// The zero value of every optional field is its documented default. A Config is plain data: New
// copies what it needs and never modifies it.
type Config struct {
	// Models lists the served models; at least one, IDs unique and non-empty. A request for a
	// model that is not listed is unknown (HTTP 404, docs/design.md §16).
	Models []Model `json:"models"`
	// Engines optionally describes the fleet: each engine's ID, model, stage, DP ranks and load
	// endpoint. New builds a static registry from it when the host passes no registry, starts one
	// load poller for the engines with a load endpoint, and examples/replay simulates exactly
	// these engines. Empty means the host's registry is the only source of engines.
	Engines []Engine `json:"engines,omitempty"`
	// Load configures the engine-reported load table and its pollers.
	Load LoadSettings `json:"load,omitzero"`
	// KV configures block hashing and the KV-block prefix index that cache_aware policies with a
	// local prefix source share.
	KV KVSettings `json:"kv,omitzero"`
	// Affinity holds the settings of session and routing-key affinity that hosts read (the
	// header names) and that the affinity store uses.
	Affinity AffinitySettings `json:"affinity,omitzero"`
	// FlowControl makes the Router queue the requests the fleet cannot serve now instead of
	// failing them with 503 (docs/design.md §17). Nil (the block absent, or null) means no flow
	// control; an empty block means flow control with its defaults.
	FlowControl *FlowControl `json:"flow_control,omitempty"`
	// Replicas makes router replicas share their dispatches and route-time placements through a
	// Redis broker, so that they act as one router (docs/design.md §6, "Router replicas"). Nil
	// means none: the Router decides on its own view.
	Replicas *Replicas `json:"replicas,omitempty"`

	// lines maps field paths to their lines in the parsed input, for error messages; nil for a
	// Config built in code.
	lines map[string]int
}

// Model is one served model: its buckets and the default policies its groups inherit.
type Model struct {
	// ID is the model name requests carry (state.ModelID). Required, unique.
	ID string `json:"id"`
	// DefaultPolicy is the policy of every group of this model that sets none and has no stage
	// default. Nil means the built-in default, power_of_two (docs/design.md §14).
	DefaultPolicy *Policy `json:"default_policy,omitempty"`
	// StagePolicies are per-stage defaults: they override DefaultPolicy for groups of their stage.
	// An explicit group policy overrides both.
	StagePolicies StagePolicies `json:"stage_policies,omitzero"`
	// SLO sets how TTFT and TPS targets order this model's buckets (docs/design.md §2). The zero
	// value disables both.
	SLO SLO `json:"slo,omitzero"`
	// Buckets lists the model's buckets; at least one, IDs unique and non-empty within the model.
	Buckets []Bucket `json:"buckets"`
	// Adapters lists the LoRA adapters this model's engines serve, by the name the engines serve
	// each under, which requests carry as their model (vLLM --lora-modules NAME=PATH: the OpenAI
	// model field names the adapter). Router.Select routes a request whose Model is one of these
	// names (Adapter empty) as bucket.Request{Model: this model's ID, Adapter: the name}, on this
	// model's buckets (docs/design.md §18); the embedded enginepick.Router's Select does not map
	// them (the name as Model is enginepick.ErrUnknownModel, 404). Names are non-empty and unique
	// among every model's IDs and adapters. Empty means none.
	Adapters []string `json:"adapters,omitempty"`
}

// StagePolicies holds one optional default policy per stage, for the groups of that stage that set
// no policy; nil means none for the stage (the model's DefaultPolicy applies). A default for a
// stage its type cannot serve (cache_aware for decode) is an error wrapping state.ErrWrongStage.
type StagePolicies struct {
	Plain   *Policy `json:"plain,omitempty"`
	Prefill *Policy `json:"prefill,omitempty"`
	Decode  *Policy `json:"decode,omitempty"`
}

// SLO sets the SLO preferences of a model's resolver: each is "disabled" (the default,
// also the empty string), "best_effort" or "slo_first" (bucket.SLOPreference); any other value is
// an error wrapping state.ErrBadValue.
type SLO struct {
	TTFTPreference string `json:"ttft_preference,omitempty"`
	TPSPreference  string `json:"tps_preference,omitempty"`
}

// Bucket is one bucket: identity, length constraints, SLO estimates and its groups
// (bucket.Spec; docs/design.md §2).
type Bucket struct {
	// ID identifies the bucket within its model. Required, unique within the model.
	ID string `json:"id"`
	// Rank orders buckets of equal input capacity: lower first.
	Rank int `json:"rank,omitempty"`
	// Limits is the inclusive input-token range. Its zero value accepts every length.
	Limits TokenRange `json:"limits,omitzero"`
	// MaxContextTokens is the context capacity in tokens; 0 means unbounded.
	MaxContextTokens uint64 `json:"max_context_tokens,omitempty"`
	// TTFTEstimate and TPSEstimate are the bucket's p95 time to first token and p05 decode tokens
	// per second at capacity, for SLO ordering; zero means no estimate (never meets a target), and
	// a negative value is an error wrapping state.ErrOutOfRange.
	TTFTEstimate Duration `json:"ttft_estimate,omitzero"`
	TPSEstimate  float64  `json:"tps_estimate,omitempty"`
	// Groups holds exactly one of a plain group or a PD pair of groups.
	Groups Groups `json:"groups"`
}

// TokenRange is an inclusive range of input tokens. Min 0 means no lower bound, Max 0 no upper
// bound; Min above a non-zero Max is an error wrapping state.ErrOutOfRange.
type TokenRange struct {
	Min uint64 `json:"min,omitempty"`
	Max uint64 `json:"max,omitempty"`
}

// Groups holds a bucket's groups: exactly one of Plain and PD.
type Groups struct {
	Plain *Group `json:"plain,omitempty"`
	PD    *PD    `json:"pd,omitempty"`
}

// PD is a PD bucket's two groups; both are required (docs/design.md §3).
type PD struct {
	Prefill *Group `json:"prefill"`
	Decode  *Group `json:"decode"`
}

// Group is one engine group: its membership and, optionally, its policy.
type Group struct {
	// EngineIDs is the membership. Absent (nil) means every healthy engine of the model and the
	// group's stage; an empty list means none (docs/design.md §4).
	EngineIDs *[]string `json:"engine_ids,omitempty"`
	// Policy is the group's policy. Nil inherits the model's stage default, else its default
	// policy, else power_of_two.
	Policy *Policy `json:"policy,omitempty"`
}

// Policy is one policy attachment: the policy type, its admission caps and the type's own
// options block, a mapping named after the type (docs/design.md §14.2):
//
//	policy: {type: cache_aware, admission: {max_waiting_requests: 16}, cache_aware: {min_matched_tokens: 512}}
//
// The type's policy.Builder owns the block: it is decoded strictly into the value the builder's
// NewOptions returns, and validated by that value's Validate method. A block named after another
// type is an error, never ignored.
type Policy struct {
	// Type is a registered policy type (policy.Lookup): round_robin, random, power_of_two,
	// power_of_n, least_load, cache_aware, session_aware, sticky, or one the host registered with
	// policy.Register. Required.
	Type string `json:"type"`
	// Admission is the per-engine caps the policy checks (docs/design.md §5). The zero value
	// admits everything.
	Admission admission.Limits `json:"admission,omitzero"`
	// Options is the type's block as its builder decoded it: a pointer of the type
	// policy.Builder.NewOptions returns. Nil means no block: the type's defaults.
	Options any `json:"-"`

	// Filter and MaxInFlight are the legacy spelling of an in-flight cap: filter "overloaded"
	// with max_in_flight N is admission.max_inflight_requests N (docs/design.md §14.3).
	Filter      StringList `json:"filter,omitempty"`
	MaxInFlight *uint64    `json:"max_in_flight,omitempty"`
}

// Engine describes one engine of the fleet.
type Engine struct {
	// ID is the engine's stable, unique ID (state.EngineID), usually its base URL. Required.
	ID string `json:"id"`
	// Model is the model the engine serves; it must be one of Config.Models. Required.
	Model string `json:"model"`
	// Stage is "plain" (the default, also the empty string), "prefill" or "decode".
	Stage string `json:"stage,omitempty"`
	// DPRanks is the engine's data-parallel rank count (loadmon.Table.Expect). 0 means 1, or
	// len(Ranks); at most loadmon.MaxRanks.
	DPRanks int `json:"dp_ranks,omitempty"`
	// DPRankStart is the global DP rank of the engine's rank 0, for an engine that serves a slice
	// of a larger DP group (a vLLM node owning global ranks 4..7 has 4). Its load pages and KV
	// events name global ranks, kept as the engine's ranks 0..N-1; a host sends a picked rank r to
	// the engine as DPRankStart + r. 0 means the engine's ranks are the global ones.
	DPRankStart int `json:"dp_rank_start,omitempty"`
	// Load is the engine's load endpoint, polled by New. Nil means none: the host reports load.
	Load *LoadEndpoint `json:"load,omitempty"`
	// KVEvents is the engine's KV-event publisher, which New follows into the prefix index. Nil
	// means none: the host applies the engine's events itself, or the engine has none.
	KVEvents *KVEventsEndpoint `json:"kv_events,omitempty"`
	// Ranks describes an engine whose DP ranks have their own endpoints (one server per rank, as
	// vLLM's external DP load balancing runs them): one entry per rank, in rank order. It replaces
	// Load and KVEvents, which must then be unset. Nil means the engine's endpoints serve every
	// rank.
	Ranks []Rank `json:"ranks,omitempty"`
}

// RankCount returns the engine's DP rank count: DPRanks, else len(Ranks), else 1.
func (e *Engine) RankCount() int {
	if e.DPRanks == 0 && len(e.Ranks) > 0 {
		return len(e.Ranks)
	}
	return max(e.DPRanks, 1)
}

// Rank is one DP rank of an engine with per-rank endpoints (Engine.Ranks). Each of
// URL, Load and KVEvents is set for every rank of the engine or for none.
type Rank struct {
	// URL is the base URL of the server that serves only this rank, for hosts that send a picked
	// rank to its own server (examples/gateway); the Router does not use it. Empty means none.
	URL string `json:"url,omitempty"`
	// Load is the rank's own load page, which names this one rank (labelled 0 or its global
	// rank); every rank's page has the same format.
	Load *LoadEndpoint `json:"load,omitempty"`
	// KVEvents is the rank's own KV-event publisher: its endpoint and replay socket as they are
	// (no port offset), and the topic it publishes (llm-d's "kv@host:port@model", for example).
	KVEvents *KVEventsEndpoint `json:"kv_events,omitempty"`
}

// KVEventsEndpoint is an engine's KV-event publisher (vLLM and SGLang KVEventsConfig;
// docs/design.md §13.1).
type KVEventsEndpoint struct {
	// Endpoint is rank 0's ZMQ endpoint ("tcp://host:5557"); DP rank r publishes on its port + r,
	// as the engines do (in Engine.Ranks, each rank's own endpoint). Required; tcp:// (with
	// a port when dp_ranks > 1), ipc:// or inproc://.
	Endpoint string `json:"endpoint"`
	// Replay is rank 0's replay socket (offset by the rank likewise); empty means none: a gap
	// clears the rank's blocks instead of refilling them.
	Replay string `json:"replay,omitempty"`
	// Topic is the publisher's topic ("" by default).
	Topic string `json:"topic,omitempty"`
	// Bind makes the router bind Endpoint instead of dialing it, for publishers that dial out.
	Bind bool `json:"bind,omitempty"`
}

// LoadEndpoint is an engine's load page (docs/design.md §13.2).
type LoadEndpoint struct {
	// URL is the absolute http or https URL of the page. Required.
	URL string `json:"url"`
	// Format is vllm_metrics, sglang_get_load or sglang_loads. Required.
	Format string `json:"format"`
}

// LoadSettings configures the shared load table (docs/design.md §6) and the pollers.
type LoadSettings struct {
	// Freshness is how long a report stays usable. Zero means loadmon.DefaultFreshness (5 s).
	Freshness Duration `json:"freshness,omitzero"`
	// PollInterval, PollTimeout and PollJitter configure the load pollers (loadsource.Options):
	// zero means 1 s, 500 ms and no jitter. The timeout must not exceed the interval; jitter is a
	// fraction in [0, 1].
	PollInterval Duration `json:"poll_interval,omitzero"`
	PollTimeout  Duration `json:"poll_timeout,omitzero"`
	PollJitter   float64  `json:"poll_jitter,omitempty"`
}

// KVSettings configures block hashing and the shared KV-block index (docs/design.md §11).
type KVSettings struct {
	// BlockTokens is the engines' KV block size in tokens. Zero means 16 (vLLM's default); at
	// most 65,536.
	BlockTokens int `json:"block_tokens,omitempty"`
	// HashSeed is the root of every block-key chain (kvindex.HasherConfig.Seed).
	HashSeed uint64 `json:"hash_seed,omitempty"`
	// Namespace is folded into every block key (kvindex.HasherConfig.Namespace); empty means none.
	Namespace string `json:"namespace,omitempty"`
	// AdapterIDs maps a LoRA adapter (one of a model's Adapters) to the integer ID its engines'
	// KV events carry (lora_id), for publishers that send an ID without the adapter's name
	// (SGLang; kvevents.Options.AdapterNames). IDs are unique and not negative. Empty means none:
	// such events are refused.
	AdapterIDs map[string]int64 `json:"adapter_ids,omitempty"`
	// MaxBlocks, MaxApproxBlocks and ApproxTTL are the index caps (kvindex.Options): zero means
	// 4,194,304 blocks, 1,048,576 approximate entries and 120 s.
	MaxBlocks       int      `json:"max_blocks,omitempty"`
	MaxApproxBlocks int      `json:"max_approx_blocks,omitempty"`
	ApproxTTL       Duration `json:"approx_ttl,omitzero"`
	// ExpectedBlocks and ExpectedHolderBlocks size the index's tables up front
	// (kvindex.Options): the blocks the index is expected to hold when full, and the blocks one
	// engine DP rank is expected to hold, both at most max_blocks. Zero means the tables start
	// small and double as blocks arrive.
	ExpectedBlocks       int `json:"expected_blocks,omitempty"`
	ExpectedHolderBlocks int `json:"expected_holder_blocks,omitempty"`
	// WriterYieldBlocks is how many blocks the index stores between two yields of the writer's
	// processor to waiting lookups (kvindex.Options.WriterYieldBlocks): zero means 4,096,
	// negative never.
	WriterYieldBlocks int `json:"writer_yield_blocks,omitempty"`
	// RemoteTimeout and RemoteMaxConcurrent bound the lookups of the one remote prefix source
	// every cache_aware policy with prefix_source remote shares: zero means 100 ms and 32
	// (docs/design.md §10).
	RemoteTimeout       Duration `json:"remote_timeout,omitzero"`
	RemoteMaxConcurrent int      `json:"remote_max_concurrent,omitempty"`
}

// AffinitySettings are the shared settings of session and routing-key affinity (docs/design.md
// §12 and §14).
type AffinitySettings struct {
	// SessionHeader is the HTTP header a host reads the session key from. Empty means
	// DefaultSessionHeader.
	SessionHeader string `json:"session_header,omitempty"`
	// RoutingKeyHeader is the HTTP header a host reads the sticky routing key from. Empty means
	// DefaultRoutingKeyHeader.
	RoutingKeyHeader string `json:"routing_key_header,omitempty"`
	// IdleTimeout is how long a binding lives without a hit. Zero means 600 s.
	IdleTimeout Duration `json:"idle_timeout,omitzero"`
	// SweepInterval is how often expired bindings are swept. Zero means 60 s.
	SweepInterval Duration `json:"sweep_interval,omitzero"`
	// MaxBindings caps the bindings of the in-memory store (store memory only): a new binding
	// beyond it evicts the least recently used one (affinity.Options.MaxBindings). Zero means no
	// cap: the idle timeout alone bounds the store.
	MaxBindings int `json:"max_bindings,omitempty"`
	// Mode is "strict" or empty: an admitted binding is reused. The former "soft" mode is rejected
	// (docs/design.md §14.3).
	Mode string `json:"affinity_mode,omitempty"`
	// Store is where session_aware and sticky policies keep their bindings: "memory" (an
	// affinity.MemoryStore in this process, swept by the Router) or "redis" (a store shared by
	// router replicas, which the host builds with affinity/redisstore from Redis and passes with
	// WithAffinityStore). Empty means memory, unless the host passes a store.
	Store string `json:"store,omitempty"`
	// Redis describes the Redis store (store redis only).
	Redis *RedisSettings `json:"redis,omitempty"`
}

// FlowControl configures the Router's flow control (flowcontrol.Config; docs/design.md §17). The
// zero value of every field is flowcontrol.Config's default.
type FlowControl struct {
	// Bands are the priority bands, priorities distinct. Empty means one band of priority 0.
	Bands []FlowBand `json:"bands,omitempty"`
	// MaxQueued bounds one model's waiting requests, every band together; 0 means 4,096.
	MaxQueued int `json:"max_queued,omitempty"`
	// HalfLife is the half-life of a flow's attained service; 0 means 60 s.
	HalfLife Duration `json:"half_life,omitzero"`
	// FlowWeights maps flows (bucket.Request.Flow) to their weights, each finite and > 0; a flow
	// not listed has weight 1. Package metrics labels the flows listed here by name, the others
	// as "other".
	FlowWeights map[string]float64 `json:"flow_weights,omitempty"`
	// QueueThreshold and KVThreshold are the saturation detector's thresholds: waiting requests
	// (0 means 5) and a KV usage fraction (0 means 0.8; above 1 turns the KV test off).
	QueueThreshold uint64  `json:"queue_threshold,omitempty"`
	KVThreshold    float64 `json:"kv_threshold,omitempty"`
}

// FlowBand is one priority band (flowcontrol.Band).
type FlowBand struct {
	// Priority orders bands, higher first; a request waits in the band of the highest priority
	// at or below its own (the lowest band when below every band).
	Priority int `json:"priority"`
	// TTL bounds a wait in the band (then HTTP 503); 0 means only the caller's context does.
	TTL Duration `json:"ttl,omitzero"`
	// MaxQueued bounds the band's waiting requests per model (then HTTP 429); 0 means none but
	// FlowControl.MaxQueued.
	MaxQueued int `json:"max_queued,omitempty"`
	// Sheddable bands never wait: a request the fleet cannot serve at once gets HTTP 429.
	Sheddable bool `json:"sheddable,omitempty"`
}

// Replicas configures the sharing between router replicas (docs/design.md §6, "Router
// replicas"): New publishes every dispatch start, first token and end and every route-time
// placement on a Redis pub/sub channel, and folds in those of the other replicas on the channel.
// Peers' dispatches count in pressure comparisons and their placements in the prefix index; this
// Router's admission caps and in-flight counts stay its own.
type Replicas struct {
	// Redis is the broker: Addr (host:port, required), Password (empty means none; hosts may set
	// it from their secret store rather than write it in the file) and DB (the database number,
	// 0 by default). New dials it and reconnects on its own; an unreachable broker never fails a
	// request: the Router then decides on its own view.
	Redis struct {
		Addr     string `json:"addr"`
		Password string `json:"password,omitempty"`
		DB       int    `json:"db,omitempty"`
	} `json:"redis"`
	// Channel is the pub/sub channel the replicas of one deployment share; deployments on one
	// Redis use different channels. Empty means "enginepick:replicas".
	Channel string `json:"channel,omitempty"`
	// Lease is how long the dispatches of a silent peer keep counting; a replica sends a
	// heartbeat every lease ÷ 4. Zero means 2 s.
	Lease Duration `json:"lease,omitzero"`
	// FlushInterval is how often a replica publishes its pending deltas; at most lease ÷ 4. Zero
	// means 5 ms.
	FlushInterval Duration `json:"flush_interval,omitzero"`
}

// RedisSettings describe the Redis deployment of a shared affinity store (affinity/redisstore).
// New does not dial this store (it dials only the replicas block's broker, Replicas.Redis): the
// host builds the store's client from these settings, with its own credentials and TLS settings,
// which do not belong in this file, and passes the store with WithAffinityStore.
type RedisSettings struct {
	// Addrs are the Redis server or cluster addresses (host:port). At least one.
	Addrs []string `json:"addrs"`
	// Prefix starts every key; empty means "enginepick:affinity". Replicas sharing bindings use
	// the same prefix, shard count and idle timeout.
	Prefix string `json:"prefix,omitempty"`
	// Shards is the number of hash-tag shards; 0 means 256.
	Shards int `json:"shards,omitempty"`
}

// Defaults of the shared settings (docs/design.md §14; the experimental SGLang router's
// defaults).
const (
	// DefaultSessionHeader is AffinitySettings.SessionHeader's default.
	DefaultSessionHeader = "x-session-id"
	// DefaultRoutingKeyHeader is AffinitySettings.RoutingKeyHeader's default.
	DefaultRoutingKeyHeader = "x-sgl-routing-key"
	// defaultBlockTokens is KVSettings.BlockTokens's default, vLLM's block size.
	defaultBlockTokens = 16
	// defaultReplicasChannel, defaultReplicasLease and defaultReplicasFlush are the defaults of
	// the replicas block.
	defaultReplicasChannel = "enginepick:replicas"
	defaultReplicasLease   = 2 * time.Second
	defaultReplicasFlush   = 5 * time.Millisecond
	// defaultPolicy is the policy of a group that sets none and inherits none.
	defaultPolicy = "power_of_two"
	// maxBlockTokens and defaultMaxBlocks are kvindex's limits: the largest
	// kvindex.HasherConfig.BlockTokens and kvindex.Options.MaxBlocks's default.
	maxBlockTokens   = 1 << 16
	defaultMaxBlocks = 1 << 22
)

// Duration is a time.Duration written as a Go duration string ("5s", "250ms") in YAML and JSON.
// The zero value is a zero duration, which each field documents the meaning of.
type Duration time.Duration

// D returns the time.Duration.
func (d Duration) D() time.Duration { return time.Duration(d) }

// MarshalText writes the duration as time.Duration.String does ("1m30s"); it never fails.
func (d Duration) MarshalText() ([]byte, error) { return []byte(time.Duration(d).String()), nil }

// UnmarshalText parses a Go duration string (time.ParseDuration). Errors wrap state.ErrBadValue;
// on error d is unchanged.
func (d *Duration) UnmarshalText(b []byte) error {
	v, err := time.ParseDuration(string(b))
	if err != nil {
		return fmt.Errorf("%w %s: want a duration such as 5s or 250ms", state.ErrBadValue, strconv.Quote(string(b)))
	}
	*d = Duration(v)
	return nil
}

// StringList is a list of strings that may also be written as a single string (filter:
// overloaded is filter: [overloaded]). Nil and empty mean no entries.
type StringList []string

// MarshalJSON writes the attachment as the configuration spells it: the options block, when
// Options is non-nil, under the type's name. Errors are encoding/json's, for Options that do not
// marshal.
func (p Policy) MarshalJSON() ([]byte, error) {
	type fields Policy // the fields without this method
	b, err := json.Marshal(fields(p))
	if err != nil || p.Options == nil {
		return b, err
	}
	m := map[string]json.RawMessage{}
	if err := json.Unmarshal(b, &m); err != nil {
		return nil, err
	}
	if m[p.Type], err = json.Marshal(p.Options); err != nil {
		return nil, err
	}
	return json.Marshal(m)
}
