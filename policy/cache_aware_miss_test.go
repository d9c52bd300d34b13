package policy_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/internal/label"
	"github.com/enginepick/enginepick/internal/loadbridge"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

// docs/design.md §9.9: a miss goes to an engine without in-flight prefill when the tier has one.
// "prefilling" holds a 700-token dispatch of this router without a first token that its last
// report, written before the engine took it, does not show: on the reports it is the less
// pressured engine (no running request, against 3 decoding on "decoding"), and its pending prefill
// is within the cost margin of the other's. The miss waits behind no prefill on "decoding".
// A router replica's shared dispatch counts as this router's own do. Without first tokens from the host no prefill is known to be in flight and the reports decide;
// with a prefill in flight on every engine, so do they; for a request for a LoRA adapter the
// engines' residency of it comes first (docs/design.md §18), and the reports decide the rest.
func TestCacheAwareMissAvoidsInFlightPrefill(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name        string
		basic       bool // reports as vLLM's /metrics: running and waiting requests only
		firstTokens bool // the host reports first tokens
		bothBusy    bool // "decoding" holds a prefill in flight too
		peer        bool // the 700 tokens are another router replica's shared dispatch
		adapter     string
		want        state.EngineID
	}{
		{name: "native reports", firstTokens: true, want: "decoding"},
		{name: "basic reports", basic: true, firstTokens: true, want: "decoding"},
		{name: "a router replica's prefill", firstTokens: true, peer: true, want: "decoding"},
		{name: "no first tokens reported", want: "prefilling"},
		{name: "a request for a LoRA adapter", firstTokens: true, adapter: "a", want: "prefilling"},
		{name: "prefill in flight on every engine", firstTokens: true, bothBusy: true, want: "prefilling"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			c := newCacheEnv(t)
			if tc.firstTokens {
				g := c.inflight.Acquire("elsewhere", -1, 100)
				g.FirstToken()
				g.Release()
			}
			if tc.peer {
				loadbridge.ApplyPeer(c.inflight, loadbridge.Change{Op: loadbridge.OpStart, ID: 1, Engine: "prefilling",
					Rank: -1, Tokens: 700, At: c.clk.Now().UnixNano()})
			} else {
				c.inflight.Acquire("prefilling", -1, 700)
			}
			if tc.bothBusy {
				c.inflight.Acquire("decoding", -1, 700)
			}
			c.clk.Advance(10 * time.Millisecond) // the reports follow the dispatches
			report := func(id state.EngineID, running uint64) {
				r := loadmon.Report{Engine: id, RunningRequests: running}
				if tc.basic {
					r.KVCapacityTokens = 1 << 20
					require.NoError(t, c.load.Report(r))
					return
				}
				c.native(id, r)
			}
			report("prefilling", 0)
			report("decoding", 3)
			group := engines(state.StagePrefill, "decoding", "prefilling")

			req := creq(prompt(40*blockTokens, 7))
			req.Adapter = tc.adapter
			pk, err := c.policy(t, policy.CacheAwareOptions{}).Pick(ctx, group, req)
			require.NoError(t, err)
			assert.Equal(t, tc.want, pk.Engine.ID())
			assert.Equal(t, label.ReasonNoCacheCandidate, pk.Reason)
			assert.Equal(t, label.DecisionCacheMiss, c.dec.last().Decision)
		})
	}
}

// docs/design.md §9.9: with router replicas, a miss keeps to the replica's home engines first and
// then to those without in-flight prefill, so that replicas whose shared dispatches have not
// reached each other do not all turn to the same engines they each see without a prefill.
// Replica 0 of 2 has homes e0 and e2; e0 holds a prefill in flight, e1, e2 and e3 none. On the
// reports e2 is the most pressured (3 running, against none). The miss goes to e2.
func TestCacheAwareReplicaMissKeepsToHomeEngines(t *testing.T) {
	t.Parallel()
	c := newCacheEnv(t)
	c.replicas(0, 2)
	g := c.inflight.Acquire("elsewhere", -1, 100)
	g.FirstToken()
	g.Release()
	c.inflight.Acquire("e0", -1, 700)
	c.clk.Advance(10 * time.Millisecond)
	for _, id := range []state.EngineID{"e0", "e1", "e3"} {
		c.native(id, loadmon.Report{Engine: id})
	}
	c.native("e2", loadmon.Report{Engine: "e2", RunningRequests: 3})
	group := engines(state.StagePrefill, "e0", "e1", "e2", "e3")
	p := c.policy(t, policy.CacheAwareOptions{})
	for i := range 8 {
		pk, err := p.Pick(ctx, group, creq(prompt(40*blockTokens, uint32(100+i))))
		require.NoError(t, err)
		assert.Equal(t, state.EngineID("e2"), pk.Engine.ID(), "pick %d", i)
		assert.Equal(t, label.DecisionCacheMiss, c.dec.last().Decision)
	}
}

