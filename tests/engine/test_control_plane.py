"""The tensor-parallel control plane: every message the engine sends survives the codec
exactly; a pickle, an unknown type tag, a method outside the allow-list, a forged or a
replayed message are refused, and a worker that gets one exits without running it."""

from __future__ import annotations

import datetime
import os
import pickle
import subprocess
import sys
import threading
from pathlib import Path

import msgpack
import pytest
import torch
from torch.distributed import PrefixStore, TCPStore

from tp_deadline import one_thread_per_worker_and_a_deadline
from travelator import LLM
from travelator.engine import tp_executor, tp_protocol
from travelator.engine.control_codec import Codec, RefusedMessage
from travelator.engine.scheduler_output import CachedRequestData, NewRequestData, ScheduledDrafts, SchedulerOutput
from travelator.engine.tp_launch import SECRET_ENV, LaunchEnv, control_secret, host_store
from travelator.engine.tp_protocol import CALLS, STOP, decode_call, decode_result, decode_spec, encode_call
from travelator.engine.tp_worker import Worker
from travelator.model.tp_auth import ControlAuth, ControlAuthError, session_id
from travelator.model.tp_group import TPGroup
from travelator.pooling_params import PoolingParams
from travelator.sampling_params import SamplingParams
from travelator.structured import StructuredOutput


@pytest.fixture(autouse=True)
def _one_thread_per_worker_and_a_deadline(monkeypatch):
    yield from one_thread_per_worker_and_a_deadline(monkeypatch, 120, "control-plane test")


# ---- what the engine really sends -------------------------------------------------------------
def test_every_message_of_a_real_tp2_run_round_trips(monkeypatch):
    """Capture the driver's messages and the workers' replies of a TP=2 run with preemption,
    sampling parameters of every kind and structured outputs: each decodes to what was sent,
    and encodes again to the same bytes."""
    sent: list[tuple[str, object, bytes]] = []
    replies: list[tuple[str, bytes, object]] = []

    def spy(name, fn):
        def wrapper(*args):
            data = fn(*args)
            sent.append((name, args, data))
            return data
        monkeypatch.setattr(tp_executor, name, wrapper)

    spy("encode_spec", tp_protocol.encode_spec)
    spy("encode_call", tp_protocol.encode_call)

    def spy_result(method, data):
        result = decode_result(method, data)
        replies.append((method, data, result))
        return result

    monkeypatch.setattr(tp_executor, "decode_result", spy_result)
    llm = LLM("dummy:tiny", device="cpu", dtype="float32", kernels="torch", tensor_parallel_size=2,
              block_size=8, num_kv_blocks=10, max_num_batched_tokens=16)
    try:
        prompts = [[1] + list(range(10 + i, 40 + i)) for i in range(6)]
        params = [SamplingParams(temperature=0, max_tokens=12),
                  SamplingParams(temperature=0.8, top_p=0.9, top_k=5, seed=3, max_tokens=12, stop=["x"],
                                 stop_token_ids=[7], logprobs=2, repetition_penalty=1.1),
                  SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=1, min_tokens=2),
                  SamplingParams(temperature=0, max_tokens=8, structured=StructuredOutput(regex="[a-z]+")),
                  SamplingParams(temperature=0, max_tokens=8, structured=StructuredOutput(
                      json={"type": "object", "properties": {"a": {"type": "integer"}}})),
                  SamplingParams(temperature=0.5, max_tokens=8, speculate=False,
                                 structured=StructuredOutput(choice=("yes", "no")))]
        llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.counters.preemptions > 0  # resumed requests carry their outputs
        llm.engine.runner.call("memory")
        assert isinstance(llm.engine.runner.held_request_ids(), set)  # the self-check's question
    finally:
        llm.shutdown()

    kinds = {args[0] if name == "encode_call" else "spec" for name, args, _ in sent}
    assert {"spec", "allocate_kv_cache", "held_request_ids", "step", STOP} <= kinds
    steps = [args[1][0] for name, args, _ in sent if name == "encode_call" and args[0] == "step"]
    assert any(r.output_token_ids for s in steps for r in s.new_requests)
    assert any(r.sampling_params.structured is not None for s in steps for r in s.new_requests)
    assert any(s.freed_request_ids for s in steps) and any(s.cached_requests for s in steps)
    for name, args, data in sent:
        if name == "encode_spec":
            (spec,) = args
            assert decode_spec(data) == spec
            assert tp_protocol.encode_spec(decode_spec(data)) == data
        else:
            assert decode_call(data) == (args[0], tuple(args[1]))
            assert encode_call(*decode_call(data)) == data
    for step, (_, args, data) in zip(steps, [c for c in sent if c[0] == "encode_call" and c[1][0] == "step"]):
        for got, want in zip(decode_call(data)[1][0].new_requests, step.new_requests):
            if want.sampling_params.structured is not None:  # not compared by ==: compiled once, carried
                assert got.sampling_params.structured.grammar_text == want.sampling_params.structured.grammar_text
    assert {m for m, _, _ in replies} >= {"allocate_kv_cache", "held_request_ids", "memory"}
    for method, data, result in replies:
        assert tp_protocol.encode_result(method, result) == data


