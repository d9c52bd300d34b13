package main

import (
	"context"
	"fmt"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/enginepick/enginepick/kvindex"
	"github.com/enginepick/enginepick/state"
)

// kvFeed follows the engines' KV-event publishers into the prefix index.
type kvFeed struct{}

// newKVFeed returns nil when no engine names a KV-event endpoint. An endpoint without a
// cache-aware index is an error: the events would have nowhere to go.
func newKVFeed(specs []engineSpec, index *kvindex.Index, log *zap.Logger) (*kvFeed, error) {
	for _, s := range specs {
		if s.KVEvents != "" {
			return nil, fmt.Errorf("engine %s: kv_events needs the kvindex/kvevents subscriber, not in this build: %w", s.URL, state.ErrInvalidConfiguration)
		}
	}
	return nil, nil
}

func (k *kvFeed) register(*prometheus.Registry) {}
func (k *kvFeed) run(ctx context.Context) error { <-ctx.Done(); return nil }
func (k *kvFeed) close()                        {}
