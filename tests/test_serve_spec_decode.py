"""Speculative-decoding counts from the engine to every outside reader (issue 15 item 5): ``CompletionOutput``
deltas, HTTP ``usage.spec_decode``, gRPC ``Complete.spec_decode`` / ``GetLoads`` / capabilities, and the Prometheus
``v41_spec_decode_*`` counters.

So that every reader's figures are known exactly, one tiny V4.1 engine plays a speculating one with scripted
counts: its core gets a speculative config, and every committed token of a real request counts one verify step,
``(verified, accepted) = STEP(t)`` for the completion's t-th token, in ``seq.spec_decode``. Each test knows from
the token counts alone what every reader must show. Real speculation behind the same servers:
``test_serve_spec_streams.py``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import threading
from dataclasses import replace
from types import SimpleNamespace

import grpc
import httpx
import pytest

from v41.engine.async_engine import AsyncEngine
from v41.engine.info import engine_info
from v41.engine.params import SamplingParams
from v41.engine.spec_config import SpeculativeConfig
from v41.engine.spec_stats import SpecDecodeStats
from v41.serve.grpc_server import pb2, pb2_grpc, serve_grpc
from v41.serve.metrics import ServerMetrics
from v41.serve.openai_app import build_app
from v41.testing.tiny import make_tiny

K = 3
ENGINE_KW = dict(block_size=16, kv_cache_bytes=32 << 20)
GREEDY = {"temperature": 0, "ignore_eos": True}
TIMEOUT_S = 60
SIMULATE = {"on": True}  # off: the engine reports no counts, as a non-speculating one


def step(t: int) -> tuple[int, int]:
    """The simulated verify step of a completion's t-th token (t ≥ 1): (verified, accepted)."""
    verified = K - t % 2
    return verified, min(t % (K + 1), verified)


def expected(num_tokens: int, completions: int = 1) -> SpecDecodeStats:
    """The counts of ``completions`` completions of ``num_tokens`` tokens each."""
    total = SpecDecodeStats.empty(K)
    for _ in range(completions):
        for t in range(1, num_tokens + 1):
            total.add_block(*step(t))
    return total


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = AsyncEngine(model=str(make_tiny(tmp_path_factory.mktemp("spec-serve"), "deepseek_v41")), **ENGINE_KW)
    core = eng.core
    commit = core._commit

    def commit_and_count(seq, tok, lp):
        commit(seq, tok, lp)
        if SIMULATE["on"]:
            if seq.spec_decode is None:
                seq.spec_decode = SpecDecodeStats.empty(K)
            seq.spec_decode.add_block(*step(len(seq.output_token_ids)))

    core._commit = commit_and_count  # before any request: the loop thread is idle
    core.args = replace(core.args, speculative_config=SpeculativeConfig(K))
    eng.info = engine_info(core)
    yield eng
    eng.shutdown()


@pytest.fixture
def not_speculating():
    SIMULATE["on"] = False
    yield
    SIMULATE["on"] = True


def http(app, *requests: tuple[str, str, dict | None]) -> list[httpx.Response]:
    """Send ``(method, path, body)`` requests to ``app`` in process, in order."""
    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t",
                                     timeout=TIMEOUT_S) as c:
            return [await c.request(method, path, json=body) for method, path, body in requests]
    return asyncio.run(run())


def last_usage(sse_text: str) -> dict:
    events = [json.loads(line[6:]) for line in sse_text.splitlines() if line.startswith("data: {")]
    assert events[-1]["choices"] == [], events[-1]
    return events[-1]["usage"]


# -- engine outputs ---------------------------------------------------------------------------------------------
def test_every_delta_carries_the_cumulative_counts_so_far(engine):
    async def run():
        seen, n = [], 0
        async for out in engine.generate([0, 17, 301, 55], SamplingParams(max_tokens=5, **GREEDY)):
            n += len(out.outputs[0].token_ids)
            seen.append((n, out.outputs[0].spec_decode))
        return seen

    seen = asyncio.run(run())
    assert seen[-1][0] == 5
    assert all(stats == expected(n) for n, stats in seen), seen


# -- HTTP ---------------------------------------------------------------------------------------------------------
def test_http_usage_adds_up_the_counts_of_every_completion(engine):
    app = build_app(engine, "m")
    prompt = {"prompt": "def f(x):", "max_tokens": 4, **GREEDY}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **GREEDY}
    plain, streamed, chat_plain, chat_streamed = http(
        app, ("POST", "/v1/completions", {**prompt, "n": 2}),
        ("POST", "/v1/completions", {**prompt, "stream": True, "stream_options": {"include_usage": True}}),
        ("POST", "/v1/chat/completions", chat),
        ("POST", "/v1/chat/completions", {**chat, "stream": True, "stream_options": {"include_usage": True}}))
    assert plain.json()["usage"]["completion_tokens"] == 8
    assert plain.json()["usage"]["spec_decode"] == expected(4, completions=2).to_dict()
    one = expected(4).to_dict()
    assert last_usage(streamed.text)["spec_decode"] == one
    assert chat_plain.json()["usage"]["spec_decode"] == one
    assert last_usage(chat_streamed.text)["spec_decode"] == one


