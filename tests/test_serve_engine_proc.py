"""The engine-core process, its client and ``v41-serve`` (issue 6): same tokens as ``v41.LLM``, deltas that add
up, abort frees the request, bad input is refused without harm, a dead engine fails requests fast (never a
hang), the heartbeat stays fresh through a long prefill (KF-18), SIGTERM stops the server with status 0.

Every spawned process runs in a session of its own and is killed in a ``finally``."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import httpx
import pytest

from serve_helpers import serve
from v41.engine.args import EngineArgs
from v41.engine.llm import LLM
from v41.engine.params import CompletionOutput, Logprob, RequestMetrics, RequestOutput, SamplingParams
from v41.serve import EngineClient, EngineDeadError, EngineProtocol, EngineStartupError
from v41.serve import messages as m
from v41.testing.tiny import make_tiny

pytestmark = pytest.mark.timeout(60)
ENGINE_KW = dict(block_size=16, kv_cache_bytes=64 << 20, max_num_batched_tokens=4096)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
LONG_PROMPT = [0] + [3 + (i * 7) % 1000 for i in range(3999)]  # one ~2 s prefill step of the tiny model


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The reference LLM here runs on one thread like the engine process: two xdist workers and their engine
    processes share a 2-core machine, and oversubscribed OpenMP threads make steps 20x slower."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("serve-tiny"), "deepseek_v41")


@pytest.fixture(scope="module")
def client(ckpt):
    c = EngineClient(EngineArgs(model=str(ckpt), **ENGINE_KW))
    try:
        yield c
    finally:
        c.shutdown()
        _kill_group(c.proc)


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(str(ckpt), **ENGINE_KW)


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)


async def _collect(engine, prompt, params, rid) -> list[RequestOutput]:
    return [o async for o in engine.generate(prompt, params, rid)]


def _joined(deltas: list[RequestOutput]) -> tuple[list[int], str]:
    return ([t for d in deltas for t in d.outputs[0].token_ids], "".join(d.outputs[0].text for d in deltas))


def _assert_logprobs_close(got: list, want: list) -> None:
    """Same tokens, ranks and decoded text; values within float32 noise (other batch shapes or thread
    counts change reduction orders)."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if g is not None:
            assert {t: (lp.rank, lp.decoded_token) for t, lp in g.items()} == \
                {t: (lp.rank, lp.decoded_token) for t, lp in w.items()}
            assert all(abs(g[t].logprob - w[t].logprob) < 1e-4 for t in g)


# -- codec -------------------------------------------------------------------------------------------------------
def test_every_message_round_trips_through_the_codec():
    params = SamplingParams(temperature=0.5, stop=["x", "yz"], stop_token_ids=[7], logit_bias={5: -1.5}, seed=3)
    samples = [m.AddRequest("r", [0, 5, 9], m.params_to_dict(params), "hi", -4, "tenant"), m.Abort("r"),
               m.StatsRequest(4),
               m.Shutdown(), m.Ready(1, "/d", "/d/tokenizer.json", 4096, {"kinds": ["swa"]}),
               m.StartupFailed("FileNotFoundError", "no dir"), m.Outputs([{"request_id": "r"}]),
               m.Error("r", "invalid", "bad"), m.Heartbeat(3, 0.25, {"running": 1}), m.StatsReply(4, {"a": 1})]
    for msg in samples:
        assert m.decode(m.encode(msg)) == msg
    assert m.params_from_dict(m.decode(m.encode(samples[0])).params) == params
    with pytest.raises(m.ProtocolError):
        m.decode(b"\x93\x63\x01\x02")


def test_drain_yields_waiting_messages_in_order_and_skips_undecodable_ones(caplog):
    import logging

    import zmq

    ctx = zmq.Context.instance()
    rx, tx = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        rx.bind("inproc://drain-test")
        tx.connect("inproc://drain-test")
        sent = [m.Abort("a"), m.StatsRequest(2), m.Shutdown()]
        for data in (m.encode(sent[0]), b"\x93\x63\x01\x02", m.encode(sent[1]), m.encode(sent[2])):
            tx.send(data)
        time.sleep(0.05)  # inproc delivery is asynchronous
        received = []
        with caplog.at_level(logging.ERROR):
            got = list(m.drain(rx, logging.getLogger("drain-test"), "the peer", lambda: received.append(1)))
        assert got == sent and len(received) == 4  # the undecodable one counts as received
        assert "dropping an undecodable message from the peer" in caplog.text
        assert list(m.drain(rx, logging.getLogger("drain-test"), "the peer")) == []  # nothing waiting: no block
    finally:
        rx.close(0)
        tx.close(0)


