package config_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/enginepick/enginepick"
	"github.com/enginepick/enginepick/admission"
	"github.com/enginepick/enginepick/affinity"
	"github.com/enginepick/enginepick/bucket"
	"github.com/enginepick/enginepick/config"
	"github.com/enginepick/enginepick/flowcontrol"
	"github.com/enginepick/enginepick/internal/kvbridge"
	"github.com/enginepick/enginepick/internal/label"
	"github.com/enginepick/enginepick/kvindex"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

// indexerFunc adapts a function to kvindex.RemoteIndexer.
type indexerFunc func(ctx context.Context, q kvindex.RemoteQuery) ([]kvindex.EngineMatch, error)

func (f indexerFunc) MatchPrefix(ctx context.Context, q kvindex.RemoteQuery) ([]kvindex.EngineMatch, error) {
	return f(ctx, q)
}

// recorder is an Observer (and policy.CacheObserver) that records everything.
type recorder struct {
	mu      sync.Mutex
	groups  []enginepick.GroupInfo
	picks   map[string][]string // "model/bucket/stage" → reasons, "!"+limit for rejections
	selects []enginepick.SelectEvent
	dones   []enginepick.DoneEvent
	cache   []policy.CacheDecision
}

var (
	_ enginepick.Observer  = (*recorder)(nil)
	_ policy.CacheObserver = (*recorder)(nil)
)

type recPick struct {
	r   *recorder
	key string
}

func (p recPick) ObservePick(pk policy.Pick, err error) {
	p.r.mu.Lock()
	defer p.r.mu.Unlock()
	if err != nil {
		var rej *policy.AdmissionRejectedError
		if errors.As(err, &rej) {
			p.r.picks[p.key] = append(p.r.picks[p.key], "!"+rej.Limit)
		}
		return
	}
	p.r.picks[p.key] = append(p.r.picks[p.key], pk.Reason)
}

func (r *recorder) ObserveGroup(g enginepick.GroupInfo) enginepick.PickObserver {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.picks == nil {
		r.picks = map[string][]string{}
	}
	r.groups = append(r.groups, g)
	return recPick{r: r, key: fmt.Sprintf("%s/%s/%s", g.Model, g.Bucket, g.Stage)}
}

func (r *recorder) ObserveSelect(e enginepick.SelectEvent) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.selects = append(r.selects, e)
}

func (r *recorder) ObserveDone(e enginepick.DoneEvent) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.dones = append(r.dones, e)
}

func (r *recorder) ObserveCacheDecision(d *policy.CacheDecision) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.cache = append(r.cache, *d)
}

// policyOf returns the recorded policy name of a group.
func (r *recorder) policyOf(model, bkt string, stage state.Stage) string {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, g := range r.groups {
		if string(g.Model) == model && g.Bucket == bkt && g.Stage == stage {
			return g.Policy
		}
	}
	return ""
}

func mustParse(t *testing.T, yaml string) *config.Config {
	t.Helper()
	cfg, err := config.Parse([]byte(yaml))
	require.NoError(t, err)
	return cfg
}

func mustNew(t *testing.T, cfg *config.Config, reg state.Registry, opts ...config.Option) *config.Router {
	t.Helper()
	r, err := config.New(cfg, reg, append([]config.Option{config.WithHealthInterval(0)}, opts...)...)
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.Close() })
	return r
}

// seedPD is a two-bucket PD configuration with its fleet: each bucket's prefill and decode groups
// are disjoint, and a pair always comes from one bucket (docs/design.md §3).
const seedPD = `
engines:
  - {id: P1, model: llama, stage: prefill}
  - {id: P2, model: llama, stage: prefill}
  - {id: P3, model: llama, stage: prefill}
  - {id: P4, model: llama, stage: prefill}
  - {id: D1, model: llama, stage: decode}
  - {id: D2, model: llama, stage: decode}
  - {id: D3, model: llama, stage: decode}
  - {id: D4, model: llama, stage: decode}
models:
  - id: llama
    buckets:
      - id: short-context
        rank: 10
        limits: {min: 0, max: 4096}
        max_context_tokens: 8192
        groups:
          pd:
            prefill:
              engine_ids: [P1, P2]
              policy:
                type: cache_aware
                admission: {max_running_requests: 64, max_kv_tokens: 1048576}
            decode:
              engine_ids: [D1, D2]
              policy:
                type: power_of_two
                admission: {max_running_requests: 64, max_kv_tokens: 1048576}
      - id: long-context
        rank: 20
        limits: {min: 0, max: 131072}
        max_context_tokens: 131072
        groups:
          pd:
            prefill:
              engine_ids: [P3, P4]
              policy: {type: cache_aware}
            decode:
              engine_ids: [D3, D4]
              policy: {type: power_of_two}
`

func selectReq(model string, input, peak int64) *bucket.Request {
	return &bucket.Request{Model: state.ModelID(model), Signals: bucket.Signals{InputTokens: input, ExpectedPeakTokens: peak, HasExpectedPeak: true}}
}

