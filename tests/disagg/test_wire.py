"""What crosses hosts between the front end and a worker: the messages as signed msgpack
(``disagg/wire.py``, ``disagg/link.py``), and which rank runs which worker (``disagg/hosts.py``)."""

from __future__ import annotations

import pickle
import select
import socket
import threading
import time

import msgpack
import pytest

from travelator.disagg import messages as m
from travelator.disagg import wire
from travelator.disagg.hosts import worker_ranks
from travelator.disagg.link import FRONT_END, WORKER, Link, LinkClosed
from travelator.disagg.remote import RemoteWorker
from travelator.engine.control_codec import RefusedMessage
from travelator.engine.outputs import RequestOutput, TokenLogprob
from travelator.engine.request import RequestTimes
from travelator.sampling_params import SamplingParams

SECRET = b"0123456789abcdef-wire"


def _output(stop_reason: int | str | None) -> RequestOutput:
    lp = TokenLogprob(5, -0.5, {5: -0.5, 7: -1.25}, 1)
    return RequestOutput("r1", [1, 2], [5, 9], "ab", new_token_ids=[9], new_text="b", new_logprobs=[lp],
                         finished=True, finish_reason="stop", stop_reason=stop_reason, num_cached_tokens=8,
                         times=RequestTimes(1.0, queued=1.5, first_token=2.0), prompt_logprobs=[None, lp],
                         pooled=[0.25, -1.0])


@pytest.mark.parametrize("stop_reason", [7, "THE END", None])
def test_a_report_crosses_unchanged(stop_reason):
    stats = m.WorkerStats(3, 5, 8, 1, 1, 0, {"steps": 4, "finished": {"stop": 1}}, transfer_bytes=1024)
    report = m.Report(m.WorkerId(m.DECODE, 1), [_output(stop_reason)], stats, admitted=["r1"],
                      failed={"r2": "why"}, lost_peers=[0], clock=12.5)
    assert wire.decode_event(wire.encode_event(report)) == report


def test_commands_cross_unchanged_and_others_are_refused():
    params = SamplingParams(temperature=0.0, max_tokens=3, stop=["x"], seed=4)
    for cmd in (m.Submit("a", [1, 2], params, 0, "salt", 1), m.Expect("a", params, 0, 0), m.Abort("a"),
                m.Forget("a"), m.Check(3), m.STOP):
        assert wire.decode_command(wire.encode_command(cmd)) == cmd
    with pytest.raises(RefusedMessage):  # a pickle is not a message
        wire.decode_command(pickle.dumps(m.Abort("a")))
    with pytest.raises(RefusedMessage):  # a kind the worker does not take
        wire.decode_command(msgpack.packb(["Died", ["Died", ["WorkerId", "decode", 0], "x"]]))
    with pytest.raises(RefusedMessage):  # a field of the wrong type
        wire.decode_command(msgpack.packb(["Abort", ["Abort", 5]]))
    with pytest.raises(RefusedMessage):
        wire.decode_hello(wire.encode_hello(m.WorkerId("shell", 0)))


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        a = socket.create_connection(listener.getsockname())
        return a, listener.accept()[0]


def _linked(front_secret: bytes, worker_secret: bytes) -> tuple[Link | Exception, Link | Exception]:
    a, b = _tcp_pair()
    ends: dict[int, Link | Exception] = {}

    def open_end(sock: socket.socket, secret: bytes, rank: int) -> None:
        try:
            ends[rank] = Link.open(sock, secret, rank)
        except LinkClosed as exc:
            ends[rank] = exc

    t = threading.Thread(target=open_end, args=(b, worker_secret, WORKER))
    t.start()
    open_end(a, front_secret, FRONT_END)
    t.join()
    return ends[FRONT_END], ends[WORKER]


def _frames_to(worker: Link, frames: list[bytes]) -> None:
    """Put ``frames`` on the worker's end of the wire, as a man in the middle would."""
    wire_end, worker.sock = socket.socketpair()
    wire_end.sendall(b"".join(frames))


def test_the_link_passes_frames_and_refuses_a_wrong_secret_an_altered_or_a_replayed_frame():
    front, worker = _linked(SECRET, SECRET)
    front.send_bytes(b"hello")
    front.send_bytes(b"again")
    assert worker.recv_bytes() == b"hello" and worker.recv_bytes() == b"again"
    front.send_bytes(b"transfer 1")
    frame = worker.sock.recv(1 << 16)
    _frames_to(worker, [frame[:-1] + bytes([frame[-1] ^ 1])])  # its last payload byte altered
    with pytest.raises(LinkClosed, match="bad MAC"):
        worker.recv_bytes()
    _frames_to(worker, [frame, frame])
    assert worker.recv_bytes() == b"transfer 1"
    with pytest.raises(LinkClosed, match="replayed"):
        worker.recv_bytes()
    # An end without the secret: neither side gets a link.
    front, worker = _linked(SECRET, b"another-secret-0123456789")
    assert isinstance(front, LinkClosed) and isinstance(worker, LinkClosed)


def test_a_remote_worker_on_its_own_clock_and_its_death():
    front, worker = _linked(SECRET, SECRET)
    remote = RemoteWorker(m.WorkerId(m.DECODE, 0), front, "10.0.0.2")
    # The worker's clock is 1000 s behind: its output's first token came 2 s before it reported.
    worker_now = time.monotonic() - 1000.0
    out = _output(None)
    out.times = RequestTimes(worker_now - 3.0, first_token=worker_now - 2.0)
    stats = m.WorkerStats(0, 0, 0, 0, 0, 0, {})
    worker.send_bytes(wire.encode_event(m.Report(m.WorkerId(m.DECODE, 0), [out], stats, clock=worker_now)))
    got = remote.recv().outputs[0].times
    assert time.monotonic() - got.first_token == pytest.approx(2.0, abs=0.5)
    assert got.first_token - got.arrival == pytest.approx(1.0) and got.queued is None
    assert remote.is_alive() and not select.select([remote.sentinel], [], [], 0)[0]
    worker.close()  # the worker's host went away
    with pytest.raises(EOFError):
        remote.recv()
    assert not remote.is_alive() and select.select([remote.sentinel], [], [], 0)[0]
    assert "connection from 10.0.0.2 ended" in remote.why
    remote.put(m.Abort("r1"))  # to a dead worker: nothing happens


def test_workers_are_dealt_out_over_the_ranks_in_order():
    p0, d0, d1 = m.WorkerId(m.PREFILL, 0), m.WorkerId(m.DECODE, 0), m.WorkerId(m.DECODE, 1)
    assert worker_ranks(1, 1, 2) == {p0: 0, d0: 1}
    assert worker_ranks(1, 2, 2) == {p0: 0, d0: 0, d1: 1}
    assert worker_ranks(1, 2, 1) == {p0: 0, d0: 0, d1: 0}
    with pytest.raises(ValueError, match="every rank runs at least one"):
        worker_ranks(1, 1, 3)