def test_request_output_dict_round_trip_keeps_logprobs_and_metrics():
    out = RequestOutput(
        request_id="r", prompt="hi", prompt_token_ids=[0, 5], prompt_logprobs=[None, {5: Logprob(-0.5, 1, "a")}],
        outputs=[CompletionOutput(0, "ab", [7, 8], -1.25, [{7: Logprob(-1.0, 1, "a")}, {8: Logprob(-0.25, 2)}],
                                  "stop", 8)],
        finished=True, num_cached_tokens=16, metrics=RequestMetrics(1.0, 1.5, 2.0, 2.5, 2.5))
    assert m.output_from_dict(m.decode(m.encode(m.Outputs([m.output_to_dict(out)]))).outputs[0]) == out


# -- the client ------------------------------------------------------------------------------------------------
def test_both_engines_satisfy_the_front_end_protocol(client):
    from v41.engine.async_engine import AsyncEngine

    assert isinstance(client, EngineProtocol)
    for name in ("generate", "abort", "stats", "tokenizer", "cfg", "max_model_len", "model_dir", "is_running",
                 "last_heartbeat_s", "shutdown"):
        assert hasattr(AsyncEngine, name), name
    assert client.is_running and client.max_model_len == 4096 and client.cfg.vocab_size == 1024
    assert client.tokenizer.token_to_id("<｜User｜>") is not None
    assert os.path.isdir(client.model_dir)


def test_client_greedy_tokens_equal_llm(client, llm):
    prompts = ["Hello there", [0, 17, 99, 512, 3, 44, 45, 46, 47], {"prompt_token_ids": [0] + list(range(50, 90))}]
    for i, prompt in enumerate(prompts):
        want = llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0]
        deltas = asyncio.run(_collect(client, prompt, GREEDY, f"greedy-{i}"))
        tokens, text = _joined(deltas)
        assert tokens == want.token_ids and text == want.text
        assert deltas[-1].finished and deltas[-1].outputs[0].finish_reason == "length"


def test_streamed_deltas_concatenate_to_the_final_output(client, llm):
    params = SamplingParams(temperature=0.8, seed=11, max_tokens=20, logprobs=2, prompt_logprobs=1,
                            stop=["zzz-never"])
    prompt = "The quick brown fox"
    want = llm.generate(prompt, params, use_tqdm=False)[0]
    deltas = asyncio.run(_collect(client, prompt, params, "stream"))
    assert len(deltas) > 1 and not any(d.finished for d in deltas[:-1])
    tokens, text = _joined(deltas)
    final = deltas[-1]
    assert tokens == want.outputs[0].token_ids and text == want.outputs[0].text
    _assert_logprobs_close([lp for d in deltas for lp in d.outputs[0].logprobs], want.outputs[0].logprobs)
    _assert_logprobs_close(final.prompt_logprobs, want.prompt_logprobs)
    assert final.prompt_token_ids == want.prompt_token_ids
    assert final.prompt == prompt and final.outputs[0].finish_reason == want.outputs[0].finish_reason
    met = final.metrics
    assert met.arrival_time <= met.first_scheduled_time <= met.first_token_time <= met.finished_time


def test_cache_salt_and_priority_reach_the_engine_process(client):
    prompt = [0] + list(range(400, 447))  # 48 tokens: three full pages

    async def cached(rid: str, **options) -> int:
        deltas = [o async for o in client.generate(prompt, GREEDY, rid, **options)]
        return deltas[-1].num_cached_tokens

    assert asyncio.run(cached("salt-a", cache_salt="proc-a", priority=3)) == 0
    assert asyncio.run(cached("salt-b", cache_salt="proc-b", priority=-3)) == 0
    assert asyncio.run(cached("salt-a2", cache_salt="proc-a")) >= 32
    with pytest.raises(ValueError, match="priority"):  # refused by the client, before the engine process
        asyncio.run(cached("bad-priority", priority=1 << 40))