// TestNewSeedPDConfigPicksPairsFromOneBucket checks bucket choice by expected peak (docs/design.md
// §2) and PD pairs from one bucket (§3) through config.New: 4k input with a 16k peak does not fit
// the short bucket's context and takes both engines from the long bucket; with an 8k peak it takes
// both from the short bucket.
func TestNewSeedPDConfigPicksPairsFromOneBucket(t *testing.T) {
	t.Parallel()
	r := mustNew(t, mustParse(t, seedPD), nil)
	for range 20 {
		d, err := r.Select(context.Background(), selectReq("llama", 4096, 16384))
		require.NoError(t, err)
		assert.Equal(t, "long-context", d.Selection.Bucket.ID())
		assert.Contains(t, []state.EngineID{"P3", "P4"}, d.Selection.Prefill.Engine.ID())
		assert.Contains(t, []state.EngineID{"D3", "D4"}, d.Selection.Decode.Engine.ID())
		d.Release()

		d, err = r.Select(context.Background(), selectReq("llama", 4096, 8192))
		require.NoError(t, err)
		assert.Equal(t, "short-context", d.Selection.Bucket.ID())
		assert.Contains(t, []state.EngineID{"P1", "P2"}, d.Selection.Prefill.Engine.ID())
		assert.Contains(t, []state.EngineID{"D1", "D2"}, d.Selection.Decode.Engine.ID())
		d.Release()
	}
	_, err := r.Select(context.Background(), selectReq("mistral", 10, 20))
	assert.ErrorIs(t, err, enginepick.ErrUnknownModel)
}

// TestNewPolicyInheritance checks that an explicit group policy overrides the model's stage
// default, which overrides the model's default, which overrides the built-in power_of_two
// (docs/design.md §14.2), both in the policy New attaches and in the picks it makes.
func TestNewPolicyInheritance(t *testing.T) {
	t.Parallel()
	cfg := mustParse(t, `
engines:
  - {id: e1, model: m}
  - {id: e2, model: m}
  - {id: p1, model: m, stage: prefill}
  - {id: d1, model: m, stage: decode}
  - {id: x1, model: bare}
models:
  - id: m
    default_policy: {type: random}
    stage_policies:
      decode: {type: least_load}
    buckets:
      - id: own
        limits: {max: 100}
        groups: {plain: {policy: {type: round_robin}}}
      - id: inherits
        limits: {min: 101}
        groups: {pd: {prefill: {}, decode: {}}}
  - id: bare
    buckets: [{id: b, groups: {plain: {}}}]
`)
	rec := &recorder{}
	r := mustNew(t, cfg, nil, config.WithObserver(rec))
	assert.Equal(t, label.RoundRobin, rec.policyOf("m", "own", state.StagePlain), "explicit group policy")
	assert.Equal(t, label.Random, rec.policyOf("m", "inherits", state.StagePrefill), "model default")
	assert.Equal(t, label.LeastLoad, rec.policyOf("m", "inherits", state.StageDecode), "stage default over model default")
	assert.Equal(t, label.PowerOfTwo, rec.policyOf("bare", "b", state.StagePlain), "built-in default")

	for _, tc := range []struct {
		model string
		input int64
		want  []string
	}{
		{"m", 50, []string{"m/own/plain=" + label.ReasonRoundRobin}},
		{"m", 500, []string{"m/inherits/prefill=" + label.ReasonRandom, "m/inherits/decode=" + label.ReasonLeastLoad}},
		{"bare", 50, []string{"bare/b/plain=" + label.ReasonPowerOfTwo}},
	} {
		d, err := r.Select(context.Background(), selectReq(tc.model, tc.input, tc.input))
		require.NoError(t, err)
		var got []string
		if d.Selection.IsPD() {
			got = []string{tc.model + "/" + d.Selection.Bucket.ID() + "/prefill=" + d.Selection.Prefill.Reason,
				tc.model + "/" + d.Selection.Bucket.ID() + "/decode=" + d.Selection.Decode.Reason}
		} else {
			got = []string{tc.model + "/" + d.Selection.Bucket.ID() + "/plain=" + d.Selection.Plain.Reason}
		}
		assert.Equal(t, tc.want, got)
		d.Release()
	}
}

// TestNewLegacyInFlightFilter checks that filter overloaded with max_in_flight is the in-flight
// admission cap (docs/design.md §14.3): with a cap of 1 per engine, two held dispatches exhaust
// both engines and the third is rejected by max_inflight_requests; without the filter it is not.
func TestNewLegacyInFlightFilter(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		policy string
		capped bool
	}{
		{"legacy filter", "{type: round_robin, filter: overloaded, max_in_flight: 1}", true},
		{"legacy filter as a list", "{type: least_load, filter: [overloaded], max_in_flight: 1}", true},
		{"admission cap", "{type: round_robin, admission: {max_inflight_requests: 1}}", true},
		{"no cap", "{type: round_robin}", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			r := mustNew(t, mustParse(t, `
engines: [{id: e1, model: m}, {id: e2, model: m}]
models: [{id: m, buckets: [{id: a, groups: {plain: {policy: `+tc.policy+`}}}]}]
`), nil)
			var held []*enginepick.Dispatch
			for range 2 {
				d, err := r.Select(context.Background(), selectReq("m", 10, 10))
				require.NoError(t, err)
				held = append(held, d)
			}
			d, err := r.Select(context.Background(), selectReq("m", 10, 10))
			if !tc.capped {
				require.NoError(t, err)
				d.Release()
			} else {
				var ex *bucket.ExhaustedError
				require.ErrorAs(t, err, &ex)
				require.NotEmpty(t, ex.Rejections)
				assert.Equal(t, admission.LimitInFlightRequests, ex.Rejections[0].Limit)
				assert.Equal(t, uint64(1), ex.Rejections[0].Cap)
			}
			for _, d := range held {
				d.Release()
			}
		})
	}
}

