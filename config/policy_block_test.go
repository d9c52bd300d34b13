package config_test

import (
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/config"
)

// An options block survives a JSON round trip: the marshalled Config names it under its type.
func TestPolicyBlockRoundTrip(t *testing.T) {
	t.Parallel()
	cfg, err := config.Parse([]byte("models: [{id: m, buckets: [{id: a, groups: {plain: {policy: {type: cache_aware, cache_aware: {min_matched_tokens: 512}}}}}]}]\n"))
	require.NoError(t, err)
	b, err := json.Marshal(cfg.Models[0].Buckets[0].Groups.Plain.Policy)
	require.NoError(t, err)
	assert.JSONEq(t, `{"type": "cache_aware", "cache_aware": {"min_matched_tokens": 512}}`, string(b))
}