def test_constructed_messages_round_trip():
    """What a TP=2 run does not send (drafts: speculation runs on one rank) still travels."""
    out = SchedulerOutput(
        new_requests=[NewRequestData("a", [1, 2, 3], [4], SamplingParams(temperature=0, seed=None), [0, 1], 2),
                      NewRequestData("e", [1, 2], [], SamplingParams(max_tokens=0, pooling=PoolingParams(
                          "score", label_token_ids=(7, 8))), [2], 0)],
        cached_requests=[CachedRequestData("b", [], 7)], num_scheduled_tokens={"a": 2, "b": 3},
        freed_request_ids=["c"], num_preempted=1, num_decodes=1, num_prefill_tokens=2,
        prefill_request_ids=["a"], drafts={"b": ScheduledDrafts(2, [5, 6]), "d": ScheduledDrafts(3)})
    assert decode_call(encode_call("step", (out, [("b", 9), ("b", 10)]))) == ("step", (out, [("b", 9), ("b", 10)]))
    assert decode_call(encode_call("allocate_kv_cache", (12, 16))) == ("allocate_kv_cache", (12, 16))
    assert decode_call(encode_call(STOP, ())) == (STOP, ())


def test_every_call_is_a_worker_method():
    assert set(CALLS) - {STOP} <= {name for name in vars(Worker) if not name.startswith("_")}