// TestNewRejectsMembersOfAnotherRole checks membership against the host's registry
// (docs/design.md §14.4): an engine the registry knows as decode cannot be a prefill member, an
// engine of another model cannot be a member, and an ID the registry does not know is allowed.
func TestNewRejectsMembersOfAnotherRole(t *testing.T) {
	t.Parallel()
	reg, err := state.NewStaticRegistry(
		state.NewStaticEngine("p1", "m", state.StagePrefill),
		state.NewStaticEngine("d1", "m", state.StageDecode),
		state.NewStaticEngine("o1", "other", state.StagePlain))
	require.NoError(t, err)
	for _, tc := range []struct {
		name, prefill, path, msg string
	}{
		{"decode engine as prefill member", "[p1, d1]", "models[0].buckets[0].groups.pd.prefill.engine_ids[1]",
			`config: line 4: models[0].buckets[0].groups.pd.prefill.engine_ids[1]: engine "d1" is a decode engine, not prefill`},
		{"engine of another model", "[o1]", "models[0].buckets[0].groups.pd.prefill.engine_ids[0]",
			`config: line 4: models[0].buckets[0].groups.pd.prefill.engine_ids[0]: engine "o1" serves model "other", not "m"`},
		{"unknown engine is allowed", "[p1, p9]", "", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			cfg := mustParse(t, `
models:
  - id: m
    buckets: [{id: a, groups: {pd: {prefill: {engine_ids: `+tc.prefill+`}, decode: {}}}}]
  - id: other
    buckets: [{id: a, groups: {plain: {}}}]
`)
			r, err := config.New(cfg, reg, config.WithHealthInterval(0))
			if tc.msg == "" {
				require.NoError(t, err)
				require.NoError(t, r.Close())
				return
			}
			var ce *config.Error
			require.ErrorAs(t, err, &ce)
			assert.ErrorIs(t, err, state.ErrWrongStage)
			assert.Equal(t, tc.path, ce.Path)
			assert.Equal(t, tc.msg, err.Error())
		})
	}
}

// TestNewSharesOneIndex checks that every cache_aware policy with a local source reads the one
// index New built (docs/design.md §14.5): blocks stored once make both models' groups hit, and a
// configuration without cache_aware builds no index at all.
func TestNewSharesOneIndex(t *testing.T) {
	t.Parallel()
	cfg := mustParse(t, `
kv: {block_tokens: 4, expected_blocks: 64, expected_holder_blocks: 16, writer_yield_blocks: 100}
engines:
  - {id: a1, model: a}
  - {id: a2, model: a}
  - {id: bp1, model: b, stage: prefill}
  - {id: bp2, model: b, stage: prefill}
  - {id: bd1, model: b, stage: decode}
models:
  - id: a
    buckets: [{id: x, groups: {plain: {policy: {type: cache_aware, cache_aware: {min_matched_tokens: 4}}}}}]
  - id: b
    stage_policies: {prefill: {type: cache_aware, cache_aware: {min_matched_tokens: 4}}}
    buckets: [{id: y, groups: {pd: {prefill: {}, decode: {}}}}]
`)
	rec := &recorder{}
	r := mustNew(t, cfg, nil, config.WithObserver(rec))
	require.NotNil(t, r.Index())
	assert.Equal(t, 4, r.Index().Hasher().BlockTokens())
	assert.Equal(t, 100, kvbridge.WriterYieldBlocks(r.Index()))
	tokens := []uint32{1, 2, 3, 4, 5, 6, 7, 8}
	for _, e := range []state.EngineID{"a2", "bp2"} {
		require.NoError(t, r.Index().Store(kvindex.StoreEvent{Engine: e, BlockHashes: []uint64{11, 12}, TokenIDs: tokens, Tier: kvindex.TierDevice}))
	}
	for _, tc := range []struct {
		model string
		want  state.EngineID
	}{{"a", "a2"}, {"b", "bp2"}} {
		req := selectReq(tc.model, int64(len(tokens)), int64(len(tokens))+4)
		req.TokenIDs = tokens
		d, err := r.Select(context.Background(), req)
		require.NoError(t, err)
		front := d.Selection.Plain
		if d.Selection.IsPD() {
			front = d.Selection.Prefill
		}
		assert.Equal(t, tc.want, front.Engine.ID(), tc.model)
		assert.Equal(t, label.ReasonCacheCandidate, front.Reason, tc.model)
		d.Release()
	}
	require.Len(t, rec.cache, 2)
	assert.Equal(t, label.DecisionCacheHit, rec.cache[0].Decision)

	plain := mustNew(t, mustParse(t, "engines: [{id: e, model: m}]\nmodels: [{id: m, buckets: [{id: a, groups: {plain: {}}}]}]\n"), nil)
	assert.Nil(t, plain.Index(), "no cache_aware policy, no index")
}

// TestNewRemotePrefixSource checks prefix_source remote: it needs WithRemoteIndexer, and with one
// every remote cache_aware policy asks it.
func TestNewRemotePrefixSource(t *testing.T) {
	t.Parallel()
	const yaml = `
engines: [{id: e1, model: m}, {id: e2, model: m}]
models: [{id: m, buckets: [{id: a, groups: {plain: {policy: {type: cache_aware, cache_aware: {prefix_source: remote, min_matched_tokens: 16}}}}}]}]
`
	_, err := config.New(mustParse(t, yaml), nil, config.WithHealthInterval(0))
	var ce *config.Error
	require.ErrorAs(t, err, &ce)
	assert.ErrorIs(t, err, state.ErrMissingField)
	assert.Equal(t, `config: line 3: models[0].buckets[0].groups.plain.policy.cache_aware: prefix_source remote needs a remote indexer: pass config.WithRemoteIndexer to New`, err.Error())

	var calls atomic.Int32
	ri := indexerFunc(func(_ context.Context, q kvindex.RemoteQuery) ([]kvindex.EngineMatch, error) {
		calls.Add(1)
		return []kvindex.EngineMatch{{Engine: "e2", Blocks: len(q.Keys)}}, nil
	})
	r := mustNew(t, mustParse(t, yaml), nil, config.WithRemoteIndexer(ri))
	assert.Nil(t, r.Index(), "a remote source needs no local index")
	req := selectReq("m", 32, 40)
	req.TokenIDs = make([]uint32, 32)
	d, err := r.Select(context.Background(), req)
	require.NoError(t, err)
	assert.Equal(t, state.EngineID("e2"), d.Selection.Plain.Engine.ID())
	assert.Equal(t, label.ReasonCacheCandidate, d.Selection.Plain.Reason)
	assert.Equal(t, int32(1), calls.Load())
	d.Release()
}

