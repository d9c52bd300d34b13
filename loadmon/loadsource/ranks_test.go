package loadsource_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/loadmon/loadsource"
	"github.com/enginepick/enginepick/state"
)

// vllmRankPage is a vLLM /metrics page with one series per given engine label ("" leaves the label
// out), each rank running running[i] and waiting waiting[i] requests.
func vllmRankPage(labels []string, running, waiting []int) string {
	var b strings.Builder
	for i, l := range labels {
		lab := `model_name="m"`
		if l != "" {
			lab = fmt.Sprintf(`engine=%q,model_name="m"`, l)
		}
		fmt.Fprintf(&b, "vllm:num_requests_running{%s} %d\nvllm:num_requests_waiting{%s} %d\n", lab, running[i], lab, waiting[i])
	}
	return b.String()
}

// rankFigures returns each rank's running and waiting requests of the engine's load.
func rankFigures(t *testing.T, tab *loadmon.Table, engine state.EngineID) [][2]uint64 {
	t.Helper()
	l, ok := tab.Snapshot().Load(engine)
	require.True(t, ok, "the engine's load is known")
	var out [][2]uint64
	for _, r := range l.RankLoads {
		out = append(out, [2]uint64{r.RunningRequests, r.WaitingRequests})
	}
	return out
}

// TestPerRankPagesRecordEveryRank: an engine whose ranks each serve their own /metrics page (one
// process per rank, on its own port) is polled through RankURLs; each page may label its one rank
// 0 or its global rank, and the engine's load is known with every rank in place.
func TestPerRankPagesRecordEveryRank(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name      string
		start     int
		labels    [2]string
		wantRanks [][2]uint64
	}{
		{"unlabelled_and_own_rank", 0, [2]string{"", "1"}, [][2]uint64{{3, 1}, {5, 2}}},
		{"both_say_zero", 0, [2]string{"0", "0"}, [][2]uint64{{3, 1}, {5, 2}}},
		{"global_ranks_of_a_rank_start", 4, [2]string{"4", "5"}, [][2]uint64{{3, 1}, {5, 2}}},
		{"zero_with_a_rank_start", 4, [2]string{"0", "0"}, [][2]uint64{{3, 1}, {5, 2}}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			tab := loadmon.NewTable()
			require.NoError(t, tab.Expect("e", 2))
			r0 := newEngine(t, vllmRankPage([]string{tc.labels[0]}, []int{3}, []int{1}))
			r1 := newEngine(t, vllmRankPage([]string{tc.labels[1]}, []int{5}, []int{2}))
			p, err := loadsource.NewPoller(tab, []loadsource.Target{{Engine: "e", Format: loadsource.FormatVLLMMetrics, RankStart: tc.start,
				RankURLs: []string{r0.srv.URL + "/metrics", r1.srv.URL + "/metrics"}}}, loadsource.Options{Interval: 5 * time.Second, Timeout: 5 * time.Second})
			require.NoError(t, err)
			require.NoError(t, p.Poll(context.Background(), "e"))
			assert.Equal(t, tc.wantRanks, rankFigures(t, tab, "e"))
			l, _ := tab.Snapshot().Load("e")
			assert.Equal(t, uint64(8), l.RunningRequests)
			assert.Equal(t, uint64(3), l.WaitingRequests)
		})
	}
}

// TestPerRankPageFailures: a per-rank page that fails, or names another rank, leaves its rank out
// (the others are recorded) and the poll returns its error with a *MissingRanksError.
func TestPerRankPageFailures(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name  string
		set   func(e *engine)
		check error
	}{
		{"status_500", func(e *engine) { e.set(500, "", false) }, loadsource.ErrStatus},
		{"another_rank", func(e *engine) { e.set(200, vllmRankPage([]string{"3"}, []int{1}, []int{0}), false) }, loadmon.ErrRankOutOfRange},
		{"two_ranks", func(e *engine) { e.set(200, vllmRankPage([]string{"0", "1"}, []int{1, 1}, []int{0, 0}), false) }, loadmon.ErrRankOutOfRange},
		{"malformed", func(e *engine) { e.set(200, "vllm:num_requests_running 1\n", false) }, loadsource.ErrMalformed},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			clk := newClock()
			tab := loadmon.NewTable(loadmon.WithClock(clk.Now))
			require.NoError(t, tab.Expect("e", 2))
			r0 := newEngine(t, vllmRankPage([]string{"0"}, []int{3}, []int{1}))
			r1 := newEngine(t, vllmRankPage([]string{"1"}, []int{5}, []int{2}))
			p, err := loadsource.NewPoller(tab, []loadsource.Target{{Engine: "e", Format: loadsource.FormatVLLMMetrics, Ranks: 2,
				RankURLs: []string{r0.srv.URL + "/metrics", r1.srv.URL + "/metrics"}}}, loadsource.Options{Interval: 5 * time.Second, Timeout: 5 * time.Second})
			require.NoError(t, err)
			require.NoError(t, p.Poll(context.Background(), "e"))

			clk.Advance(3 * time.Second)
			r0.set(200, vllmRankPage([]string{"0"}, []int{7}, []int{0}), false)
			tc.set(r1)
			err = p.Poll(context.Background(), "e")
			assert.ErrorIs(t, err, tc.check)
			var me *loadsource.MissingRanksError
			require.True(t, errors.As(err, &me), "got %v", err)
			assert.Equal(t, []int{1}, me.Missing)
			assert.Equal(t, [][2]uint64{{7, 0}, {5, 2}}, rankFigures(t, tab, "e"), "rank 0 recorded anew, rank 1's last report stands")
			clk.Advance(loadmon.DefaultFreshness - 3*time.Second + time.Nanosecond)
			_, ok := tab.Snapshot().Load("e")
			assert.False(t, ok, "rank 1's report went stale: unknown")
		})
	}
}

