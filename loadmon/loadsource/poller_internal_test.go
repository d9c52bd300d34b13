package loadsource

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/loadmon"
)

func TestWaitAddsJitterToTheInterval(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name        string
		jitter, u   float64
		first, next time.Duration
	}{
		{"no_jitter", 0, 0.9, 0, time.Second},
		{"half_jitter_mid", 0.5, 0.5, 250 * time.Millisecond, 1250 * time.Millisecond},
		{"full_jitter_low", 1, 0, 0, time.Second},
		{"full_jitter_high", 1, 0.75, 750 * time.Millisecond, 1750 * time.Millisecond},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			p, err := NewPoller(loadmon.NewTable(), nil, Options{Interval: time.Second, Jitter: tc.jitter, Rand: func() float64 { return tc.u }})
			require.NoError(t, err)
			assert.Equal(t, tc.first, p.wait(true))
			assert.Equal(t, tc.next, p.wait(false))
		})
	}
}