// loadServer serves SGLang /v1/loads pages with the given waiting count for every engine.
func loadServer(t *testing.T, waiting *atomic.Int64, hits *sync.Map) *httptest.Server {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if hits != nil {
			n, _ := hits.LoadOrStore(r.URL.Path, new(atomic.Int64))
			n.(*atomic.Int64).Add(1)
		}
		if waiting == nil {
			http.Error(w, "down", http.StatusInternalServerError)
			return
		}
		_, _ = fmt.Fprintf(w, `{"loads": [{"dp_rank": 0, "num_running_reqs": 1, "num_waiting_reqs": %d}]}`, waiting.Load())
	}))
	t.Cleanup(srv.Close)
	return srv
}

// TestNewPollsLoadOnceAndCloseStopsEverything checks the shared services' lifecycle
// (docs/design.md §14.5): one poller feeds the one load table for every engine with a load
// endpoint, whatever number of groups and models name the engine; Close stops it, the affinity
// store's sweeper, the degraded-state checks and every other goroutine New started, and is
// idempotent.
func TestNewPollsLoadOnceAndCloseStopsEverything(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	var waiting atomic.Int64
	waiting.Store(3)
	var hits sync.Map
	srv := loadServer(t, &waiting, &hits)
	defer srv.Close() // before goleak.VerifyNone: the server's goroutines are the test's
	cfg := mustParse(t, fmt.Sprintf(`
load: {poll_interval: 20ms, poll_timeout: 10ms}
engines:
  - {id: e1, model: m, load: {url: "%[1]s/e1/v1/loads", format: sglang_loads}}
  - {id: e2, model: m, load: {url: "%[1]s/e2/v1/loads", format: sglang_loads}}
models:
  - id: m
    buckets:
      - {id: short, limits: {max: 100}, groups: {plain: {policy: {type: least_load}}}}
      - {id: long, limits: {min: 101}, groups: {plain: {engine_ids: [e1, e2], policy: {type: power_of_two}}}}
      - {id: sessions, limits: {min: 101}, rank: 1, groups: {plain: {policy: {type: session_aware}}}}
`, srv.URL))
	r, err := config.New(cfg, nil, config.WithHealthInterval(5*time.Millisecond))
	require.NoError(t, err)
	require.NotNil(t, r.AffinityStore(), "the session group's store, whose sweeper runs until Close")
	require.Eventually(t, func() bool {
		snap := r.LoadTable().Snapshot()
		l1, ok1 := snap.Load("e1")
		l2, ok2 := snap.Load("e2")
		return ok1 && ok2 && l1.WaitingRequests == 3 && l2.WaitingRequests == 3
	}, 5*time.Second, 5*time.Millisecond)
	stats := r.LoadPollStats()
	require.Len(t, stats, 2, "one poll target per engine, not per group")
	assert.Equal(t, []state.EngineID{"e1", "e2"}, []state.EngineID{stats[0].Engine, stats[1].Engine})
	require.NoError(t, r.Close())
	require.NoError(t, r.Close(), "Close is idempotent")
	counts := func() map[string]int64 {
		m := map[string]int64{}
		hits.Range(func(k, v any) bool { m[k.(string)] = v.(*atomic.Int64).Load(); return true })
		return m
	}
	// A poll sent just before Close may reach the server after Close returns (the server runs
	// its handler when it gets to it); let such stragglers land first.
	before := counts()
	require.Eventually(t, func() bool {
		time.Sleep(15 * time.Millisecond)
		now := counts()
		settled := assert.ObjectsAreEqual(before, now)
		before = now
		return settled
	}, 5*time.Second, time.Millisecond)
	time.Sleep(60 * time.Millisecond) // three poll intervals: a poller still running would poll

	hits.Range(func(k, v any) bool {
		assert.Equal(t, before[k.(string)], v.(*atomic.Int64).Load(), "no poll of %s after Close", k)
		return true
	})
	d, err := r.Select(context.Background(), selectReq("m", 10, 10))
	require.NoError(t, err, "a closed Router still selects")
	d.Release()
}

