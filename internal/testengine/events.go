package testengine

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"sync"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/vmihailenco/msgpack/v5"
)

// eventKind is the type of a KV event (vllm-project/vllm vllm/distributed/kv_events.py).
type eventKind uint8

const (
	blockStored eventKind = iota
	blockRemoved
	allBlocksCleared
)

// event is one KV event before encoding.
type event struct {
	kind      eventKind
	hashes    []uint64
	parent    uint64
	hasParent bool
	tokens    []uint32
}

// mediumGPU is the medium of every event: the engine has no CPU or disk tier.
const mediumGPU = "GPU"

// endSeq ends a replay (vLLM's ZmqEventPublisher.END_SEQ, −1 as 8 bytes big-endian).
const endSeq = ^uint64(0)

// encodeBatch encodes one KVEventBatch the way msgspec encodes vLLM's structs: fields in
// declaration order, integers in their shortest form, the tag first. In the map encoding, the
// fields that default to None are left out when nil (omit_defaults); the others are always
// written.
func encodeBatch(o *KVEventsOptions, rank int, blockSize int, ts float64, events []event) []byte {
	var buf bytes.Buffer
	enc := msgpack.NewEncoder(&buf)
	enc.UseCompactInts(true)
	var err error
	must := func(e error) {
		if err == nil {
			err = e
		}
	}
	str := func(s string) { must(enc.EncodeString(s)) }
	parent := func(ev event) {
		switch {
		case ev.hasParent:
			must(enc.EncodeUint(ev.parent))
		case o.RootParentZero:
			must(enc.EncodeUint(0))
		default:
			must(enc.EncodeNil())
		}
	}
	hashes := func(hs []uint64) {
		must(enc.EncodeArrayLen(len(hs)))
		for _, h := range hs {
			must(enc.EncodeUint(h))
		}
	}
	tokens := func(ts []uint32) {
		must(enc.EncodeArrayLen(len(ts)))
		for _, t := range ts {
			must(enc.EncodeUint(uint64(t)))
		}
	}
	array := o.Encoding == EncodingArray
	n := 3
	if o.OmitDPRank {
		n = 2
	}
	if array {
		must(enc.EncodeArrayLen(n))
	} else {
		must(enc.EncodeMapLen(n))
		str("ts")
	}
	must(enc.EncodeFloat64(ts))
	if !array {
		str("events")
	}
	must(enc.EncodeArrayLen(len(events)))
	for _, ev := range events {
		switch ev.kind {
		case blockStored:
			if array {
				must(enc.EncodeArrayLen(7))
				str("BlockStored")
				hashes(ev.hashes)
				parent(ev)
				tokens(ev.tokens)
				must(enc.EncodeInt(int64(blockSize)))
				must(enc.EncodeNil()) // lora_id
				str(mediumGPU)
				continue
			}
			must(enc.EncodeMapLen(8))
			str("type")
			str("BlockStored")
			str("block_hashes")
			hashes(ev.hashes)
			str("parent_block_hash")
			parent(ev)
			str("token_ids")
			tokens(ev.tokens)
			str("block_size")
			must(enc.EncodeInt(int64(blockSize)))
			str("lora_id")
			must(enc.EncodeNil())
			str("medium")
			str(mediumGPU)
			str("lora_name")
			must(enc.EncodeNil())
		case blockRemoved:
			if array {
				must(enc.EncodeArrayLen(3))
				str("BlockRemoved")
				hashes(ev.hashes)
				str(mediumGPU)
				continue
			}
			must(enc.EncodeMapLen(3))
			str("type")
			str("BlockRemoved")
			str("block_hashes")
			hashes(ev.hashes)
			str("medium")
			str(mediumGPU)
		case allBlocksCleared:
			if array {
				must(enc.EncodeArrayLen(1))
			} else {
				must(enc.EncodeMapLen(1))
				str("type")
			}
			str("AllBlocksCleared")
		}
	}
	if !o.OmitDPRank {
		if !array {
			str("data_parallel_rank")
		}
		must(enc.EncodeInt(int64(rank)))
	}
	if err != nil {
		panic(fmt.Sprintf("testengine: encoding a KV-event batch into memory: %v", err)) // bytes.Buffer never fails
	}
	return buf.Bytes()
}

// publisher is one rank's KV-event publisher, vLLM's ZmqEventPublisher (vllm-project/vllm
// vllm/distributed/kv_events.py): a bound PUB socket, a bound ROUTER replay socket and a bounded
// buffer of the latest batches. publish is called in event order by the rank (under its mutex).
type publisher struct {
	opts      *KVEventsOptions
	rank      int
	blockSize int
	topic     []byte
	pub       zmq4.Socket
	router    zmq4.Socket // nil without replay
	addr      string      // tcp://127.0.0.1:port of the PUB socket
	replay    string      // of the ROUTER socket; "" without replay
	done      sync.WaitGroup

	mu     sync.Mutex
	drop   int      // batches still to drop (DropBatches)
	next   uint64   // sequence number of the next batch
	buf    [][]byte // the latest batches, numbered first, first+1, …
	first  uint64
	closed bool
}

// quietLog discards zmq4's connection messages.
var quietLog = log.New(io.Discard, "", 0)

// listenZMQ binds a new socket of kind on 127.0.0.1:port (0: a free port) and returns it with its
// endpoint.
func listenZMQ(kind func(context.Context, ...zmq4.Option) zmq4.Socket, port int) (zmq4.Socket, string, error) {
	s := kind(context.Background(), zmq4.WithLogger(quietLog))
	if err := s.Listen(fmt.Sprintf("tcp://127.0.0.1:%d", port)); err != nil {
		_ = s.Close()
		return nil, "", err
	}
	return s, fmt.Sprintf("tcp://127.0.0.1:%d", s.Addr().(*net.TCPAddr).Port), nil
}

