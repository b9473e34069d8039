"""KV events for routers: the prefix cache's changes, published over ZMQ in
vLLM's wire format, so that KV-aware routers (vllm-router's `kv_aware`
policy, llm-d's KV-cache indexer, Dynamo's KV router) know which replica holds
which prefix.

The core records each block it caches and each cached block it drops, in
order; the engine drains them once a step as one msgpack batch
(`Scheduler.drain_kv_events`), and a `KvEventPublisher` sends it:

- a PUB socket, each batch one multipart message `[topic, seq, payload]`,
  `seq` an 8-byte big-endian count from 0, one per batch;
- optionally a ROUTER replay socket: a client (DEALER or REQ) sends an 8-byte
  big-endian start sequence number and gets back, as `[seq, payload]`
  messages, every batch still buffered from that one on, then the end marker
  `[seq -1 (0xFF x 8), b""]`. The last `buffer_steps` batches are kept.

The publisher runs on a thread of its own: the step loop hands a batch over
and goes on (an inproc socket; ZMQ sockets stay on the thread that uses them;
a handover never blocks the step loop). Events carry prompt token ids: an
endpoint given as a port alone binds to 127.0.0.1 (see `endpoint`).

Bounded: the replay keeps the last `buffer_steps` batches and at most
`buffer_bytes`; at most `hwm` batches wait for the thread. A batch that
cannot be handed over (the thread fell that far behind, or stopped: its error
is logged) is dropped and counted (`dropped`): subscribers see the gap in the
sequence numbers, and the batches after it build on blocks they never heard
of, which routers skip.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import deque
from typing import Any

import kvsched

log = logging.getLogger("kvsched.serve")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_ids = itertools.count()


def endpoint(spec: str) -> str:
    """A ZMQ endpoint from what a user wrote: "PORT" (127.0.0.1), "HOST:PORT",
    or a ZMQ endpoint as it is (tcp://, ipc://, inproc://). `tcp://*:PORT`
    binds every interface: say so explicitly, the events carry prompts."""
    spec = spec.strip()
    if "://" in spec:
        if not spec.split("://", 1)[1]:
            raise kvsched.InvalidConfig(f"KV events endpoint {spec!r}: no address")
        return spec
    host, sep, port = spec.rpartition(":")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise kvsched.InvalidConfig(
            f"KV events endpoint {spec!r}: PORT, HOST:PORT or a ZMQ endpoint "
            "(tcp://HOST:PORT, ipc://PATH)"
        )
    return f"tcp://{host if sep else '127.0.0.1'}:{port}"


def binds(address: str) -> bool:
    """Whether the PUB socket binds `address`: a wildcard or loopback host, or
    an ipc/inproc path. Any other host is a collector's, listening there for
    publishers to connect (llm-d's KV-cache indexer does): the socket
    connects to it, as vLLM's does."""
    if address.startswith(("ipc://", "inproc://")):
        return True
    host = address.split("://", 1)[1].rpartition(":")[0]
    return host in ("*", "0.0.0.0", "::", "[::]", "127.0.0.1", "localhost", "[::1]")


class KvEventPublisher:
    """Publishes the batches handed to `publish`, in order, on `address` (see
    the module's doc); `replay_address`: where late subscribers ask for what
    they missed. `close()` stops the thread and closes the sockets."""

    def __init__(
        self,
        address: str,
        *,
        replay_address: str | None = None,
        topic: str = "",
        buffer_steps: int = 10_000,
        buffer_bytes: int = 256 << 20,
        hwm: int = 100_000,
    ) -> None:
        try:
            import zmq
        except ImportError as e:
            raise kvsched.InvalidConfig("KV events need pyzmq: pip install 'kvsched[serve]'") from e
        if buffer_steps < 1:
            raise kvsched.InvalidConfig(f"buffer_steps: at least 1, not {buffer_steps}")
        self.address = endpoint(address)
        self.replay_address = None if replay_address is None else endpoint(replay_address)
        self.topic = topic.encode()
        self.published = 0
        self.dropped = 0
        self._hwm = hwm
        self._closed = False
        self._buffer_bytes = buffer_bytes
        self._zmq = zmq
        self._ctx = zmq.Context()
        self._inbox = f"inproc://kvsched-kv-events-{next(_ids)}"
        self._pull = self._ctx.socket(zmq.PAIR)
        self._pull.bind(self._inbox)
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._replay = None
        try:
            if binds(self.address):
                self._pub.bind(self.address)
            else:
                self._pub.connect(self.address)
            if self.replay_address is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                # A whole replay may be queued for a reader that reads late:
                # past its high-water mark ROUTER drops silently (no end marker).
                self._replay.setsockopt(zmq.SNDHWM, buffer_steps + 2)
                self._replay.bind(self.replay_address)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise kvsched.InvalidConfig(f"KV events: cannot open {self.address}: {e}") from e
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._held = 0  # bytes in the buffer
        self._push: Any = None  # the caller's end of the inbox, made on first use
        self._push_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="kvsched-kv-events", daemon=True)
        self._thread.start()

    def publish(self, batch: bytes) -> None:
        """Hand one batch (`Scheduler.drain_kv_events`) to the publishing thread;
        never blocks (see the module's doc for what is dropped)."""
        if not batch:
            return  # an empty message is the thread's stop signal
        with self._push_lock:
            if self._closed or not self._thread.is_alive():
                self.dropped += 1
                return
            if self._push is None:
                self._push = self._ctx.socket(self._zmq.PAIR)
                self._push.setsockopt(self._zmq.SNDHWM, self._hwm)
                self._push.connect(self._inbox)
            try:
                self._push.send(batch, copy=False, flags=self._zmq.NOBLOCK)
            except self._zmq.Again:
                self.dropped += 1
                if self.dropped == 1 or self.dropped % 1000 == 0:
                    log.warning("KV events: %d batch(es) dropped so far (the publisher "
                                "thread is behind)", self.dropped)  # fmt: skip

    def close(self) -> None:
        """Publish what was handed over, then stop and close the sockets; later
        batches are dropped. Idempotent."""
        with self._push_lock:
            if self._closed:
                return
            self._closed = True
            if self._thread.is_alive():
                if self._push is None:
                    self._push = self._ctx.socket(self._zmq.PAIR)
                    self._push.connect(self._inbox)
                self._push.send(b"")  # the queue holds at most hwm: this waits for room
        self._thread.join(timeout=10)
        with self._push_lock:
            if self._push is not None:
                self._push.close(linger=0)
                self._push = None
        self._ctx.term()

    def _close_sockets(self) -> None:
        for s in (self._pull, self._pub, self._replay):
            if s is not None:
                s.close(linger=0)
        self._ctx.term()

    def _run(self) -> None:
        zmq = self._zmq
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        seq = 0
        try:
            while True:
                for sock, _ in poller.poll():
                    if sock is self._pull:
                        batch = self._pull.recv()
                        if not batch:
                            return
                        self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), batch))
                        if len(self._buffer) == self._buffer.maxlen:
                            self._held -= len(self._buffer[0][1])
                        self._buffer.append((seq, batch))
                        self._held += len(batch)
                        while self._held > self._buffer_bytes and len(self._buffer) > 1:
                            self._held -= len(self._buffer.popleft()[1])
                        seq += 1
                        self.published = seq
                    else:
                        self._answer_replay()
        except Exception:  # noqa: BLE001 - the thread's end must be logged, not lost
            log.exception("KV events: the publisher stopped; batches from now on are dropped")
        finally:
            # What is queued for subscribers goes out first (for a second at most).
            self._pub.close(linger=1000)
            for s in (self._pull, self._replay):
                if s is not None:
                    s.close(linger=0)

    def _answer_replay(self) -> None:
        """One replay request: `[identity, b"", start]` (a REQ or DEALER client's
        envelope); every buffered batch from `start` on, then the end marker."""
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            log.warning("KV events: a replay request of %d frame(s) ignored", len(frames))
            return
        ident, start = frames[0], int.from_bytes(frames[2], "big")
        for s, batch in list(self._buffer):
            if s >= start:
                self._replay.send_multipart((ident, b"", s.to_bytes(8, "big"), batch))
        self._replay.send_multipart((ident, b"", END_SEQ, b""))