// TestNewRejectsMismatchedHandles checks that a load table or index passed with an option must
// agree with the configuration rather than override it silently.
func TestNewRejectsMismatchedHandles(t *testing.T) {
	t.Parallel()
	cfg := mustParse(t, `
load: {freshness: 2s}
kv: {block_tokens: 32}
engines: [{id: e1, model: m}]
models: [{id: m, buckets: [{id: a, groups: {plain: {policy: {type: cache_aware}}}}]}]
`)
	_, err := config.New(cfg, nil, config.WithHealthInterval(0), config.WithLoadTable(loadmon.NewTable()))
	assert.ErrorIs(t, err, state.ErrConflict)
	assert.EqualError(t, err, "config: line 2: load.freshness: 2s, but the load table passed with WithLoadTable has freshness 5s")
	h, err := kvindex.NewHasher(kvindex.HasherConfig{BlockTokens: 16})
	require.NoError(t, err)
	x, err := kvindex.NewIndex(h, kvindex.Options{})
	require.NoError(t, err)
	_, err = config.New(cfg, nil, config.WithHealthInterval(0), config.WithIndex(x))
	assert.ErrorIs(t, err, state.ErrConflict)
	assert.EqualError(t, err, "config: line 3: kv.block_tokens: 32, but the index passed with WithIndex has 16-token blocks")

	_, err = config.New(mustParse(t, "models: [{id: m, buckets: [{id: a, groups: {plain: {}}}]}]\n"), nil)
	assert.ErrorIs(t, err, state.ErrMissingField, "no registry and no engines")
	_, err = config.New(nil, nil)
	assert.ErrorIs(t, err, state.ErrInvalidConfiguration)
	_, err = config.New(cfg, nil, config.WithHealthInterval(-time.Second))
	assert.ErrorIs(t, err, state.ErrInvalidConfiguration)
}

// TestDispatchDoneReleasesOnceAndReports checks Dispatch.Done (docs/design.md §15): it releases
// the guards and reports the outcome once; Release keeps working and ends the dispatch without a
// report; later calls do nothing.
func TestDispatchDoneReleasesOnceAndReports(t *testing.T) {
	t.Parallel()
	now := time.Unix(1000, 0)
	var mu sync.Mutex
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	advance := func(d time.Duration) { mu.Lock(); now = now.Add(d); mu.Unlock() }
	rec := &recorder{}
	r := mustNew(t, mustParse(t, seedPD), nil, config.WithObserver(rec), config.WithClock(clock))

	d, err := r.Select(context.Background(), selectReq("llama", 100, 200))
	require.NoError(t, err)
	p, dec := d.Selection.Prefill.Engine.ID(), d.Selection.Decode.Engine.ID()
	assert.Equal(t, uint64(1), r.InFlight().Count(p))
	advance(3 * time.Second)
	fail := errors.New("engine reset")
	d.Done(enginepick.Outcome{Err: fail, TTFT: time.Second, PromptTokens: 100, OutputTokens: 7, CachedTokens: 64, CachedTokensReported: true})
	d.Done(enginepick.Outcome{})
	d.Release()
	assert.Zero(t, r.InFlight().Count(p))
	assert.Zero(t, r.InFlight().Count(dec))
	require.Len(t, rec.dones, 1)
	ev := rec.dones[0]
	assert.Equal(t, state.ModelID("llama"), ev.Model)
	assert.Equal(t, "short-context", ev.Bucket)
	assert.Equal(t, label.FailError, ev.Reason)
	assert.Equal(t, 3*time.Second, ev.Duration)
	assert.Equal(t, [2]enginepick.DispatchedEngine{
		{ID: p, Stage: state.StagePrefill, Policy: label.CacheAware, Reason: label.ReasonNoCacheCandidate},
		{ID: dec, Stage: state.StageDecode, Policy: label.PowerOfTwo, Reason: label.ReasonPowerOfTwo},
	}, ev.Engines)
	assert.Equal(t, 2, ev.N)
	assert.Equal(t, uint64(64), ev.Outcome.CachedTokens)

	d, err = r.Select(context.Background(), selectReq("llama", 100, 200))
	require.NoError(t, err)
	d.Release()
	d.Done(enginepick.Outcome{})
	assert.Len(t, rec.dones, 1, "Done after Release reports nothing")
	var none *enginepick.Dispatch
	none.Done(enginepick.Outcome{})
}

// TestSelectReportsFailures checks that every Router.Select reaches the Observer, failures
// included, with a bounded model label: an unknown model is reported with an empty model.
func TestSelectReportsFailures(t *testing.T) {
	t.Parallel()
	rec := &recorder{}
	r := mustNew(t, mustParse(t, `
engines: [{id: e1, model: m}]
models: [{id: m, buckets: [{id: a, limits: {max: 100}, groups: {plain: {policy: {type: round_robin, admission: {max_inflight_requests: 1}}}}}]}]
`), nil, config.WithObserver(rec))
	held, err := r.Select(context.Background(), selectReq("m", 10, 10))
	require.NoError(t, err)
	_, err = r.Select(context.Background(), selectReq("m", 10, 10))
	require.Error(t, err)
	_, err = r.Select(context.Background(), selectReq("client-chosen-name", 10, 10))
	require.Error(t, err)
	_, err = r.Select(context.Background(), selectReq("m", 1000, 1000))
	require.Error(t, err)
	held.Release()
	require.Len(t, rec.selects, 4)
	got := make([][2]string, len(rec.selects))
	for i, e := range rec.selects {
		got[i] = [2]string{string(e.Model), e.Reason}
	}
	assert.Equal(t, [][2]string{{"m", ""}, {"m", label.FailAdmissionRejected}, {"", label.FailUnknownModel},
		{"m", label.FailNoMatchingBucket}}, got)
	assert.NotNil(t, rec.selects[0].Selection)
	assert.Nil(t, rec.selects[1].Selection)
	assert.Equal(t, []string{label.ReasonRoundRobin, "!" + admission.LimitInFlightRequests}, rec.picks["m/a/plain"])
}