def test_priority_orders_admission_in_the_engine_process(ckpt):
    """One sequence at a time: while "first" runs, "low" (priority 5) and then "high" (-5) arrive; "high"
    must run next."""
    c = EngineClient(EngineArgs(model=str(ckpt), **{**ENGINE_KW, "max_num_seqs": 1}))
    try:
        async def run() -> list[str]:
            done: list[str] = []

            async def one(rid: str, params: SamplingParams, priority: int, started=None):
                async for out in c.generate([0, 5, 6, 7], params, rid, priority=priority):
                    if started is not None and not started.is_set():
                        started.set()
                done.append(rid)

            started = asyncio.Event()
            first = asyncio.create_task(one("first", SamplingParams(max_tokens=60, ignore_eos=True), 0, started))
            await started.wait()
            await asyncio.gather(first, one("low", GREEDY, 5), one("high", GREEDY, -5))
            return done

        assert asyncio.run(run()) == ["first", "high", "low"]
    finally:
        c.shutdown()
        _kill_group(c.proc)


def test_concurrent_requests_all_complete(client):
    async def run():
        return await asyncio.gather(*(_collect(client, [0, 5 + i, 9], GREEDY, f"conc-{i}") for i in range(8)))

    for deltas in asyncio.run(run()):
        assert len(_joined(deltas)[0]) == GREEDY.max_tokens and deltas[-1].finished


def test_abort_and_closed_stream_free_the_request(client):
    long = SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True)

    async def run():
        seen = []
        async for out in client.generate([0, 11, 12, 13], long, "to-abort"):
            seen.append(out)
            if len(seen) == 3:
                await client.abort("to-abort")
        assert seen[-1].finished and seen[-1].outputs[0].finish_reason == "abort"
        assert len(_joined(seen)[0]) < 100
        async for out in client.generate([0, 21, 22, 23], long, "to-close"):
            break  # closing the stream aborts the request
        deadline = time.monotonic() + 10  # the abort lands within about one step (slow on a loaded machine)
        while (stats := await client.stats())["running"] and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return stats

    stats = asyncio.run(run())
    assert stats["running"] == 0 and stats["waiting"] == 0 and stats["engine"]["num_requests"] == 0
    assert not stats["engine"]["stale"]


