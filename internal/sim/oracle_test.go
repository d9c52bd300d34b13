package sim

import (
	"context"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

// oracleFixture is a two-engine replay whose engines a test drives by hand, with 4-token blocks.
type oracleFixture struct {
	r       *run
	engines []state.Engine
	next    int32
}

func newOracleFixture(t *testing.T) *oracleFixture {
	t.Helper()
	tr := &Trace{Name: "oracle", Requests: []Request{{InputTokens: 8, OutputTokens: 2}}}
	cfg := Config{Trace: tr, Fleet: Fleet{Plain: 2}, Model: EngineModel{BlockTokens: 4}, Policies: []string{NameRoundRobin}}
	rc, err := cfg.resolve()
	require.NoError(t, err)
	r, err := newRun(context.Background(), rc, 0, func(int) {})
	require.NoError(t, err)
	f := &oracleFixture{r: r}
	for _, e := range r.front {
		f.engines = append(f.engines, e.static)
	}
	return f
}

// oracle builds an oracle over the fixture's run.
func (f *oracleFixture) oracle(t *testing.T, weight float64) *Oracle {
	t.Helper()
	clock := f.r.clock
	rng := rand.New(rand.NewPCG(1, 2))
	o, err := NewOracle(PolicyEnv{Load: loadmon.NewTable(loadmon.WithClock(clock)), InFlight: loadmon.NewInFlight(clock),
		Index: f.r.indexes[0], Rand: rng.IntN, Now: clock, run: f.r}, NameOracle, weight)
	require.NoError(t, err)
	return o
}

// send queues a prompt of the given tokens on engine k, as the replay does after a pick.
func (f *oracleFixture) send(t *testing.T, k int, toks []uint32) *reqState {
	t.Helper()
	q := &reqState{pos: f.next, input: len(toks), output: 2, tokens: toks, replica: f.r.replicas[0]}
	f.next++
	q.hashes, _ = appendEngineHashes(nil, nil, toks, 4, engineHashSeed)
	require.NoError(t, f.r.front[k].enqueue(q))
	return q
}

// seq returns n blocks of 4 tokens, block i holding 4 copies of base+i.
func seq(base uint32, n int) []uint32 {
	var ids []uint32
	for i := range n {
		ids = append(ids, base+uint32(i))
	}
	return tokens(ids...)
}

// want is the engine model's prefill time of t uncached tokens after c context tokens, written out
// from the EngineModel formula.
func want(m *EngineModel, t, c float64) float64 {
	return t/m.PrefillLinearTokensPerSecond + (t*c+t*(t+1)/2)/m.PrefillAttentionPairsPerSecond
}

func TestOraclePendingPrefillSeconds(t *testing.T) {
	f := newOracleFixture(t)
	m := &f.r.rc.Model
	e := f.r.front[0]
	assert.Zero(t, e.pendingPrefillSeconds(), "idle engine")

	f.send(t, 0, seq(100, 8)) // 32 tokens: admitted at once, one prefill step of 32 tokens
	require.Equal(t, segPrefill, e.kind)
	step := want(m, 32, 0)
	assert.InDelta(t, step, e.pendingPrefillSeconds(), 2e-9, "the step in progress")

	// A second prompt shares the first 4 blocks (16 tokens) with the one in prefill: the engine
	// has not cached them yet, so it queues with all 40 tokens uncached.
	q2 := f.send(t, 0, append(seq(100, 4), seq(500, 6)...))
	require.Equal(t, 40, q2.estUncached)
	assert.InDelta(t, step+want(m, 40, 0), e.pendingPrefillSeconds(), 2e-9)

	// Half-way through the step, half of it is left.
	f.r.now = e.segStart + (e.segEnd-e.segStart)/2
	half := (e.segEnd - f.r.now).Seconds()
	assert.InDelta(t, half+want(m, 40, 0), e.pendingPrefillSeconds(), 2e-9)
}

func TestOraclePendingPrefillSecondsChunked(t *testing.T) {
	f := newOracleFixture(t)
	m := &f.r.rc.Model
	m.ChunkedPrefillTokens = 16
	e := f.r.front[0]
	f.send(t, 0, seq(100, 10)) // 40 tokens in chunks of 16: the first step prefills 16
	require.Equal(t, segPrefill, e.kind)
	// The step in progress (16 tokens from position 0), then the other 24 tokens after 16.
	assert.InDelta(t, want(m, 16, 0)+want(m, 24, 16), e.pendingPrefillSeconds(), 2e-9)
}

func TestOraclePredictedCachedBlocks(t *testing.T) {
	f := newOracleFixture(t)
	e := f.r.front[0]
	f.send(t, 0, seq(100, 8))
	f.send(t, 0, seq(200, 3))
	h := func(toks []uint32) []uint64 { x, _ := appendEngineHashes(nil, nil, toks, 4, engineHashSeed); return x }

	p := append(seq(100, 5), seq(900, 3)...) // shares 5 blocks with the prompt in prefill
	assert.Equal(t, 5, e.predictedCachedBlocks(h(p), len(p)))
	p = append(seq(200, 3), 7) // all 3 blocks of the queued prompt, plus one token
	assert.Equal(t, 3, e.predictedCachedBlocks(h(p), len(p)))
	p = seq(200, 3) // the whole queued prompt: its last token is recomputed, so 2 blocks
	assert.Equal(t, 2, e.predictedCachedBlocks(h(p), len(p)))
	assert.Zero(t, f.r.front[1].predictedCachedBlocks(h(p), len(p)), "the other engine holds nothing")
}

// The oracle sends a request to the engine where it gets its first token soonest: to a queue
// that holds its prefix when that queue is short, elsewhere when waiting there costs more than
// recomputing; with WorkWeight 1 it charges the recompute twice and stays on the holder.
func TestOraclePicksLeastPredictedCost(t *testing.T) {
	f := newOracleFixture(t)
	m := &f.r.rc.Model
	m.ChunkedPrefillTokens = 1 << 20
	req := func(toks []uint32) *policy.Request {
		return &policy.Request{Model: simModel, Stage: state.StagePlain, InputTokens: uint64(len(toks)), TokenIDs: toks}
	}
	prompt := append(seq(100, 200), seq(5000, 4)...) // 816 tokens; 800 of them being prefilled on engine 0
	f.send(t, 0, seq(100, 200))
	hold := f.r.front[0]
	f.r.now = hold.segStart + (hold.segEnd-hold.segStart)/2 // half-way through that prefill
	own := want(m, 16, 800)                                 // its last 4 blocks, after the 200 it shares
	cold := want(m, 816, 0)
	wait := hold.pendingPrefillSeconds()
	require.Less(t, wait+own, cold)

	o := f.oracle(t, 0)
	p, err := o.Pick(context.Background(), f.engines, req(prompt))
	require.NoError(t, err)
	assert.Equal(t, hold.id, p.Engine.ID(), "the holder's wait plus 16 tokens beats 816 cold ones")
	assert.Equal(t, ReasonOracle, p.Reason)

	// Another long prompt queued on the holder: waiting there now costs more than recomputing.
	f.send(t, 0, seq(7000, 120))
	wait = hold.pendingPrefillSeconds()
	require.Greater(t, wait+own, cold)
	p, err = o.Pick(context.Background(), f.engines, req(prompt))
	require.NoError(t, err)
	assert.Equal(t, f.r.front[1].id, p.Engine.ID(), "greedy TTFT: recompute on the idle engine")

	// Charging the prefill a pick causes twice keeps it on the holder while
	// wait + 2·own < 2·cold.
	require.Less(t, wait+2*own, 2*cold)
	p, err = f.oracle(t, 1).Pick(context.Background(), f.engines, req(prompt))
	require.NoError(t, err)
	assert.Equal(t, hold.id, p.Engine.ID(), "work weight 1: the recompute costs the fleet too")
}

func TestOracleNeedsReplay(t *testing.T) {
	_, err := NewOracle(PolicyEnv{}, NameOracle, 0)
	assert.ErrorIs(t, err, state.ErrInvalidConfiguration)
	f := newOracleFixture(t)
	env := PolicyEnv{Load: loadmon.NewTable(), InFlight: loadmon.NewInFlight(time.Now), Index: f.r.indexes[0],
		Rand: func(int) int { return 0 }, run: f.r}
	_, err = NewOracle(env, NameOracle, -1)
	assert.ErrorIs(t, err, state.ErrInvalidConfiguration)
	o, err := NewOracle(env, NameOracle, 0)
	require.NoError(t, err)
	_, err = o.Pick(context.Background(), nil, &policy.Request{})
	assert.ErrorIs(t, err, policy.ErrNoCandidates)
	_, err = o.Pick(context.Background(), []state.Engine{state.NewStaticEngine("elsewhere", simModel, state.StagePlain)}, &policy.Request{})
	assert.Error(t, err, "an engine the replay does not simulate")
}