// TestFailureReason maps each error family to its label.
func TestFailureReason(t *testing.T) {
	t.Parallel()
	rej := &policy.AdmissionRejectedError{Engine: state.NewStaticEngine("e", "m", state.StagePlain), Limit: admission.LimitKVTokens}
	exhausted := &bucket.ExhaustedError{Rejections: []*policy.AdmissionRejectedError{rej}, Last: &bucket.StageError{Err: rej}}
	for _, tc := range []struct {
		err  error
		want string
	}{
		{nil, ""},
		{fmt.Errorf("x: %w", context.Canceled), label.FailCanceled},
		{context.DeadlineExceeded, label.FailDeadlineExceeded},
		{bucket.ErrNoMatchingBucket, label.FailNoMatchingBucket},
		{fmt.Errorf("m: %w", enginepick.ErrUnknownModel), label.FailUnknownModel},
		{policy.ErrInvalidSignal, label.FailInvalidSignal},
		{policy.ErrInvalidConfiguration, label.FailInvalidConfiguration},
		{&policy.OutsideCandidatesError{Engine: "x"}, label.FailOutsideCandidates},
		{&bucket.ExhaustedError{Rejections: []*policy.AdmissionRejectedError{rej}, Last: &bucket.StageError{Err: rej}}, label.FailAdmissionRejected},
		{&bucket.ExhaustedError{Last: &bucket.StageError{Err: policy.ErrNoCandidates}}, label.FailNoCandidates},
		{errors.New("connection reset"), label.FailError},
		// Flow control's ends, each wrapping the last refusal as the Router returns them.
		{fmt.Errorf("%w; last refusal: %w", &flowcontrol.RejectedError{Reason: "queue_full"}, exhausted), label.FailFlowRejected},
		{fmt.Errorf("%w after 1s in band 0; last refusal: %w", flowcontrol.ErrTimeout, exhausted), label.FailFlowTimeout},
		{fmt.Errorf("gave up waiting: %w; last refusal: %w", context.Canceled, exhausted), label.FailCanceled},
	} {
		assert.Equal(t, tc.want, enginepick.FailureReason(tc.err), "FailureReason(%v)", tc.err)
	}
}

// TestCheckHealthWarnsOncePerInterval checks the degraded-state warnings (docs/design.md §15):
// polled engines with stale loads, caps on reported metrics with no fresh report, and untrusted
// index entries are each warned about, and a repeated warning inside the interval is dropped.
func TestCheckHealthWarnsOncePerInterval(t *testing.T) {
	t.Parallel()
	srv := loadServer(t, nil, nil) // every poll fails: loads stay unknown
	core, logs := observer.New(zapcore.InfoLevel)
	cfg := mustParse(t, fmt.Sprintf(`
load: {poll_interval: 1h}
engines:
  - {id: e1, model: m, load: {url: "%[1]s/e1", format: sglang_get_load}}
  - {id: e2, model: m}
models:
  - id: m
    buckets: [{id: a, groups: {plain: {policy: {type: cache_aware, cache_aware: {engine_queue_limit: 4}}}}}]
`, srv.URL))
	r := mustNew(t, cfg, nil, config.WithLogger(zap.New(core)), config.WithWarnInterval(time.Hour))
	require.NoError(t, kvbridge.MarkUntrusted(r.Index(), "e2", 0))
	r.CheckHealth()
	r.CheckHealth()
	warns := logs.FilterLevelExact(zapcore.WarnLevel).All()
	require.Len(t, warns, 3, "three distinct warnings, each once")
	assert.Contains(t, warns[0].Message, "load reports are stale or missing for polled engines")
	assert.Equal(t, []any{"e1"}, warns[0].ContextMap()["engines"])
	assert.Contains(t, warns[1].Message, "no engine has a fresh load report")
	assert.Equal(t, []any{"m"}, warns[1].ContextMap()["models"])
	assert.Contains(t, warns[2].Message, "does not trust some engines")
	assert.Equal(t, []any{"e2"}, warns[2].ContextMap()["engines"])

	infos := logs.FilterMessage("enginepick router configured").All()
	require.Len(t, infos, 1)
	assert.Equal(t, []any{"m: a[0,∞] plain=cache_aware(all)"}, infos[0].ContextMap()["models"])
	assert.Equal(t, int64(1), infos[0].ContextMap()["load_pollers"])
}

