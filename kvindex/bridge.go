package kvindex

import (
	"github.com/enginepick/enginepick/internal/kvbridge"
	"github.com/enginepick/enginepick/state"
)

// The module's own packages reach the operations below through package kvbridge, which states
// their contracts; they are not part of this package's API.
func init() {
	kvbridge.StoreRestored = func(x, ev any, restored []kvbridge.Restored) ([]kvbridge.Restored, error) {
		return x.(*Index).storeRestored(ev.(StoreEvent), restored)
	}
	kvbridge.MarkUntrusted = func(x any, engine state.EngineID, rank int) error {
		return x.(*Index).markUntrusted(engine, rank)
	}
	kvbridge.MarkTrusted = func(x any, engine state.EngineID, rank int) error {
		return x.(*Index).markTrusted(engine, rank)
	}
	kvbridge.WriterYieldBlocks = func(x any) int { return x.(*Index).yieldBlocks }
	kvbridge.SetPlaceHook = func(x any, fn func(engine state.EngineID, rank int, keys []uint64, held int)) {
		if fn == nil {
			x.(*Index).placeHook.Store(nil)
			return
		}
		x.(*Index).placeHook.Store(&fn)
	}
	kvbridge.PlacePeer = func(x any, engine state.EngineID, rank int, keys []uint64, held int) error {
		return x.(*Index).assume(engine, rank, keys, held, 0, false)
	}
}
