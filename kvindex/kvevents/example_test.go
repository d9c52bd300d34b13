package kvevents_test

import (
	"context"
	"fmt"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/enginepick/enginepick/kvindex"
	"github.com/enginepick/enginepick/kvindex/kvevents"
)

// A vLLM batch as its publisher frames it: [topic, sequence, payload], the payload in the
// array-like encoding with a BlockStored of two 2-token blocks and a BlockRemoved.
func ExampleDecoder() {
	payload, _ := msgpack.Marshal([]any{1789095808.83, []any{
		[]any{"BlockStored", []uint64{0xfeedface00000001, 0xfeedface00000002}, nil, []int{1, 2, 3, 4}, 2, nil, "GPU", nil, nil, 0, "full_attention"},
		[]any{"BlockRemoved", []int64{-7}, "CPU"},
	}, 0})
	m, err := kvevents.ParseMessage([][]byte{[]byte("kv-events"), {0, 0, 0, 0, 0, 0, 0, 42}, payload})
	if err != nil {
		fmt.Println(err)
		return
	}
	d := kvevents.NewDecoder()
	var b kvevents.Batch
	if err := d.Decode(m.Payload, &b); err != nil {
		fmt.Println(err)
		return
	}
	fmt.Printf("topic %q seq %d rank %d\n", m.Topic, m.Seq, b.DPRank)
	for _, ev := range b.Events {
		fmt.Printf("%v hashes %x parent %v tokens %v medium %s main group %v\n",
			ev.Kind, ev.BlockHashes, ev.HasParent, ev.TokenIDs, ev.Medium, ev.MainGroup())
	}

	_, err = kvevents.ParseMessage([][]byte{[]byte("kv-events"), payload})
	fmt.Println(err)
	// Output:
	// topic "kv-events" seq 42 rank 0
	// BlockStored hashes [feedface00000001 feedface00000002] parent false tokens [1 2 3 4] medium GPU main group true
	// BlockRemoved hashes [fffffffffffffff9] parent false tokens [] medium CPU main group true
	// kvevents: malformed message frames: 2 frames, want 3 (topic, sequence, payload)
}

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