// docs/design.md §9.9: a miss takes the least pressured engine of the tier while the requests the
// reports show are explained by dispatches known here (this router's or a sharing peer's, in
// flight at the report); once more than a quarter is not, another router sends to the group
// unseen and the miss takes the better of MinLoadChoices (2) sampled. e0…e6 report 4 running
// requests each (28), e7 none; the sample draws e0 and e1, which tie.
func TestCacheAwareMissTakesTheLeastPressuredUnlessAnotherRouterSendsUnseen(t *testing.T) {
	t.Parallel()
	group := manyEngines(8)
	for _, tc := range []struct {
		name  string
		known int  // requests in flight at the reports: 3 or 4 per engine on e0…e6, round-robin from e0
		peer  bool // those are a sharing peer's dispatches
		after bool // those were dispatched after the reports instead
		ended bool // those end after the reports
		churn bool // after the reports, 4 more per engine are dispatched and end
		huge  bool // e0 reports 2^62 running requests instead of 4
		want  state.EngineID
	}{
		{name: "all explained", known: 28, want: "http://e007"},
		{name: "all explained by a peer", known: 28, peer: true, want: "http://e007"},
		{name: "a quarter unexplained", known: 21, want: "http://e007"},
		{name: "more than a quarter unexplained", known: 20, want: "http://e000"},
		{name: "none known", want: "http://e000"},
		{name: "dispatched after the reports", known: 28, after: true, want: "http://e000"},
		{name: "a peer's, dispatched after the reports", known: 28, peer: true, after: true, want: "http://e000"},
		{name: "ended after the reports", known: 28, ended: true, want: "http://e007"},
		{name: "a peer's, ended after the reports", known: 28, peer: true, ended: true, want: "http://e007"},
		{name: "dispatched and ended after the reports", known: 28, churn: true, want: "http://e007"},
		{name: "a report beyond any count", known: 28, huge: true, want: "http://e001"}, // the sample's less loaded
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			c := newCacheEnv(t)
			var ends []func()
			dispatch := func(id state.EngineID) {
				if !tc.peer {
					ends = append(ends, c.inflight.Acquire(id, -1, 0).Release)
					return
				}
				n := uint64(len(ends) + 1)
				loadbridge.ApplyPeer(c.inflight, loadbridge.Change{Op: loadbridge.OpStart, ID: n, Engine: id, Rank: -1,
					At: c.clk.Now().UnixNano()})
				ends = append(ends, func() {
					loadbridge.ApplyPeer(c.inflight, loadbridge.Change{Op: loadbridge.OpEnd, ID: n, Engine: id, Rank: -1})
				})
			}
			known := func() {
				for i := range tc.known {
					dispatch(group[i%7].ID())
				}
			}
			if !tc.after {
				known()
			}
			c.clk.Advance(10 * time.Millisecond)
			for i, e := range group {
				r := loadmon.Report{Engine: e.ID(), KVCapacityTokens: 1 << 20}
				switch {
				case i == 0 && tc.huge:
					r.RunningRequests = 1 << 62
				case i < 7:
					r.RunningRequests = 4
				}
				require.NoError(t, c.load.Report(r))
			}
			c.clk.Advance(10 * time.Millisecond)
			if tc.after {
				known()
			}
			if tc.ended {
				for _, end := range ends {
					end()
				}
			}
			if tc.churn {
				for _, e := range group {
					for range 4 {
						c.inflight.Acquire(e.ID(), -1, 0).Release()
					}
				}
			}
			c.rnd.vals = []int{0, 1}
			pk, err := c.policy(t, policy.CacheAwareOptions{}).Pick(ctx, group, creq(prompt(256, 53)))
			require.NoError(t, err)
			assert.Equal(t, tc.want, pk.Engine.ID())
			assert.Equal(t, label.ReasonNoCacheCandidate, pk.Reason)
		})
	}
}

// docs/design.md §9.9 with DP ranks: the requests an engine's reports show are compared with the
// dispatches in flight at its latest rank's report. Each engine has two ranks; rank 0 reports
// empty, then this router dispatches 4 requests to each of e0…e6, then rank 1 reports them. The
// miss takes the least pressured engine, e7.
func TestCacheAwareMissComparesDPRanksAtTheirLatestReport(t *testing.T) {
	t.Parallel()
	c := newCacheEnv(t)
	group := manyEngines(8)
	report := func(rank int, running func(i int) uint64) {
		for i, e := range group {
			require.NoError(t, c.load.Report(loadmon.Report{Engine: e.ID(), DPRank: rank, KVCapacityTokens: 1 << 20,
				RunningRequests: running(i)}))
		}
	}
	for _, e := range group {
		require.NoError(t, c.load.Expect(e.ID(), 2))
	}
	report(0, func(int) uint64 { return 0 })
	c.clk.Advance(10 * time.Millisecond)
	for _, e := range group[:7] {
		for range 4 {
			c.inflight.Acquire(e.ID(), -1, 0)
		}
	}
	c.clk.Advance(10 * time.Millisecond)
	report(1, func(i int) uint64 { return uint64(4 * min(1, 7-i)) })
	c.rnd.vals = []int{0, 1}
	pk, err := c.policy(t, policy.CacheAwareOptions{}).Pick(ctx, group, creq(prompt(256, 54)))
	require.NoError(t, err)
	assert.Equal(t, state.EngineID("http://e007"), pk.Engine.ID())
}