// bindRanks binds one socket per rank on consecutive ports from base (0: any free base, retried
// when a later rank's port is taken).
func bindRanks(kind func(context.Context, ...zmq4.Option) zmq4.Socket, base, ranks int) ([]zmq4.Socket, []string, error) {
	var lastErr error
	for range 20 {
		socks, addrs := make([]zmq4.Socket, 0, ranks), make([]string, 0, ranks)
		closeAll := func() {
			for _, s := range socks {
				_ = s.Close()
			}
		}
		port := base
		var err error
		for r := range ranks {
			if r > 0 {
				port = socks[0].Addr().(*net.TCPAddr).Port + r
			}
			var s zmq4.Socket
			var addr string
			if s, addr, err = listenZMQ(kind, port); err != nil {
				break
			}
			socks, addrs = append(socks, s), append(addrs, addr)
		}
		if err == nil {
			return socks, addrs, nil
		}
		closeAll()
		lastErr = err
		if base != 0 {
			break
		}
	}
	return nil, nil, fmt.Errorf("testengine: binding %d consecutive ZMQ ports: %w", ranks, lastErr)
}

// startPublishers binds the PUB (and replay) sockets of every rank and starts the replay loops;
// rank r publishes on topics[r].
func startPublishers(o *Options, topics []string) ([]*publisher, error) {
	pubs, addrs, err := bindRanks(zmq4.NewPub, o.KVEvents.Port, o.DPRanks)
	if err != nil {
		return nil, err
	}
	var routers []zmq4.Socket
	var replays []string
	if !o.KVEvents.NoReplay {
		if routers, replays, err = bindRanks(zmq4.NewRouter, o.KVEvents.ReplayPort, o.DPRanks); err != nil {
			for _, s := range pubs {
				_ = s.Close()
			}
			return nil, err
		}
	}
	out := make([]*publisher, o.DPRanks)
	for r := range out {
		p := &publisher{opts: &o.KVEvents, rank: r, blockSize: o.BlockSize, topic: []byte(topics[r]), pub: pubs[r], addr: addrs[r],
			next: o.KVEvents.FirstSeq, first: o.KVEvents.FirstSeq}
		if routers != nil {
			p.router, p.replay = routers[r], replays[r]
			p.done.Add(1)
			go p.serveReplay()
		}
		out[r] = p
	}
	return out, nil
}

// publish encodes events as the next batch, keeps it for replay and sends it.
func (p *publisher) publish(events []event) {
	if len(events) == 0 {
		return
	}
	payload := encodeBatch(p.opts, p.rank, p.blockSize, float64(time.Now().UnixNano())/1e9, events)
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return
	}
	seq := p.next
	p.next++
	p.buf = append(p.buf, payload)
	if over := len(p.buf) - p.opts.ReplayBufferSize; over > 0 {
		p.buf = p.buf[over:]
		p.first += uint64(over)
	}
	if p.drop > 0 {
		p.drop--
		return
	}
	// A PUB socket never blocks: zmq4 queues the message for its writer.
	_ = p.pub.SendMulti(zmq4.NewMsgFrom(p.topic, be64(seq), payload))
}

// reset empties the replay buffer and numbers the next batch FirstSeq again, as a restarted
// publisher does.
func (p *publisher) reset() {
	p.mu.Lock()
	p.buf, p.next, p.first = nil, p.opts.FirstSeq, p.opts.FirstSeq
	p.mu.Unlock()
}

// nextSeq returns the sequence number the next batch will carry.
func (p *publisher) nextSeq() uint64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.next
}

// serveReplay answers replay requests until the ROUTER socket closes: [identity, "", start]
// gets every buffered batch numbered start or later, then the end marker, framed by
// ReplayFormat. Requests of another shape are ignored, as vLLM ignores them.
func (p *publisher) serveReplay() {
	defer p.done.Done()
	for {
		msg, err := p.router.Recv()
		if err != nil {
			if errors.Is(err, context.Canceled) || p.isClosed() {
				return
			}
			continue
		}
		if len(msg.Frames) != 3 || len(msg.Frames[2]) != 8 {
			continue
		}
		id, start := msg.Frames[0], binary.BigEndian.Uint64(msg.Frames[2])
		p.mu.Lock()
		var replies [][][]byte
		for i, payload := range p.buf {
			if seq := p.first + uint64(i); seq >= start {
				replies = append(replies, p.reply(seq, payload))
			}
		}
		p.mu.Unlock()
		replies = append(replies, p.reply(endSeq, []byte{}))
		for _, frames := range replies {
			if err := p.router.SendMulti(zmq4.NewMsgFrom(append([][]byte{id, {}}, frames...)...)); err != nil {
				break
			}
		}
	}
}

// reply frames one replay answer after the identity and the empty delimiter.
func (p *publisher) reply(seq uint64, payload []byte) [][]byte {
	if p.opts.ReplayFormat == ReplayTopic {
		topic := p.topic
		if seq == endSeq {
			topic = []byte{}
		}
		return [][]byte{topic, be64(seq), payload}
	}
	return [][]byte{be64(seq), payload}
}

func (p *publisher) isClosed() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.closed
}

// close closes both sockets and waits for the replay loop.
func (p *publisher) close() {
	p.mu.Lock()
	p.closed = true
	p.mu.Unlock()
	_ = p.pub.Close()
	if p.router != nil {
		_ = p.router.Close()
	}
	p.done.Wait()
}

func be64(v uint64) []byte {
	b := make([]byte, 8)
	binary.BigEndian.PutUint64(b, v)
	return b
}