// TestNewAffinityPolicies checks session_aware and sticky built from a configuration
// (docs/design.md §12, §14.5): both share the one in-memory store New builds, a session stays on
// its engine, a stateless sticky policy needs no store, and a configuration naming the Redis store
// needs the host to pass it.
func TestNewAffinityPolicies(t *testing.T) {
	t.Parallel()
	const yaml = `
affinity: {idle_timeout: 10m}
engines: [{id: e1, model: chat}, {id: e2, model: chat}, {id: e3, model: chat}, {id: t1, model: tenants}, {id: t2, model: tenants}]
models:
  - id: chat
    default_policy: {type: session_aware, session_aware: {choices: 3}}
    buckets: [{id: a, groups: {plain: {}}}]
  - id: tenants
    buckets: [{id: a, groups: {plain: {policy: {type: sticky, sticky: {fallback: least_load}}}}}]
`
	r := mustNew(t, mustParse(t, yaml), nil)
	require.NotNil(t, r.AffinityStore())
	ms, ok := r.AffinityStore().(*affinity.MemoryStore)
	require.True(t, ok, "an in-memory store")
	assert.Equal(t, 10*time.Minute, ms.IdleTimeout())
	first := map[string]state.EngineID{}
	for round := range 3 {
		for _, tc := range []struct{ model, session, key string }{{"chat", "s1", ""}, {"chat", "s2", ""}, {"tenants", "", "k1"}} {
			req := selectReq(tc.model, 10, 10)
			req.SessionKey, req.RoutingKey = tc.session, tc.key
			d, err := r.Select(context.Background(), req)
			require.NoError(t, err)
			id := tc.model + "/" + tc.session + tc.key
			if round == 0 {
				first[id] = d.Selection.Plain.Engine.ID()
				assert.Contains(t, []string{label.ReasonAssigned, label.ReasonStickyAssigned}, d.Selection.Plain.Reason)
			} else {
				assert.Equal(t, first[id], d.Selection.Plain.Engine.ID(), "%s stays on its engine", id)
				assert.Contains(t, []string{label.ReasonSessionPrimary, label.ReasonStickyPrimary}, d.Selection.Plain.Reason)
			}
			d.Release()
		}
	}
	r.RemoveEngine(first["chat/s1"])
	_, bound, err := r.AffinityStore().Lookup(context.Background(), affinity.Scope{Namespace: "session", Model: "chat", BucketID: "a", Stage: state.StagePlain, Key: "s1"})
	require.NoError(t, err)
	assert.False(t, bound, "RemoveEngine drops the engine's bindings")

	stateless := mustNew(t, mustParse(t, `
engines: [{id: t1, model: m}, {id: t2, model: m}]
models: [{id: m, buckets: [{id: a, groups: {plain: {policy: {type: sticky, sticky: {rendezvous: true, load_factor: 1.25}}}}}]}]
`), nil)
	assert.Nil(t, stateless.AffinityStore(), "rendezvous hashing needs no store")

	redisCfg := mustParse(t, `
affinity: {store: redis, redis: {addrs: ["127.0.0.1:6379"]}}
engines: [{id: e1, model: m}]
models: [{id: m, buckets: [{id: a, groups: {plain: {policy: {type: session_aware}}}}]}]
`)
	_, err = config.New(redisCfg, nil, config.WithHealthInterval(0))
	assert.ErrorIs(t, err, state.ErrMissingField)
	assert.EqualError(t, err, "config: line 2: affinity.store: store redis needs the Redis store: build it with affinity/redisstore from affinity.redis and pass config.WithAffinityStore to New")
	host, err := affinity.NewMemoryStore(affinity.Options{})
	require.NoError(t, err)
	r = mustNew(t, redisCfg, nil, config.WithAffinityStore(host))
	assert.Same(t, host, r.AffinityStore())

	memCfg := mustParse(t, "affinity: {store: memory}\nengines: [{id: e1, model: m}]\nmodels: [{id: m, buckets: [{id: a, groups: {plain: {policy: {type: session_aware}}}}]}]\n")
	_, err = config.New(memCfg, nil, config.WithHealthInterval(0), config.WithAffinityStore(host))
	assert.ErrorIs(t, err, state.ErrConflict)
}

// TestNewRejectsKVEventsNobodyReads checks that KV events need a reader: without a cache_aware
// policy with a local prefix source (or the host's index), they would be followed into nothing.
func TestNewRejectsKVEventsNobodyReads(t *testing.T) {
	t.Parallel()
	cfg := mustParse(t, `
engines: [{id: e1, model: m, kv_events: {endpoint: "tcp://127.0.0.1:5557"}}]
models: [{id: m, buckets: [{id: a, groups: {plain: {policy: {type: power_of_two}}}}]}]
`)
	_, err := config.New(cfg, nil, config.WithHealthInterval(0))
	assert.ErrorIs(t, err, state.ErrConflict)
	assert.EqualError(t, err, "config: line 2: engines[0].kv_events: KV events feed the prefix index, which only a cache_aware policy with a local prefix source reads: attach one, or remove kv_events")
}

// TestNewSweepsIdleBindings checks the affinity store's sweeper that New starts (docs/design.md
// §14.5): it runs every affinity.sweep_interval on the Router's clock, frees the bindings idle
// longer than affinity.idle_timeout, and stops at Close (TestMain's goleak check catches a
// sweeper left running).
func TestNewSweepsIdleBindings(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	now := time.Unix(1_700_000_000, 0)
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	advance := func(d time.Duration) { mu.Lock(); now = now.Add(d); mu.Unlock() }
	cfg := mustParse(t, `
affinity: {idle_timeout: 1m, sweep_interval: 5ms}
engines: [{id: e1, model: m}, {id: e2, model: m}]
models: [{id: m, buckets: [{id: a, groups: {plain: {policy: {type: session_aware}}}}]}]
`)
	r, err := config.New(cfg, nil, config.WithHealthInterval(0), config.WithClock(clock))
	require.NoError(t, err)
	ms, ok := r.AffinityStore().(*affinity.MemoryStore)
	require.True(t, ok)
	bind := func(session string) {
		req := selectReq("m", 10, 10)
		req.SessionKey = session
		d, err := r.Select(context.Background(), req)
		require.NoError(t, err)
		d.Release()
	}
	bind("s1")
	bind("s2")
	require.Equal(t, 2, ms.Len())
	advance(30 * time.Second)
	bind("s2") // a hit refreshes s2's idle time
	advance(45 * time.Second)
	require.Eventually(t, func() bool { return ms.Len() == 1 }, 5*time.Second, time.Millisecond,
		"the sweeper frees s1, idle 75 s > 1 min, and keeps s2, idle 45 s")

	require.NoError(t, r.Close())
	advance(2 * time.Minute)
	time.Sleep(50 * time.Millisecond) // ten sweep intervals
	assert.Equal(t, 1, ms.Len(), "no sweep after Close: s2 is expired but still held")
}

