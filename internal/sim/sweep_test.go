package sim

import (
	"bytes"
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/state"
)

// TestSearch checks the capacity search against a scripted threshold: the probe passes at every
// speed up to the threshold. The result must bracket the threshold within the tolerance, from
// either side of the starting speed, and report the capped and never-passing ends.
func TestSearch(t *testing.T) {
	cases := []struct {
		name             string
		threshold, start float64
		wantCapped       bool
		wantNone         bool
	}{
		{"start below", 3.3, 1, false, false},
		{"start above", 3.3, 40, false, false},
		{"start at", 3.3, 3.3, false, false},
		{"threshold fractional", 0.37, 4, false, false},
		{"capped", 5000, 4, true, false},
		{"never", 0.001, 4, false, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var tried []float64
			probe := func(s float64) (bool, PolicyResult, error) {
				tried = append(tried, s)
				return s <= tc.threshold, PolicyResult{TTFT: Latency{P99: s}}, nil
			}
			res, err := search(probe, tc.start, DefaultSweepMinSpeed, DefaultSweepMaxSpeed, 0.05)
			require.NoError(t, err)
			assert.Equal(t, len(tried), res.Probes)
			switch {
			case tc.wantCapped:
				assert.True(t, res.Capped)
				assert.Equal(t, DefaultSweepMaxSpeed, res.Speed)
			case tc.wantNone:
				assert.Zero(t, res.Speed)
				assert.Equal(t, DefaultSweepMinSpeed, res.FailSpeed)
			default:
				assert.LessOrEqual(t, res.Speed, tc.threshold, "passing speed %v", res.Speed)
				assert.Greater(t, res.FailSpeed, tc.threshold, "failing speed %v", res.FailSpeed)
				assert.LessOrEqual(t, res.FailSpeed, res.Speed*1.05*(1+1e-12), "bracket %v..%v", res.Speed, res.FailSpeed)
				assert.Equal(t, res.Speed, res.TTFTP99, "the result describes the passing probe")
				assert.LessOrEqual(t, res.Probes, 12, "tried %v", tried)
			}
		})
	}
	boom := errors.New("boom")
	_, err := search(func(float64) (bool, PolicyResult, error) { return false, PolicyResult{}, boom }, 1, 0.1, 10, 0.05)
	assert.ErrorIs(t, err, boom)
}

// TestSweep runs a small sweep end to end and checks its result against direct replays: each
// policy meets the target at its reported speed and misses it at its failing speed, within the
// tolerance; the report is deterministic.
func TestSweep(t *testing.T) {
	tr, err := MooncakeConversation()
	require.NoError(t, err)
	cfg := SweepConfig{Config: Config{Trace: tr, Fleet: Fleet{Plain: 4}, Limit: 300, Seed: 1, Speed: 2,
		Policies: []string{NameRoundRobin, NameCacheAware, NameDynamo}}, SLO: 20 * time.Second}
	rep, err := Sweep(context.Background(), cfg)
	require.NoError(t, err)
	var buf bytes.Buffer
	require.NoError(t, rep.WriteTable(&buf))
	t.Logf("\n%s", buf.String())
	require.Len(t, rep.Results, 3)
	for _, r := range rep.Results {
		require.Positive(t, r.Speed, r.Policy)
		require.False(t, r.Capped, r.Policy)
		assert.LessOrEqual(t, r.FailSpeed, r.Speed*1.05*(1+1e-12), r.Policy)
		for _, c := range []struct {
			speed float64
			pass  bool
		}{{r.Speed, true}, {r.FailSpeed, false}} {
			one := cfg.Config
			one.Policies, one.Speed = []string{r.Policy}, c.speed
			direct, err := Replay(context.Background(), one)
			require.NoError(t, err)
			p99 := direct.Results[0].TTFT.P99
			assert.Equal(t, c.pass, p99 <= 20, "%s at speed %.4g: TTFT p99 %.2f s", r.Policy, c.speed, p99)
		}
	}
	again, err := Sweep(context.Background(), cfg)
	require.NoError(t, err)
	assert.Equal(t, rep, again, "same config, same sweep")

	for _, bad := range []SweepConfig{
		{Config: cfg.Config, SLO: -time.Second},
		{Config: cfg.Config, Tolerance: -1},
		{Config: cfg.Config, MinSpeed: 4, MaxSpeed: 2},
		{Config: Config{Fleet: Fleet{Plain: 1}}},
	} {
		_, err := Sweep(context.Background(), bad)
		assert.ErrorIs(t, err, state.ErrInvalidConfiguration)
	}
}

// TestSweepTableNotesPoliciesAboveTheCeiling checks that the table names the policies that carried
// more than the sustained ceiling (a trace prefix too short for it to bind), and prints no note
// when none did.
func TestSweepTableNotesPoliciesAboveTheCeiling(t *testing.T) {
	rep := SweepReport{Trace: "t", Requests: 300, SLO: 10, Tolerance: 0.05, Ceiling: &Ceiling{Speed: 5},
		Results: []SweepResult{{Policy: NamePowerOfTwo, Speed: 4.5}, {Policy: NameCacheAware, Speed: 6}, {Policy: NameDynamo, Speed: 5}}}
	var buf bytes.Buffer
	require.NoError(t, rep.WriteTable(&buf))
	assert.Contains(t, buf.String(), "\nnote: cache_aware carried more than this sustained ceiling: on 300 requests")
	rep.Results[1].Speed = 5
	buf.Reset()
	require.NoError(t, rep.WriteTable(&buf))
	assert.NotContains(t, buf.String(), "note:")
}
