package kvevents

import (
	"context"
	"encoding/binary"
	"fmt"
	"log"
	"time"

	"github.com/go-zeromq/zmq4"
)

// endSeq is the replay end marker: −1 as 8 bytes big-endian (vllm-project/vllm
// vllm/distributed/kv_events.py, ZmqEventPublisher.END_SEQ).
const endSeq = ^uint64(0)

// zmqReplayer asks a publisher's ROUTER replay socket for its buffered batches. The protocol
// (vllm-project/vllm vllm/distributed/kv_events.py, ZmqEventPublisher._service_replay; SGLang's
// copy is identical): the client, a DEALER, sends ["", start as 8 bytes big-endian]; the ROUTER
// sees [identity, "", start] and answers, for every buffered batch numbered start or later,
// [identity, "", seq, payload], then [identity, "", −1, ""]. The DEALER receives each reply
// without the identity. llm-d's publishers put the topic before the sequence:
// ["", topic, seq, payload], ended by ["", "", −1, ""]; both shapes are accepted.
type zmqReplayer struct {
	addr    string
	timeout time.Duration
	log     *log.Logger
}

// replay dials the replay socket, requests batches from start on and calls fn for each, until the
// end marker. The whole exchange is bounded by r.timeout. A malformed reply ends the replay with
// an error wrapping ErrFrames.
func (r *zmqReplayer) replay(ctx context.Context, start uint64, fn func(seq uint64, payload []byte)) error {
	ctx, cancel := context.WithTimeout(ctx, r.timeout)
	defer cancel()
	sock := zmq4.NewDealer(ctx, zmq4.WithDialerMaxRetries(0), zmq4.WithDialerTimeout(r.timeout), zmq4.WithLogger(r.log))
	defer closeAndDrain(sock)
	if err := sock.Dial(r.addr); err != nil {
		return fmt.Errorf("kvevents: replay from %s: %w", r.addr, err)
	}
	var req [8]byte
	binary.BigEndian.PutUint64(req[:], start)
	if err := sock.SendMulti(zmq4.NewMsgFrom([]byte{}, req[:])); err != nil {
		return fmt.Errorf("kvevents: replay request to %s: %w", r.addr, err)
	}
	for {
		msg, err := sock.Recv()
		if err != nil {
			return fmt.Errorf("kvevents: replay from %s: %w", r.addr, err)
		}
		f := msg.Frames
		switch {
		case len(f) == 3 && len(f[0]) == 0: // ["", seq, payload]
			f = f[1:]
		case len(f) == 4 && len(f[0]) == 0: // ["", topic, seq, payload]
			f = f[2:]
		}
		if len(f) != 2 || len(f[0]) != 8 {
			return &DecodeError{Err: fmt.Errorf("%w: replay reply of %d frames, want [\"\", seq, payload] or [\"\", topic, seq, payload]", ErrFrames, len(msg.Frames))}
		}
		seq := binary.BigEndian.Uint64(f[0])
		if seq == endSeq {
			return nil
		}
		fn(seq, f[1])
	}
}