@pytest.mark.parametrize("prompt,params,match", [
    ("", GREEDY, "empty"),
    ([], GREEDY, "empty"),
    ([0] * 5000, GREEDY, "max_model_len"),
    ([0] * 4000, SamplingParams(max_tokens=200), "max_model_len"),  # refused by the engine process
    ([0, 5000], GREEDY, "prompt token ids"),  # refused by the engine process
    ("hi", SamplingParams(temperature=-1.0), "temperature"),
    ("hi", SamplingParams(top_p=1.5), "top_p"),
    ("hi", SamplingParams(n=0), "n must be"),
    ("hi", SamplingParams(max_tokens=0), "max_tokens"),
    (3.5, GREEDY, "unsupported prompt"),
])
def test_bad_input_raises_value_error_and_the_engine_stays_alive(client, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        asyncio.run(_collect(client, prompt, params, "bad"))
    deltas = asyncio.run(_collect(client, [0, 7, 8], GREEDY, "after-bad"))
    assert deltas[-1].finished and client.is_running


def test_duplicate_request_id_in_flight_is_refused(client):
    async def run():
        first = client.generate([0, 1, 2], SamplingParams(max_tokens=50, ignore_eos=True), "dup")
        await first.__anext__()
        with pytest.raises(ValueError, match="already in use"):
            await _collect(client, [0, 3], GREEDY, "dup")
        await first.aclose()

    asyncio.run(run())


def test_heartbeat_stays_fresh_through_a_long_prefill(client):
    """KF-18: one ~2 s prefill step; the heartbeat never ages past 1.5 s and stats do not block."""

    async def run():
        task = asyncio.ensure_future(_collect(client, LONG_PROMPT, SamplingParams(max_tokens=1), "long"))
        worst_age = max_busy = 0.0
        stale_seen = False
        while not task.done():
            await asyncio.sleep(0.1)
            worst_age = max(worst_age, time.monotonic() - client.last_heartbeat_s)
            max_busy = max(max_busy, client.engine_busy_s)
            if client.engine_busy_s > 0.6 and not stale_seen:
                t0 = time.monotonic()
                stats = await client.stats()  # the loop is busy: the last step's figures, marked stale
                assert time.monotonic() - t0 < 3.0 and "running" in stats
                stale_seen = stats["engine"]["stale"]
        deltas = task.result()
        return worst_age, max_busy, stale_seen, deltas

    worst_age, max_busy, stale_seen, deltas = asyncio.run(run())
    assert deltas[-1].finished
    assert max_busy > 1.0, f"the prefill step was too short ({max_busy:.2f} s) to test anything"
    assert worst_age < 1.5 and stale_seen


# -- a dying engine --------------------------------------------------------------------------------------------
def test_killed_engine_fails_in_flight_and_new_requests_fast(ckpt):
    c = EngineClient(EngineArgs(model=str(ckpt), **ENGINE_KW))
    try:
        async def run():
            got = []
            t_kill = None
            with pytest.raises(EngineDeadError):
                async for out in c.generate([0, 5, 6], SamplingParams(max_tokens=3000, ignore_eos=True), "k"):
                    got.append(out)
                    if len(got) == 2:
                        os.killpg(c.pid, signal.SIGKILL)
                        t_kill = time.monotonic()
            assert time.monotonic() - t_kill < 3.0
            t0 = time.monotonic()
            with pytest.raises(EngineDeadError):
                await _collect(c, [0, 1], GREEDY, "after")
            with pytest.raises(EngineDeadError):
                await c.stats()
            assert time.monotonic() - t0 < 0.5
            await c.abort("k")  # a no-op, not an error

        asyncio.run(run())
        assert not c.is_running
    finally:
        c.shutdown()
        _kill_group(c.proc)


def test_wedged_step_stops_the_heartbeat_and_the_engine_counts_as_dead(ckpt):
    c = EngineClient(EngineArgs(model=str(ckpt), **ENGINE_KW), heartbeat_timeout_s=1.0,
                     env={"V41_STEP_TIMEOUT_S": "0.2"})
    try:
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match="heartbeat"):
            asyncio.run(_collect(c, LONG_PROMPT, SamplingParams(max_tokens=1), "wedged"))
        assert time.monotonic() - t0 < 10 and not c.is_running
        c.proc.wait(timeout=5)  # the unresponsive process was killed
    finally:
        c.shutdown()
        _kill_group(c.proc)


def test_bad_model_dir_raises_a_clear_startup_error(tmp_path):
    with pytest.raises(EngineStartupError, match="failed to start.*not found"):
        EngineClient(EngineArgs(model=str(tmp_path / "missing")), startup_timeout_s=30)


# -- v41-serve -------------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cli_rejects_unsupported_options(capsys):
    from v41.serve.cli import main

    assert main(["--headless"]) == 2
    assert "node_rank > 0" in capsys.readouterr().err
    assert main(["--model", "/nonexistent/dir"]) == 2
    assert "not found" in capsys.readouterr().err
    assert main(["--max-n", "0"]) == 2
    assert "max_n must be positive" in capsys.readouterr().err