// TestRankStartMapsGlobalRanks: a vLLM node owning global ranks 4..7 labels its series
// engine="4".."7"; with RankStart 4 they are recorded as the engine's ranks 0..3, and a page naming
// a rank outside 4..7 records nothing.
func TestRankStartMapsGlobalRanks(t *testing.T) {
	t.Parallel()
	tab := loadmon.NewTable()
	require.NoError(t, tab.Expect("node", 4))
	eng := newEngine(t, vllmRankPage([]string{"4", "5", "6", "7"}, []int{1, 2, 3, 4}, []int{0, 1, 0, 2}))
	p, err := loadsource.NewPoller(tab, []loadsource.Target{{Engine: "node", URL: eng.srv.URL + "/metrics", Format: loadsource.FormatVLLMMetrics,
		Ranks: 4, RankStart: 4}}, loadsource.Options{Interval: 5 * time.Second, Timeout: 5 * time.Second})
	require.NoError(t, err)
	require.NoError(t, p.Poll(context.Background(), "node"))
	assert.Equal(t, [][2]uint64{{1, 0}, {2, 1}, {3, 0}, {4, 2}}, rankFigures(t, tab, "node"))

	for _, labels := range [][]string{{"3", "4", "5", "6"}, {"5", "6", "7", "8"}, {"0", "1", "2", "3"}} {
		before := tab.Snapshot().Version()
		eng.set(200, vllmRankPage(labels, []int{9, 9, 9, 9}, []int{9, 9, 9, 9}), false)
		assert.ErrorIs(t, p.Poll(context.Background(), "node"), loadmon.ErrRankOutOfRange, "labels %v", labels)
		assert.Equal(t, before, tab.Snapshot().Version(), "labels %v: nothing recorded", labels)
	}

	eng.set(200, vllmRankPage([]string{"4", "6", "7"}, []int{1, 3, 4}, []int{0, 0, 2}), false)
	var me *loadsource.MissingRanksError
	require.True(t, errors.As(p.Poll(context.Background(), "node"), &me))
	assert.Equal(t, []int{1}, me.Missing, "global rank 5 is the engine's rank 1")
}

func TestNewPollerValidatesRanks(t *testing.T) {
	t.Parallel()
	tab := loadmon.NewTable()
	const u = "http://127.0.0.1:1/metrics"
	cases := []struct {
		name string
		t    loadsource.Target
	}{
		{"url_and_rank_urls", loadsource.Target{URL: u, RankURLs: []string{u, u}}},
		{"ranks_disagree", loadsource.Target{Ranks: 3, RankURLs: []string{u, u}}},
		{"relative_rank_url", loadsource.Target{RankURLs: []string{u, "/metrics"}}},
		{"negative_rank_start", loadsource.Target{URL: u, RankStart: -1}},
		{"rank_start_beyond_max", loadsource.Target{URL: u, Ranks: 2, RankStart: loadmon.MaxRanks - 1}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			tc.t.Engine, tc.t.Format = "e", loadsource.FormatVLLMMetrics
			_, err := loadsource.NewPoller(tab, []loadsource.Target{tc.t}, loadsource.Options{})
			assert.ErrorIs(t, err, state.ErrInvalidConfiguration)
		})
	}
	_, err := loadsource.NewPoller(tab, []loadsource.Target{{Engine: "e", Format: loadsource.FormatVLLMMetrics, Ranks: 2,
		RankStart: loadmon.MaxRanks - 2, RankURLs: []string{u, u}}}, loadsource.Options{})
	assert.NoError(t, err, "the last global rank is MaxRanks - 1")
}