# ---- refused messages ---------------------------------------------------------------------------
class _Boom:
    """Unpickling this runs code: it creates a file."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def test_a_pickle_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    payload = pickle.dumps(("step", (_Boom(marker), []), False))
    with pytest.raises(RefusedMessage, match="not a msgpack message"):
        decode_call(payload)
    with pytest.raises(RefusedMessage):
        decode_spec(payload)
    assert not marker.exists()


@pytest.mark.parametrize("message, error", [
    (["step", [["Evil", "rm -rf /"], []]], "expected SchedulerOutput"),
    (["step", [["SchedulerOutput"], []]], "expected SchedulerOutput of 9 values, got 0"),
    (["runner", []], "'runner' is not a method"),
    (["__init__", [None]], "is not a method"),
    (["allocate_kv_cache", [1, "2"]], r"tuple\.\[1\]: expected int, got str"),
    (["allocate_kv_cache", [1, True]], "expected int, got bool"),
    (["allocate_kv_cache", [1]], "expected tuple of 2 values, got 1"),
    ({"method": "step"}, "expected a call"),
])
def test_unknown_types_methods_and_fields_are_refused(message, error):
    with pytest.raises(RefusedMessage, match=error):
        decode_call(msgpack.packb(message))


def test_a_bad_field_inside_a_step_is_refused_by_name():
    out = SchedulerOutput(cached_requests=[CachedRequestData("b", [1, 2], 7)], num_scheduled_tokens={"b": 1})
    raw = msgpack.unpackb(encode_call("step", (out, [])))
    raw[1][0][2][0][2] = [1, "2"]  # a block id that is not an int
    with pytest.raises(RefusedMessage, match="CachedRequestData.new_block_ids"):
        decode_call(msgpack.packb(raw))
    raw[1][0][2][0] = ["NewRequestData", "b", [], [], None, [], 0]  # another allowed type, out of place
    with pytest.raises(RefusedMessage, match="expected CachedRequestData"):
        decode_call(msgpack.packb(raw))


def test_dtypes_and_devices_come_from_an_allow_list():
    from travelator.engine.model_runner import RunnerSettings

    codec = Codec([RunnerSettings])
    good = RunnerSettings(torch.bfloat16, torch.int8, torch.device("cpu"), 64, frozenset({2}))
    assert codec.decode(codec.encode(good, RunnerSettings), RunnerSettings) == good
    raw = msgpack.unpackb(codec.encode(good, RunnerSettings))
    for i, value, error in [(1, "complex128", "dtype name"), (3, "meta", "device type 'meta'"),
                            (3, "no such device", "not a device")]:
        bad = list(raw)
        bad[i] = value
        with pytest.raises(RefusedMessage, match=error):
            codec.decode(msgpack.packb(bad), RunnerSettings)


def test_a_codec_refuses_what_it_was_not_built_for():
    with pytest.raises(TypeError, match="cannot travel"):
        Codec([]).encode(object(), object)


# ---- authentication -----------------------------------------------------------------------------
def _pair(key_a: bytes = b"k" * 32, key_b: bytes = b"k" * 32) -> tuple[ControlAuth, ControlAuth]:
    session = session_id([b"a" * 16, b"b" * 16])
    return ControlAuth(key_a, 0, 2, session), ControlAuth(key_b, 1, 2, session)


def test_a_sealed_message_opens_once_and_in_order():
    driver, worker = _pair()
    first, second = driver.seal(b"one"), driver.seal(b"two")
    assert worker.open(0, first) == b"one"
    with pytest.raises(ControlAuthError, match="replayed or out of order: sequence number 0, expected 1"):
        worker.open(0, first)
    assert worker.open(0, second) == b"two"


@pytest.mark.parametrize("tamper", ["payload", "mac", "sequence", "sender", "key", "session", "short"])
def test_a_forged_message_is_refused(tamper):
    driver, worker = _pair(key_b=b"other key" * 4 if tamper == "key" else b"k" * 32)
    if tamper == "session":
        worker = ControlAuth(b"k" * 32, 1, 2, session_id([b"a" * 16, b"c" * 16]))
    frame = bytearray(driver.seal(msgpack.packb(["step", []])))
    if tamper == "payload":
        frame[-1] ^= 1
    elif tamper == "mac":
        frame[8] ^= 1
    elif tamper == "sequence":
        frame[0] = 1
    elif tamper == "short":
        frame = frame[:20]
    with pytest.raises(ControlAuthError, match="too short" if tamper == "short" else "bad MAC"):
        worker.open(1 if tamper == "sender" else 0, bytes(frame))


def test_a_rank_without_the_secret_is_refused():
    driver, stranger = _pair(key_b=b"guessed" * 5)
    with pytest.raises(ControlAuthError, match=r"rank\(s\) 1 did not prove"):
        driver.check_proofs([driver.proof(), stranger.proof()])
    with pytest.raises(ControlAuthError, match=r"rank\(s\) 0 did not prove"):
        stranger.check_proofs([driver.proof(), stranger.proof()])
    driver.check_proofs([driver.proof(), _pair()[1].proof()])


def _groups(secrets: list[bytes]) -> list[TPGroup | BaseException]:
    """Build a group of len(secrets) ranks in threads, each with its own secret."""
    server = host_store("127.0.0.1", 0, len(secrets), timeout_s=30)
    results: list[TPGroup | BaseException] = [RuntimeError("did not finish")] * len(secrets)

    def join(rank: int) -> None:
        # Every other rank reaches the store over its own connection, as a process would.
        store = server if rank == 0 else TCPStore("127.0.0.1", server.port, len(secrets), False,
                                                  timeout=datetime.timedelta(seconds=30))
        try:
            results[rank] = TPGroup(store, rank, len(secrets), secrets[rank])
        except BaseException as exc:
            results[rank] = exc

    threads = [threading.Thread(target=join, args=(r,)) for r in range(len(secrets))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def test_a_process_joining_the_store_without_the_secret_is_refused():
    """An attacker on the store's port takes rank 1's place: it cannot prove the secret, so the
    driver refuses the group before reading a message (and the attacker refuses the driver)."""
    driver, attacker = _groups([b"the real secret!", b"a guess at it..."])
    assert isinstance(driver, ControlAuthError) and "rank(s) 1 did not prove" in str(driver)
    assert isinstance(attacker, ControlAuthError)


def test_the_driver_refuses_a_forged_or_replayed_reply():
    """A worker's reply that is forged (bytes pushed into the gather without the MAC) or a
    replay of an earlier one breaks the group on the driver."""
    driver, worker = _groups([b"the real secret!"] * 2)
    assert isinstance(driver, TPGroup) and isinstance(worker, TPGroup)
    t = threading.Thread(target=worker.gather_bytes, args=(b"honest",))
    t.start()
    assert driver.gather_bytes(b"mine") == [b"mine", b"honest"]
    t.join()
    sealed = worker._auth.seal(b"again")
    for frame, error in [(b"\0" * 40 + pickle.dumps(("memory", (), True)), "bad MAC"),
                         (sealed, None), (sealed, "replayed")]:
        worker._auth.seal = lambda data, frame=frame: frame  # what an injector puts on the wire
        t = threading.Thread(target=worker.gather_bytes, args=(b"",))
        t.start()
        if error is None:
            assert driver.gather_bytes(b"mine") == [b"mine", b"again"]
        else:
            with pytest.raises(ControlAuthError, match=error):
                driver.gather_bytes(b"mine")
        t.join()


@pytest.mark.parametrize("attack", ["forged", "pickle with the secret", "unknown type"])
def test_a_worker_refuses_a_forged_message_and_exits(attack, tmp_path):
    """A real worker process joins a group whose driver is the test: after a sound join, the
    driver sends, in place of the spec, a pickle that would create a file with a made-up MAC,
    or, knowing the secret, that pickle, or a type outside the allow-list. The worker runs
    none of it and exits."""
    secret = "a secret shared by the ranks"
    server = host_store("127.0.0.1", 0, 2, timeout_s=60)
    env = {**os.environ, "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(server.port), SECRET_ENV: secret, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-m", "travelator.engine.tp_worker"], env=env,
                            stderr=subprocess.PIPE, text=True)
    try:
        group = TPGroup(PrefixStore("travelator/", server), 0, 2, secret.encode())
        marker = tmp_path / "pwned"
        payload = pickle.dumps(_Boom(marker))
        if attack == "forged":
            group._auth.seal = lambda data: b"\0" * 40 + data  # no secret: a made-up MAC
        if attack == "unknown type":
            payload = msgpack.packb(["Evil", "os.system", "touch pwned"])
        group.broadcast_bytes(payload)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1
    expected = {"forged": "bad MAC", "pickle with the secret": "not a msgpack message",
                "unknown type": "expected TPWorkerSpec, got 'Evil'"}[attack]
    assert "refused a control message" in err and expected in err, err
    assert not marker.exists()


# ---- where the store listens, and the secret ------------------------------------------------
def _listening_addresses(port: int) -> set[str]:
    rows = [line.split() for path in ("/proc/net/tcp", "/proc/net/tcp6") if Path(path).exists()
            for line in Path(path).read_text().splitlines()[1:]]
    return {local.split(":")[0] for _, local, _, state, *_ in rows
            if int(local.split(":")[1], 16) == port and state == "0A"}


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux's socket table")
def test_the_local_store_listens_on_loopback_only():
    server = host_store("127.0.0.1", 0, 2, timeout_s=5)
    assert _listening_addresses(server.port) == {"0100007F"}  # 127.0.0.1, and nothing else


def test_a_secret_is_required_off_loopback(monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    remote = LaunchEnv(1, 2, 0, "192.0.2.10", 29500)
    with pytest.raises(ValueError, match=f"needs a shared secret: set {SECRET_ENV}"):
        control_secret(remote)
    assert control_secret(LaunchEnv(1, 2, 0, "127.0.0.1", 29500)) == b""
    assert control_secret(LaunchEnv(1, 2, 0, "localhost", 29500)) == b""
    monkeypatch.setenv(SECRET_ENV, "short")
    with pytest.raises(ValueError, match="at least 16 characters"):
        control_secret(remote)
    monkeypatch.setenv(SECRET_ENV, "x" * 32)
    assert control_secret(remote) == b"x" * 32
