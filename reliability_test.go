package enginepick_test

import (
	"context"
	"go/parser"
	"go/token"
	"io/fs"
	"math"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick"
	"github.com/enginepick/enginepick/admission"
	"github.com/enginepick/enginepick/bucket"
	"github.com/enginepick/enginepick/kvindex"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

// reliabilityFixture is a router over model "plain" (one bucket "short" of at most 64 input tokens,
// context 128, two engines a and b, power-of-two) and model "slo" (the same engines' model with
// an SLO-first TTFT preference), with a load table, an index and in-flight counters.
type reliabilityFixture struct {
	reg      *state.StaticRegistry
	load     *loadmon.Table
	inflight *loadmon.InFlight
	index    *kvindex.Index
	router   *enginepick.Router
}

func newReliabilityFixture(t *testing.T) *reliabilityFixture {
	t.Helper()
	f := &reliabilityFixture{reg: &state.StaticRegistry{}, load: loadmon.NewTable(), inflight: loadmon.NewInFlight(nil)}
	h, err := kvindex.NewHasher(kvindex.HasherConfig{BlockTokens: 4})
	require.NoError(t, err)
	f.index, err = kvindex.NewIndex(h, kvindex.Options{})
	require.NoError(t, err)
	for _, id := range []state.EngineID{"a", "b"} {
		require.NoError(t, f.reg.Add(state.NewStaticEngine(id, "plain", state.StagePlain)))
		require.NoError(t, f.reg.Add(state.NewStaticEngine(id+"-slo", "slo", state.StagePlain)))
	}
	require.NoError(t, f.load.Expect("b", 2))
	p, err := policy.NewPowerOfN(policy.Config{Load: f.load, InFlight: f.inflight,
		Admission: admission.Limits{MaxInFlightRequests: admission.Cap(8)}}, 2)
	require.NoError(t, err)
	g, err := bucket.NewEngineGroup(p, nil)
	require.NoError(t, err)
	short, err := bucket.NewPlainBucket(bucket.Spec{ID: "short", MaxInputTokens: 64, MaxContextTokens: 128, TTFTEstimate: time.Second}, g)
	require.NoError(t, err)
	plain, err := bucket.NewResolver([]*bucket.Bucket{short}, bucket.ResolverOptions{})
	require.NoError(t, err)
	slo, err := bucket.NewResolver([]*bucket.Bucket{short}, bucket.ResolverOptions{TTFTPreference: bucket.SLOFirst})
	require.NoError(t, err)
	f.router, err = enginepick.NewRouter(enginepick.Options{Registry: f.reg, InFlight: f.inflight, Load: f.load, Index: f.index,
		Resolvers: map[state.ModelID]*bucket.Resolver{"plain": plain, "slo": slo}})
	require.NoError(t, err)
	// Some state worth protecting: a report, a held dispatch, indexed blocks.
	require.NoError(t, f.load.Report(loadmon.Report{Engine: "a", RunningRequests: 2, UsedKVTokens: 10, KVCapacityTokens: 100}))
	require.NoError(t, f.index.Store(kvindex.StoreEvent{Engine: "a", BlockHashes: []uint64{1, 2}, TokenIDs: []uint32{1, 2, 3, 4, 5, 6, 7, 8}, Tier: kvindex.TierDevice}))
	d, err := f.router.Select(context.Background(), &bucket.Request{Model: "plain", Signals: bucket.Signals{InputTokens: 8}})
	require.NoError(t, err)
	t.Cleanup(d.Release)
	return f
}

// fingerprint is everything a refused input must leave as it was.
type fingerprint struct {
	registry uint64
	load     uint64
	inflight [4]uint64
	index    kvindex.Stats
}

func (f *reliabilityFixture) fingerprint() fingerprint {
	fp := fingerprint{registry: f.reg.EnginesVersion("plain"), load: f.load.Snapshot().Version(), index: f.index.Stats()}
	for i, id := range []state.EngineID{"a", "b", "a-slo", "b-slo"} {
		fp.inflight[i] = f.inflight.Count(id)
	}
	return fp
}

// badInputCase is one row of docs/RELIABILITY.md that is tested here: a malformed input given to
// the library through its public API, the error the caller must see, and (for selections) the
// HTTP status bucket.StatusCode maps it to. Every case must leave the fixture's fingerprint
// unchanged: nothing applied, no guard acquired.
type badInputCase struct {
	name   string
	apply  func(f *reliabilityFixture) error
	want   error
	status int // 0: not a selection
}

func selectWith(req *bucket.Request) func(f *reliabilityFixture) error {
	return func(f *reliabilityFixture) error {
		d, err := f.router.Select(context.Background(), req)
		if err == nil {
			d.Release()
		}
		return err
	}
}

var badInputCases = []badInputCase{
	// Requests and signals (Router.Select).
	{"select_nil_request", selectWith(nil), policy.ErrInvalidSignal, http.StatusInternalServerError},
	{"select_unknown_model", selectWith(&bucket.Request{Model: "nope"}), enginepick.ErrUnknownModel, http.StatusNotFound},
	{"select_negative_input", selectWith(&bucket.Request{Model: "plain", Signals: bucket.Signals{InputTokens: -1}}),
		policy.ErrInvalidSignal, http.StatusInternalServerError},
	{"select_negative_peak", selectWith(&bucket.Request{Model: "plain", Signals: bucket.Signals{InputTokens: 4, ExpectedPeakTokens: -1, HasExpectedPeak: true}}),
		policy.ErrInvalidSignal, http.StatusInternalServerError},
	{"select_peak_below_input", selectWith(&bucket.Request{Model: "plain", Signals: bucket.Signals{InputTokens: 8, ExpectedPeakTokens: 7, HasExpectedPeak: true}}),
		policy.ErrInvalidSignal, http.StatusInternalServerError},
	{"select_token_ids_disagree_with_input", selectWith(&bucket.Request{Model: "plain", Signals: bucket.Signals{InputTokens: 8}, TokenIDs: []uint32{1, 2, 3}}),
		policy.ErrInvalidSignal, http.StatusInternalServerError},
	{"select_input_beyond_every_bucket", selectWith(&bucket.Request{Model: "plain", Signals: bucket.Signals{InputTokens: 65}}),
		bucket.ErrNoMatchingBucket, http.StatusBadRequest},
	{"select_peak_beyond_every_context", selectWith(&bucket.Request{Model: "plain", Signals: bucket.Signals{InputTokens: 8, ExpectedPeakTokens: 129, HasExpectedPeak: true}}),
		bucket.ErrNoMatchingBucket, http.StatusBadRequest},
	{"select_invalid_ttft_target", selectWith(&bucket.Request{Model: "slo", Signals: bucket.Signals{InputTokens: 8, HasTTFTTarget: true, TTFTTarget: -time.Second}}),
		policy.ErrInvalidSignal, http.StatusInternalServerError},
	{"select_nan_tps_target", selectWith(&bucket.Request{Model: "slo", Signals: bucket.Signals{InputTokens: 8, HasTPSTarget: true, TPSTarget: math.NaN()}}),
		nil, http.StatusOK}, // the TPS preference is disabled for "slo": an invalid TPS target is ignored
	{"select_canceled_client", func(f *reliabilityFixture) error {
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		_, err := f.router.Select(ctx, &bucket.Request{Model: "plain", Signals: bucket.Signals{InputTokens: 8}})
		return err
	}, context.Canceled, 499},
	{"expected_peak_overflow", func(*reliabilityFixture) error {
		_, err := bucket.ExpectedPeak(math.MaxInt64, 1)
		return err
	}, policy.ErrInvalidSignal, 0},

	// Load reports (loadmon.Table).
	{"report_empty_engine", func(f *reliabilityFixture) error { return f.load.Report(loadmon.Report{RunningRequests: 1}) },
		loadmon.ErrInvalidReport, 0},
	{"report_rank_out_of_range", func(f *reliabilityFixture) error { return f.load.Report(loadmon.Report{Engine: "b", DPRank: 2}) },
		loadmon.ErrRankOutOfRange, 0},
	{"report_negative_rank", func(f *reliabilityFixture) error { return f.load.Report(loadmon.Report{Engine: "a", DPRank: -1}) },
		loadmon.ErrRankOutOfRange, 0},
	{"report_kv_above_capacity", func(f *reliabilityFixture) error {
		return f.load.Report(loadmon.Report{Engine: "a", UsedKVTokens: 101, KVCapacityTokens: 100})
	}, loadmon.ErrInvalidReport, 0},
	{"report_negative_busy_time", func(f *reliabilityFixture) error {
		return f.load.Report(loadmon.Report{Engine: "a", Native: &loadmon.NativeLoad{MaxRunningRequests: 1, PrefillBusyTime: -time.Second}})
	}, loadmon.ErrInvalidReport, 0},
	{"report_batch_one_bad_rank", func(f *reliabilityFixture) error {
		return f.load.ReportBatch([]loadmon.Report{{Engine: "b", DPRank: 0, WaitingRequests: 5}, {Engine: "b", DPRank: 1}, {Engine: "b", DPRank: 2}})
	}, loadmon.ErrRankOutOfRange, 0},
	{"report_batch_duplicate_rank", func(f *reliabilityFixture) error {
		return f.load.ReportBatch([]loadmon.Report{{Engine: "a", WaitingRequests: 5}, {Engine: "a", WaitingRequests: 6}})
	}, loadmon.ErrInvalidReport, 0},
	{"expect_zero_ranks", func(f *reliabilityFixture) error { return f.load.Expect("a", 0) }, state.ErrInvalidConfiguration, 0},
	{"expect_too_many_ranks", func(f *reliabilityFixture) error { return f.load.Expect("a", loadmon.MaxRanks+1) }, state.ErrInvalidConfiguration, 0},

	// KV events at the index (kvindex.Index); the full matrix is kvindex TestRefusedOperationsChangeNothing.
	{"index_store_block_size_mismatch", func(f *reliabilityFixture) error {
		return f.index.Store(kvindex.StoreEvent{Engine: "b", BlockHashes: []uint64{9}, TokenIDs: []uint32{1, 2, 3}, Tier: kvindex.TierDevice})
	}, kvindex.ErrBlockSizeMismatch, 0},
	{"index_store_unknown_parent", func(f *reliabilityFixture) error {
		return f.index.Store(kvindex.StoreEvent{Engine: "a", ParentHash: 77, HasParent: true, BlockHashes: []uint64{9}, TokenIDs: []uint32{1, 2, 3, 4}, Tier: kvindex.TierDevice})
	}, kvindex.ErrUnknownParent, 0},
	{"index_remove_unknown_hash", func(f *reliabilityFixture) error { return f.index.Remove("a", 0, []uint64{2, 99}, 0) },
		kvindex.ErrUnknownHash, 0},
	{"index_clear_unknown_engine", func(f *reliabilityFixture) error { return f.index.Clear("zz", 0) }, kvindex.ErrUnknownEngine, 0},

	// Prefix sources (kvindex.Memo).
	{"memo_nil_source", func(*reliabilityFixture) error {
		_, err := new(kvindex.Memo).Lookup(context.Background(), nil, kvindex.Query{TokenIDs: []uint32{1, 2, 3, 4}})
		return err
	}, state.ErrInvalidConfiguration, 0},
	{"memo_uncomparable_source", func(*reliabilityFixture) error {
		_, err := new(kvindex.Memo).Lookup(context.Background(), uncomparableSource{}, kvindex.Query{TokenIDs: []uint32{1, 2, 3, 4}})
		return err
	}, state.ErrInvalidConfiguration, 0},

	// Engines (state.StaticRegistry).
	{"registry_add_duplicate_id", func(f *reliabilityFixture) error {
		return f.reg.Add(state.NewStaticEngine("a", "plain", state.StagePlain))
	}, state.ErrDuplicate, 0},
	{"registry_add_empty_id", func(f *reliabilityFixture) error {
		return f.reg.Add(state.NewStaticEngine("", "plain", state.StagePlain))
	}, state.ErrInvalidConfiguration, 0},
	{"registry_add_invalid_stage", func(f *reliabilityFixture) error {
		return f.reg.Add(state.NewStaticEngine("c", "plain", state.Stage(7)))
	}, state.ErrInvalidConfiguration, 0},
	{"remove_unknown_engine", func(f *reliabilityFixture) error { f.router.RemoveEngine("never-seen"); return nil }, nil, 0},
}

// uncomparableSource is a kvindex.Source that cannot be a memo key: a struct holding a slice.
type uncomparableSource struct{ _ []int }

func (uncomparableSource) Lookup(context.Context, kvindex.Query) (kvindex.Result, error) {
	return kvindex.Result{Outcome: kvindex.OutcomeMiss}, nil
}

// TestBadInputLeavesStateUnchanged runs every badInputCases row against a router holding a report,
// indexed blocks and a dispatch in flight: the caller sees the typed error (and, for selections,
// its HTTP status), and the registry, load table, index and in-flight counters are exactly as they
// were. docs/RELIABILITY.md names each row.
func TestBadInputLeavesStateUnchanged(t *testing.T) {
	t.Parallel()
	for _, c := range badInputCases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			f := newReliabilityFixture(t)
			before := f.fingerprint()
			err := c.apply(f)
			if c.want == nil {
				require.NoError(t, err)
			} else {
				require.ErrorIs(t, err, c.want)
			}
			if c.status != 0 {
				assert.Equal(t, c.status, bucket.StatusCode(err), "status of %v", err)
			}
			assert.Equal(t, before, f.fingerprint(), "%s changed state", c.name)
		})
	}
}