def test_sigterm_lets_the_in_flight_request_finish_and_exits_zero(ckpt, tmp_path):
    port = _free_port()
    log_path = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "v41.serve.cli", "--model", str(ckpt), "--port", str(port), "--device", "cpu",
           "--block-size", "16", "--kv-cache-bytes", str(64 << 20), "--served-model-name", "tiny"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    engine_pid = None
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 40
        while True:
            assert proc.poll() is None, log_path.read_text()
            try:
                with urllib.request.urlopen(f"{base}/v1/models", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        engine_pid = int(re.search(r"engine core ready \(pid (\d+)\)", log_path.read_text()).group(1))
        result = {}

        def post():
            body = json.dumps({"model": "tiny", "prompt": "Hello", "max_tokens": 48, "temperature": 0}).encode()
            req = urllib.request.Request(f"{base}/v1/completions", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=30) as r:
                result["status"], result["body"] = r.status, json.loads(r.read())
            result["done_s"] = time.monotonic()

        t = threading.Thread(target=post)
        t.start()
        time.sleep(0.3)  # the request is running in the engine
        proc.send_signal(signal.SIGTERM)
        sigterm_s = time.monotonic()
        assert proc.wait(timeout=30) == 0, log_path.read_text()
        t.join(timeout=10)
        assert result.get("status") == 200, (result, log_path.read_text())
        assert result["done_s"] > sigterm_s, "the request finished before SIGTERM: nothing was in flight"
        assert result["body"]["choices"][0]["finish_reason"] in ("length", "stop")
        with pytest.raises(ProcessLookupError):  # the engine core is gone too
            os.kill(engine_pid, 0)
    finally:
        _kill_group(proc)
        if engine_pid is not None:
            try:
                os.killpg(engine_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_served_context_limit_is_what_the_kv_cache_holds_and_rejections_count_tokens(ckpt, tmp_path):
    """Issue 13 item 7: 8,000,000 cache bytes are 32 blocks of 64 tokens per kind, which hold one request of
    at most 2,049 tokens (prompt + output; the last output token is never fed back). The server advertises
    that, serves a 2,048-token prompt, refuses a 2,049-token one in tokens, and refuses to start when
    --max-model-len asks for more, naming both numbers."""
    with serve(ckpt, tmp_path / "serve.log", "--kv-cache-bytes", "8000000", "--served-model-name", "tiny") as srv:
        assert "32 blocks of 64 tokens" in srv.log()
        assert httpx.get(f"{srv.base}/v1/models").json()["data"][0]["max_model_len"] == 2049
        assert httpx.post(f"{srv.base}/tokenize", json={"prompt": "hi"}).json()["max_model_len"] == 2049
        body = {"model": "tiny", "max_tokens": 1, "ignore_eos": True}
        ok = httpx.post(f"{srv.base}/v1/completions", json={**body, "prompt": [0] * 2048}, timeout=60)
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length", ok.text
        refused = httpx.post(f"{srv.base}/v1/completions", json={**body, "prompt": [0] * 2049}, timeout=60)
        message = refused.json()["error"]["message"]
        assert refused.status_code == 400 and "2049 tokens" in message and "max_model_len is 2049" in message
        assert "block" not in message
    cmd = [sys.executable, "-m", "v41.serve.cli", "--model", str(ckpt), "--device", "cpu", "--port",
           str(_free_port()), "--kv-cache-bytes", "8000000", "--max-model-len", "4096"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, start_new_session=True)
    assert proc.returncode == 1
    assert re.search(r"max_model_len 4096 tokens does not fit.*at most 2049 tokens", proc.stderr), proc.stderr


def test_sigterm_ends_every_open_stream_with_abort_and_done_before_the_server_exits(ckpt, tmp_path):
    """Issue 13 item 3: SIGTERM with four SSE streams open and --shutdown-timeout 2. The engine drains at once;
    at the timeout every stream gets a finish_reason "abort" chunk (or an error event) and ``data: [DONE]``,
    never a cut body; the server exits 0 soon after, with no cancelled-task tracebacks, and the engine is gone."""
    from v41.serve.cli import ABORT_FLUSH_S

    bodies = [("/v1/completions", {"prompt": "Hello there"}),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})] * 2
    events: list[list[str]] = [[] for _ in bodies]
    started = [threading.Event() for _ in bodies]

    def read(i: int, srv, path: str, body: dict) -> None:
        body = {**body, "model": "tiny", "max_tokens": 3000, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", srv.base + path, json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events[i].append(line[len("data: "):])
                        started[i].set()
        except httpx.HTTPError as e:  # a body cut short: what the fix forbids
            events[i].append(f"{type(e).__name__}: {e}")
        finally:
            started[i].set()

    with serve(ckpt, tmp_path / "serve.log", "--served-model-name", "tiny", "--shutdown-timeout", "2") as srv:
        readers = [threading.Thread(target=read, args=(i, srv, *b), daemon=True) for i, b in enumerate(bodies)]
        for t in readers:
            t.start()
        assert all(e.wait(30) for e in started) and all(events), events
        sigterm_s = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(timeout=30) == 0, srv.log()[-4000:]
        exit_s = time.monotonic() - sigterm_s
        for t in readers:
            t.join(timeout=10)
        for evs in events:
            assert evs[-1] == "[DONE]", evs[-3:]
            last = json.loads(evs[-2])
            assert "error" in last or last["choices"][0]["finish_reason"] == "abort", last
        assert 2.0 <= exit_s < 2.0 + ABORT_FLUSH_S, exit_s
        log = srv.log()
        assert "CancelledError" not in log and "Traceback" not in log, log[-4000:]
        with pytest.raises(ProcessLookupError):  # the engine core is gone too
            os.kill(srv.engine_pid, 0)
