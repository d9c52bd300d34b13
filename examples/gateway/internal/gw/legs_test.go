package gw_test

import (
	"bufio"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/examples/gateway/internal/gw"
	"github.com/enginepick/enginepick/state"
)

func pdFixture(t *testing.T) (f *fixture, p, d *engineHandle) {
	t.Helper()
	pe, de := engine(t), engine(t)
	f = newFixture(t, []gw.EngineConfig{
		{URL: pe.URL(), Model: "m", Kind: gw.KindSGLang, Stage: state.StagePrefill, BootstrapPort: 8998},
		{URL: de.URL(), Model: "m", Kind: gw.KindSGLang, Stage: state.StageDecode},
	}, gw.Options{})
	return f, &engineHandle{id: state.EngineID(pe.URL()), e: pe}, &engineHandle{id: state.EngineID(de.URL()), e: de}
}

type engineHandle struct {
	id state.EngineID
	e  interface {
		SetChunks([]string, <-chan struct{}, bool)
		SetGate(<-chan struct{})
	}
}

// openStream posts a streamed chat request and returns the response after its first event.
func openStream(t *testing.T, f *fixture) (*http.Response, *bufio.Reader) {
	t.Helper()
	resp, err := http.Post(f.srv.URL+"/v1/chat/completions", "application/json",
		strings.NewReader(`{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}`))
	require.NoError(t, err)
	t.Cleanup(func() { resp.Body.Close() })
	require.Equal(t, http.StatusOK, resp.StatusCode)
	br := bufio.NewReader(resp.Body)
	line, err := br.ReadString('\n')
	require.NoError(t, err)
	require.True(t, strings.HasPrefix(line, "data: "))
	return resp, br
}

// The prefill engine's guard is released when the prefill leg ends, while the decode stream goes
// on: the prefill engine no longer works on the request and must not look busy (docs/design.md §6).
func TestPDPrefillGuardReleasedWhenThePrefillLegEnds(t *testing.T) {
	t.Parallel()
	f, p, d := pdFixture(t)
	more := make(chan struct{})
	var once sync.Once
	t.Cleanup(func() { once.Do(func() { close(more) }) })
	d.e.SetChunks([]string{"data: {\"a\":1}\n\n", "data: [DONE]\n\n"}, more, false)
	_, br := openStream(t, f)
	require.Eventually(t, func() bool { return f.inflight.Count(p.id) == 0 }, 5*time.Second, time.Millisecond,
		"the prefill leg answered: its guard is released")
	assert.Equal(t, uint64(1), f.inflight.Count(d.id), "the decode stream is still being relayed")
	once.Do(func() { close(more) })
	rest, err := readAll(br)
	require.NoError(t, err)
	assert.Contains(t, rest, "[DONE]")
	require.Eventually(t, func() bool { return f.inflight.Count(d.id) == 0 }, 5*time.Second, time.Millisecond)
	assert.Zero(t, f.inflight.Count(p.id), "released once, never negative")
}

// The decode engine's guard is released when its stream has been relayed, while the prefill leg
// (which runs on, detached) still holds the prefill engine's.
func TestPDDecodeGuardReleasedWhenTheStreamEnds(t *testing.T) {
	t.Parallel()
	f, p, d := pdFixture(t)
	gate := make(chan struct{})
	var once sync.Once
	open := func() { once.Do(func() { close(gate) }) }
	t.Cleanup(open) // a failing test must not leave the detached prefill leg waiting
	p.e.SetGate(gate)
	_, br := openStream(t, f)
	rest, err := readAll(br)
	require.NoError(t, err)
	assert.Contains(t, rest, "[DONE]")
	require.Eventually(t, func() bool { return f.inflight.Count(d.id) == 0 }, 5*time.Second, time.Millisecond,
		"the decode stream ended: its guard is released")
	assert.Equal(t, uint64(1), f.inflight.Count(p.id), "the prefill leg still runs")
	open()
	require.Eventually(t, func() bool { return f.inflight.Count(p.id) == 0 }, 5*time.Second, time.Millisecond)
	assert.Zero(t, f.inflight.Count(d.id))
}

func readAll(br *bufio.Reader) (string, error) {
	b, err := io.ReadAll(br)
	return string(b), err
}