// docTestRef matches a test named in docs/RELIABILITY.md: `pkg.TestName`, `pkg.FuzzName`, or a
// root-package `TestName`, each optionally with a /subtest; pkg is a package name of the module (for
// a main package, its directory's name: `gateway.TestName` is in examples/gateway). A bare
// `/row` names a row of TestBadInputLeavesStateUnchanged.
var docTestRef = regexp.MustCompile("`(?:(?:([a-z0-9_]+)\\.)?((?:Test|Fuzz)[A-Za-z0-9_]+))?(?:/([A-Za-z0-9_]+))?`")

// packageDirs maps the module's package names to their directories, from each directory's
// non-test Go files (a main package under its directory's name).
func packageDirs(t *testing.T) map[string]string {
	t.Helper()
	dirs := map[string]string{}
	err := filepath.WalkDir(".", func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (strings.HasPrefix(d.Name(), ".") && path != "." || d.Name() == "testdata") {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return nil
		}
		f, err := parser.ParseFile(token.NewFileSet(), path, nil, parser.PackageClauseOnly)
		if err != nil {
			return err
		}
		name := f.Name.Name
		if name == "main" {
			name = filepath.Base(filepath.Dir(path))
		}
		dirs[name] = filepath.Dir(path)
		return nil
	})
	require.NoError(t, err)
	return dirs
}

