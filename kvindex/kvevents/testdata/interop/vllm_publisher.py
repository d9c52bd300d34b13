#!/usr/bin/python3
"""A KV-event publisher framed exactly as vLLM's ZmqEventPublisher, on real libzmq.

Used by TestInteropLibzmqPublisher (interop_test.go). It reproduces
vllm-project/vllm vllm/distributed/kv_events.py with the Debian packages python3-zmq and
python3-msgpack instead of msgspec:

- a PUB socket bound at --endpoint sending [topic, seq.to_bytes(8, "big"), payload];
- a ROUTER replay socket bound at --replay that answers [identity, "", start] with
  [identity, "", seq, payload] for every buffered batch numbered start or later, then
  [identity, "", (-1).to_bytes(8, "big", signed=True), b""];
- payloads in both of vLLM's encodings: the array_like batch [ts, events, dp_rank] with tagged
  positional events (trailing None fields, as msgspec writes them), and the map batch
  {"ts", "events", "data_parallel_rank"} with tagged map events.

Control over stdin/stdout, one line each: it prints "ready" once bound, publishes probe messages
on topic "probe" until it reads "go", then publishes the scenario; "restart" publishes a new
stream numbered from 0 (a restarted engine); "quit" or end of input stops it.
"""

import argparse
import sys
import time

import msgpack
import zmq

BLOCK = 4  # tokens per block; the Go test's index uses the same
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def tokens(p, first, n):
    """Tokens of blocks [first, first+n) of prompt p: token i is p<<20 | (i//BLOCK)<<8 | i%BLOCK."""
    return [p << 20 | (i // BLOCK) << 8 | i % BLOCK for i in range(first * BLOCK, (first + n) * BLOCK)]


def stored_array(hashes, parent, toks, medium="GPU"):
    # BlockStored fields in declaration order: block_hashes, parent_block_hash, token_ids,
    # block_size, lora_id, medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind,
    # kv_cache_spec_sliding_window.
    return ["BlockStored", hashes, parent, toks, BLOCK, None, medium, None, None, None, None, None]


def stored_map(hashes, parent, toks, **extra):
    ev = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
          "token_ids": toks, "block_size": BLOCK, "lora_id": None, "medium": "GPU",
          "lora_name": None, "extra_keys": [None] * len(hashes)}
    ev.update(extra)
    return ev


def digest(v):
    """A 32-byte 'sha256' digest whose low 64 bits are v (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)."""
    return bytes(range(24)) + v.to_bytes(8, "big")


class Publisher:
    def __init__(self, endpoint, replay, topic):
        self.ctx = zmq.Context.instance()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.set_hwm(100_000)
        self.pub.bind(endpoint)
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind(replay)
        self.topic = topic.encode("utf-8")
        self.buffer = []  # (seq, payload), like vLLM's deque

    def publish(self, seq, batch, lost=False):
        payload = msgpack.packb(batch, use_bin_type=True)
        self.buffer.append((seq, payload))
        if not lost:
            self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))

    def service_replay(self):
        frame = self.router.recv_multipart()
        if len(frame) != 3:
            return
        client_id, _, start_seq_bytes = frame
        start_seq = int.from_bytes(start_seq_bytes, "big")
        for seq, buf in self.buffer:
            if seq >= start_seq:
                self.router.send_multipart((client_id, b"", seq.to_bytes(8, "big"), buf))
        self.router.send_multipart((client_id, b"", END_SEQ, b""))


def scenario(p):
    ts = time.time()
    u = 1 << 63  # prompt 1: unsigned hashes above 2^63, as vLLM publishes its low 64 bits
    # 0: array batch, two blocks of prompt 1.
    p.publish(0, [ts, [stored_array([u + 1, u + 2], None, tokens(1, 0, 2))], 0])
    # 1: map batch (vLLM's EventBatch without array_like), block 2 of prompt 1, plus an event of a
    # sliding-window group that must be ignored.
    p.publish(1, {"ts": ts, "events": [
        stored_map([u + 3], u + 2, tokens(1, 2, 1), group_idx=0, kv_cache_spec_kind="full_attention"),
        stored_map([77], None, tokens(9, 0, 1), group_idx=1, kv_cache_spec_kind="sliding_window"),
    ], "data_parallel_rank": 0})
    # 2: lost on the PUB socket, kept for replay: block 2 of prompt 1 evicted, prompt 2 block 0
    # stored with a signed (SGLang-style) hash.
    p.publish(2, [ts, [["BlockRemoved", [u + 3], "GPU", None],
                       stored_array([-2001], None, tokens(2, 0, 1))], 0], lost=True)
    # 3: map batch: prompt 2 block 1 (signed parent), and prompt 3 with raw-bytes hashes, in
    # host memory.
    p.publish(3, {"ts": ts, "events": [
        stored_map([-2002], -2001, tokens(2, 1, 1)),
        stored_map([digest(3001), digest(3002)], None, tokens(3, 0, 2), medium="CPU"),
    ], "data_parallel_rank": 0})


def restart(p):
    p.buffer = []
    p.publish(0, [time.time(), [stored_array([4001], None, tokens(4, 0, 1))], 0])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--replay", required=True)
    ap.add_argument("--topic", default="kv")
    args = ap.parse_args()
    p = Publisher(args.endpoint, args.replay, args.topic)
    print("ready", flush=True)

    poller = zmq.Poller()
    poller.register(p.router, zmq.POLLIN)
    poller.register(sys.stdin, zmq.POLLIN)
    started = False
    while True:
        if not started:
            p.pub.send_multipart((b"probe", (0).to_bytes(8, "big"), msgpack.packb([0, []])))
        events = dict(poller.poll(20))
        if p.router in events:
            p.service_replay()
        if events.get(sys.stdin.fileno()) or sys.stdin in events:
            line = sys.stdin.readline()
            cmd = line.strip()
            if cmd == "go":
                started = True
                scenario(p)
                print("published", flush=True)
            elif cmd == "restart":
                restart(p)
                print("restarted", flush=True)
            elif cmd == "quit" or line == "":
                break
    p.pub.close(linger=0)
    p.router.close(linger=0)


if __name__ == "__main__":
    main()
