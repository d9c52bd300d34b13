package kvevents_test

import (
	"context"
	"fmt"

	"github.com/enginepick/enginepick/kvindex"
	"github.com/enginepick/enginepick/kvindex/kvevents"
)

// Following a vLLM engine with two DP ranks, started with --kv-events-config
// '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",
// "replay_endpoint": "tcp://*:5600"}': each rank binds both ports + its rank. The cache-aware policy reads the same
// index through kvindex.NewLocalSource, which leaves out engines whose stream is resynchronising.
// Not run: it needs a publisher.
func ExampleSubscriber() {
	hasher, _ := kvindex.NewHasher(kvindex.HasherConfig{BlockTokens: 16}) // the engine's block_size
	index, _ := kvindex.NewIndex(hasher, kvindex.Options{})
	sub, err := kvevents.New(kvevents.Options{Index: index})
	if err != nil {
		fmt.Println(err)
		return
	}
	for rank := range 2 {
		err := sub.Add(kvevents.Endpoint{
			Engine:        "http://10.0.0.1:8000",
			DPRank:        rank,
			Address:       fmt.Sprintf("tcp://10.0.0.1:%d", 5557+rank),
			ReplayAddress: fmt.Sprintf("tcp://10.0.0.1:%d", 5600+rank),
		})
		if err != nil {
			fmt.Println(err)
			return
		}
	}
	if err := sub.Start(context.Background()); err != nil {
		fmt.Println(err)
		return
	}
	defer sub.Close()
	for _, s := range sub.Stats().Streams {
		fmt.Println(s.Engine, s.DPRank, s.Connected, s.Trusted, s.Gaps, s.Drops)
	}
}