def test_http_usage_has_no_spec_decode_when_the_engine_does_not_speculate(engine, not_speculating):
    body = {"prompt": "def f(x):", "max_tokens": 2, **GREEDY}
    plain, streamed = http(build_app(engine, "m"), ("POST", "/v1/completions", body),
                           ("POST", "/v1/completions", {**body, "stream": True,
                                                        "stream_options": {"include_usage": True}}))
    assert plain.json()["usage"]["spec_decode"] is None
    assert "spec_decode" not in last_usage(streamed.text)


# -- Prometheus ---------------------------------------------------------------------------------------------------
def counters(text: str) -> dict[str, float]:
    """The v41_spec_decode_* samples of an exposition, keyed by name (with labels)."""
    return {name: float(v) for name, v in re.findall(r"^(v41_spec_decode_\w+_total(?:\{[^}]*\})?) (\S+)$", text, re.M)}


def test_prometheus_counters_grow_by_the_counts_of_each_request(engine):
    app = build_app(engine, "m")
    before, _, after = http(app, ("GET", "/metrics", None),
                            ("POST", "/v1/completions", {"prompt": "import os", "max_tokens": 5, **GREEDY}),
                            ("GET", "/metrics", None))
    was, now, want = counters(before.text), counters(after.text), expected(5)
    grown = {name: now[name] - was.get(name, 0.0) for name in now}
    assert grown == {
        "v41_spec_decode_num_drafts_total": want.num_drafts,
        "v41_spec_decode_num_draft_tokens_total": want.num_draft_tokens,
        "v41_spec_decode_num_accepted_tokens_total": want.num_accepted_tokens,
        **{f'v41_spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}': n
           for i, n in enumerate(want.accepted_per_position)}}


def test_prometheus_counters_skip_an_older_snapshot_instead_of_counting_twice():
    metrics = ServerMetrics()
    older, newer = expected(2), expected(3)
    for snapshot in (newer, older, newer):  # a stale stats fallback between two fresh scrapes
        metrics.update_engine({"spec_decode": snapshot.to_dict()}, alive=True)
    got = counters(metrics.render()[0].decode())
    assert got["v41_spec_decode_num_drafts_total"] == newer.num_drafts
    assert got["v41_spec_decode_num_accepted_tokens_total"] == newer.num_accepted_tokens
    assert got['v41_spec_decode_num_accepted_tokens_per_pos_total{position="0"}'] == newer.accepted_per_position[0]


# -- gRPC ---------------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def grpc_stub(engine):
    """An ``EngineStub`` on a gRPC server for ``engine`` on a free local port (its own event-loop thread)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="grpc-spec-loop", daemon=True)
    thread.start()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = None
    try:
        srv = asyncio.run_coroutine_threadsafe(serve_grpc(engine, "127.0.0.1", port, "m"), loop).result(TIMEOUT_S)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield pb2_grpc.EngineStub(channel)
    finally:
        if srv is not None:
            asyncio.run_coroutine_threadsafe(srv.stop(0), loop).result(TIMEOUT_S)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(TIMEOUT_S)


@pytest.fixture(scope="module")
def stub(engine):
    with grpc_stub(engine) as s:
        yield s


def from_proto(p) -> SpecDecodeStats:
    return SpecDecodeStats(p.num_drafts, p.drafted_tokens, p.accepted_tokens, list(p.accepted_per_position),
                           list(p.verified_per_position))


def complete(stub, max_tokens: int):
    req = pb2.GenerateRequest(tokens=pb2.TokenIds(ids=[0, 17, 301, 55, 900]), sampling_params=pb2.SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    return [r.complete for r in stub.Generate(req, timeout=TIMEOUT_S) if r.HasField("complete")][0]


def test_grpc_complete_and_loads_carry_every_field(stub):
    before = stub.GetLoads(pb2.GetLoadsRequest(), timeout=TIMEOUT_S)
    done = complete(stub, 6)
    after = stub.GetLoads(pb2.GetLoadsRequest(), timeout=TIMEOUT_S)
    want = expected(6)
    assert len(done.token_ids) == 6 and from_proto(done.spec_decode) == want
    assert done.spec_decode.acceptance_rate == pytest.approx(want.acceptance_rate)
    assert done.spec_decode.mean_acceptance_length == pytest.approx(want.mean_acceptance_length)
    assert after.HasField("spec_decode") and from_proto(after.spec_decode).since(from_proto(before.spec_decode)) \
        == want  # the server-wide counts grew by this request's
    caps = stub.GetModelInfo(pb2.GetModelInfoRequest(), timeout=TIMEOUT_S).capabilities
    assert (caps.speculative_method, caps.max_draft_tokens) == ("dspark", K)


def test_grpc_complete_has_no_spec_decode_when_the_engine_does_not_speculate(stub, not_speculating):
    assert not complete(stub, 2).HasField("spec_decode")