// TestInertQueueGateWarnsThroughTheRouterLogger checks the cache-aware policy's own degraded-state
// warning (docs/design.md §9.3, §15.4) as New wires it: with engine_queue_limit set and no engine
// reporting load, the gate is inert; the warning reaches the Router's logger, rate-limited to one
// per warn interval however many picks meet the condition (the policy alone samples 1 in 64).
func TestInertQueueGateWarnsThroughTheRouterLogger(t *testing.T) {
	t.Parallel()
	core, logs := observer.New(zapcore.WarnLevel)
	cfg := mustParse(t, `
engines: [{id: e1, model: m}, {id: e2, model: m}]
models: [{id: m, buckets: [{id: a, groups: {plain: {policy: {type: cache_aware, cache_aware: {engine_queue_limit: 4}}}}}]}]
`)
	r := mustNew(t, cfg, nil, config.WithLogger(zap.New(core)), config.WithWarnInterval(time.Hour))
	inert := func() []observer.LoggedEntry {
		return logs.FilterMessageSnippet("the queue gate is inert").All()
	}
	req := selectReq("m", 16, 32)
	req.TokenIDs = make([]uint32, 16)
	for range 200 {
		d, err := r.Select(context.Background(), req)
		require.NoError(t, err)
		d.Release()
	}
	got := inert()
	require.Len(t, got, 1, "one warning per interval, not one per pick")
	assert.Equal(t, map[string]any{"model": "m", "bucket": "a", "engine_queue_limit": uint64(4), "engines": int64(2)}, got[0].ContextMap())
}

// TestNewCapsMemoryBindings checks that affinity.max_bindings reaches the in-memory store New
// builds: 100 sessions against a cap of 32 (2 per shard) leave at most 32 bindings, and every
// session beyond them was an eviction.
func TestNewCapsMemoryBindings(t *testing.T) {
	t.Parallel()
	cfg := mustParse(t, `
affinity: {max_bindings: 32}
engines: [{id: e1, model: m}, {id: e2, model: m}]
models: [{id: m, buckets: [{id: a, groups: {plain: {policy: {type: session_aware}}}}]}]
`)
	r := mustNew(t, cfg, nil, config.WithHealthInterval(0))
	ms, ok := r.AffinityStore().(*affinity.MemoryStore)
	require.True(t, ok)
	for i := range 100 {
		req := selectReq("m", 10, 10)
		req.SessionKey = fmt.Sprintf("s%d", i)
		d, err := r.Select(context.Background(), req)
		require.NoError(t, err)
		d.Release()
	}
	assert.LessOrEqual(t, ms.Len(), 32)
	assert.Equal(t, uint64(100-ms.Len()), ms.Evicted())
}

// TestObservedSelectStampsTheDispatchWithItsEnd checks the real-clock path of an observed Select:
// the guards are stamped with the clock reading that ends the timed selection (no second reading,
// docs/performance.md), so both PD legs count as dispatched in [before, after] and the reported
// duration lies within that window.
func TestObservedSelectStampsTheDispatchWithItsEnd(t *testing.T) {
	t.Parallel()
	rec := &recorder{}
	r := mustNew(t, mustParse(t, seedPD), nil, config.WithObserver(rec))

	before := time.Now()
	d, err := r.Select(context.Background(), selectReq("llama", 100, 200))
	after := time.Now()
	require.NoError(t, err)
	defer d.Release()
	for _, id := range []state.EngineID{d.Selection.Prefill.Engine.ID(), d.Selection.Decode.Engine.ID()} {
		n, _ := r.InFlight().DispatchedSince(id, -1, before)
		assert.Equal(t, uint64(1), n, "dispatched at or after the selection began")
		n, _ = r.InFlight().DispatchedSince(id, -1, after.Add(time.Nanosecond))
		assert.Zero(t, n, "dispatched before Select returned")
	}
	require.Len(t, rec.selects, 1)
	assert.True(t, rec.selects[0].Timed, "an Observer without SelectTimingSampler has every selection timed")
	assert.Positive(t, rec.selects[0].Duration)
	assert.LessOrEqual(t, rec.selects[0].Duration, after.Sub(before))
}

// samplingRecorder is a recorder that asks for one selection in every to be timed.
type samplingRecorder struct {
	recorder
	every int
}

func (r *samplingRecorder) SelectTimingEvery() int { return r.every }

// TestSelectTimingSampler checks the optional SelectTimingSampler (docs/design.md §15): every
// selection is still reported, about one in N is timed, an untimed one carries no duration, and
// its dispatch's Done still reports the dispatch's duration (the selection's end is read either
// way). A value below 1 times every selection.
func TestSelectTimingSampler(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		every  int
		lo, hi int // timed selections of 600: more than 6 standard deviations wide
	}{{-5, 600, 600}, {1, 600, 600}, {3, 130, 270}} { // every 3: mean 200, σ ≈ 11.5
		rec := &samplingRecorder{every: tc.every}
		r := mustNew(t, mustParse(t, seedPD), nil, config.WithObserver(rec))
		for range 600 {
			d, err := r.Select(context.Background(), selectReq("llama", 100, 200))
			require.NoError(t, err)
			d.Done(enginepick.Outcome{})
		}
		require.Len(t, rec.selects, 600, "every=%d: every selection reported", tc.every)
		require.Len(t, rec.dones, 600)
		timed := 0
		for i, e := range rec.selects {
			if e.Timed {
				timed++
				assert.Positive(t, e.Duration, "every=%d", tc.every)
			} else {
				assert.Zero(t, e.Duration, "every=%d: an untimed selection carries no duration", tc.every)
			}
			assert.Positive(t, rec.dones[i].Duration, "every=%d: the dispatch is timed from the selection's end", tc.every)
		}
		assert.GreaterOrEqual(t, timed, tc.lo, "every=%d", tc.every)
		assert.LessOrEqual(t, timed, tc.hi, "every=%d", tc.every)
	}
}
