package policy_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/internal/label"
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

// keeper is a plain CacheObserver that keeps the pointers it is given.
type keeper struct{ kept []*policy.CacheDecision }

func (k *keeper) ObserveCacheDecision(d *policy.CacheDecision) { k.kept = append(k.kept, d) }

// borrower borrows decisions (BorrowCacheDecision): it records what it reads during each call.
type borrower struct {
	keeper
	borrowed []string
}

func (b *borrower) BorrowCacheDecision(d *policy.CacheDecision) {
	b.borrowed = append(b.borrowed, d.Decision)
}

// TestCacheObserverKeepsItsCopyAndBorrowerBorrows checks the two observer contracts: a
// CacheObserver gets its own copy of each decision, which later picks do not overwrite; a
// borrowing observer is called through BorrowCacheDecision only (docs/performance.md, "policy":
// a borrowed decision allocates nothing).
func TestCacheObserverKeepsItsCopyAndBorrowerBorrows(t *testing.T) {
	t.Parallel()
	c := newCacheEnv(t)
	hit := prompt(8*blockTokens, 1)
	miss := prompt(8*blockTokens, 2)
	c.hold(t, "a", hit, 8)
	group := engines(state.StagePrefill, "a", "b")

	k := &keeper{}
	p, err := policy.NewCacheAware(c.cfg(), policy.CacheAwareOptions{Source: c.source, MinMatchedTokens: blockTokens, Observer: k})
	require.NoError(t, err)
	for _, tok := range [][]uint32{hit, miss} {
		_, err := p.Pick(context.Background(), group, creq(tok))
		require.NoError(t, err)
	}
	require.Len(t, k.kept, 2)
	assert.NotSame(t, k.kept[0], k.kept[1], "each decision is its own copy")
	assert.Equal(t, label.DecisionCacheHit, k.kept[0].Decision, "the first copy is not overwritten by the next pick")
	assert.Equal(t, label.DecisionCacheMiss, k.kept[1].Decision)

	b := &borrower{}
	p, err = policy.NewCacheAware(c.cfg(), policy.CacheAwareOptions{Source: c.source, MinMatchedTokens: blockTokens, Observer: b})
	require.NoError(t, err)
	for _, tok := range [][]uint32{hit, miss} {
		_, err := p.Pick(context.Background(), group, creq(tok))
		require.NoError(t, err)
	}
	assert.Equal(t, []string{label.DecisionCacheHit, label.DecisionCacheMiss}, b.borrowed)
	assert.Empty(t, b.kept, "a borrower is not called through ObserveCacheDecision")
}
