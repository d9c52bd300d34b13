package kvevents

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/enginepick/enginepick/kvindex"
)

// TestStreamCountsCopies: like vLLM's block pool, an engine may store a block it already holds (a
// second copy, computed while the first was cached) and later remove one copy. The rank keeps the
// block, and its children stay reachable, until the last copy is removed. Copies are counted per
// tier; a removal without a medium drops one copy of any tier. A store of a held hash with other
// tokens stays refused, and a clear (AllBlocksCleared, or after a loss) forgets the copies.
func TestStreamCountsCopies(t *testing.T) {
	t.Parallel()
	p, c := block(1, 0), block(1, 1) // hashes 1001 and 1002, c's parent p
	in := func(medium any) []any { e := block(1, 0); e[6] = medium; return e }
	removeP := func(medium any) []any { return removedArray([]uint64{1001}, medium) }
	other := storedArray([]uint64{1001}, nil, prompt(2, 1), "GPU") // p's hash, other tokens
	type step struct {
		seq    uint64
		events []any
		// held: leading blocks of prompt 1 the index matches; device and host: the rank's
		// blocks per tier.
		held, device, host int
	}
	cases := []struct {
		name    string
		steps   []step
		refused uint64 // duplicate_hash refusals
	}{
		{"a second copy of a parent", []step{
			{0, []any{p}, 1, 1, 0},
			{1, []any{p, c}, 2, 2, 0},
			{2, []any{removeP("GPU")}, 2, 2, 0},
			{3, []any{removeP("GPU")}, 0, 1, 0}, // c is left below a hole
			{4, []any{removedArray([]uint64{1002}, "GPU")}, 0, 0, 0},
		}, 0},
		{"three copies in one batch", []step{
			{0, []any{p, p, p}, 1, 1, 0},
			{1, []any{removeP("GPU"), removeP("GPU")}, 1, 1, 0},
			{2, []any{removeP("GPU")}, 0, 0, 0},
		}, 0},
		{"another tier is not a copy", []step{
			{0, []any{in("GPU"), in("CPU")}, 1, 1, 1},
			{1, []any{removeP("GPU")}, 1, 0, 1},
			{2, []any{removeP("CPU")}, 0, 0, 0},
		}, 0},
		{"a copy in each tier", []step{
			{0, []any{in("GPU"), in("CPU"), in("GPU"), in("CPU")}, 1, 1, 1},
			{1, []any{removeP("CPU"), removeP("GPU")}, 1, 1, 1},
			{2, []any{removeP("CPU")}, 1, 1, 0},
			{3, []any{removeP("GPU")}, 0, 0, 0},
		}, 0},
		{"a removal without a medium drops one copy", []step{
			{0, []any{p, p}, 1, 1, 0},
			{1, []any{removeP(nil)}, 1, 1, 0},
			{2, []any{removeP(nil)}, 0, 0, 0},
		}, 0},
		{"other tokens under a held hash stay refused", []step{
			{0, []any{p, other}, 1, 1, 0},
			{1, []any{removeP("GPU")}, 0, 0, 0},
		}, 1},
		{"AllBlocksCleared forgets the copies", []step{
			{0, []any{p, p}, 1, 1, 0},
			{1, []any{clearedArray(), p}, 1, 1, 0},
			{2, []any{removeP("GPU")}, 0, 0, 0},
		}, 0},
		{"a clear after a lost batch forgets the copies", []step{
			{0, []any{p, p}, 1, 1, 0},
			{2, []any{p}, 1, 1, 0}, // batch 1 lost: the rank is cleared, then this batch applied
			{3, []any{removeP("GPU")}, 0, 0, 0},
		}, 0},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			f := newStreamFixture(t, nil, nil)
			for _, s := range tc.steps {
				f.send(s.seq, s.events...)
				assert.Equal(t, s.held, f.held(1, 2), "held after batch %d", s.seq)
				es := engineStats(f.x, eng)
				assert.Equal(t, [2]int{s.device, s.host}, [2]int{es.DeviceBlocks, es.HostBlocks}, "device and host blocks after batch %d", s.seq)
			}
			st := f.stats()
			assert.Equal(t, tc.refused, st.Refused["duplicate_hash"])
			assert.Equal(t, tc.refused, st.Rejected)
			assert.Zero(t, st.UnknownRemovals)
			if tc.refused > 0 {
				require.Len(t, f.errs, 1)
				assert.ErrorIs(t, f.errs[0], kvindex.ErrDuplicateHash)
			}
			assert.Empty(t, f.s.app.copies, "every copy removed or cleared")
		})
	}
}