// TestReliabilityDocNamesRealTests keeps docs/RELIABILITY.md honest: every test it names exists in
// the package it names, and every TestBadInputLeavesStateUnchanged row it names is a row of
// badInputCases (and every row is documented).
func TestReliabilityDocNamesRealTests(t *testing.T) {
	t.Parallel()
	doc, err := os.ReadFile(filepath.Join("docs", "RELIABILITY.md"))
	require.NoError(t, err)
	refs := docTestRef.FindAllStringSubmatch(string(doc), -1)
	require.NotEmpty(t, refs)
	sources := map[string]string{}
	source := func(dir string) string {
		if s, ok := sources[dir]; ok {
			return s
		}
		files, err := filepath.Glob(filepath.Join(dir, "*_test.go"))
		require.NoError(t, err)
		var b strings.Builder
		for _, f := range files {
			data, err := os.ReadFile(f)
			require.NoError(t, err)
			b.Write(data)
		}
		sources[dir] = b.String()
		return sources[dir]
	}
	dirs := packageDirs(t)
	documented := map[string]bool{}
	for _, r := range refs {
		if r[2] == "" && r[3] != "" {
			r[2] = "TestBadInputLeavesStateUnchanged"
		}
		if r[2] == "" {
			continue
		}
		dir := "."
		if r[1] != "" {
			var ok bool
			dir, ok = dirs[r[1]]
			if !assert.True(t, ok, "docs/RELIABILITY.md names %s in package %q, which is not a package of the module", r[2], r[1]) {
				continue
			}
		}
		assert.True(t, strings.Contains(source(dir), "func "+r[2]+"("), "docs/RELIABILITY.md names %s in %s: no such test", r[2], dir)
		if r[2] == "TestBadInputLeavesStateUnchanged" && r[3] != "" {
			documented[r[3]] = true
			assert.True(t, slices.ContainsFunc(badInputCases, func(c badInputCase) bool { return c.name == r[3] }),
				"docs/RELIABILITY.md names row %q, which badInputCases lacks", r[3])
		}
	}
	for _, c := range badInputCases {
		assert.True(t, documented[c.name], "row %q of badInputCases is not in docs/RELIABILITY.md", c.name)
	}
}
