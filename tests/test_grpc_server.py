"""The gRPC front end (python/v41/serve/grpc_server.py) on 127.0.0.1 over the tiny V4.1 model: a Python gRPC
client and the Rust client (crates/v41-client) get v41.LLM's greedy tokens; tokenizer and info RPCs; health
and reflection; bad input is INVALID_ARGUMENT (KF-16, KF-13); a cancelled call aborts its request (KF-17)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import socket
import subprocess
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

import v41
import v41.chat
from serve_helpers import serve
from v41.engine.async_engine import AsyncEngine, EngineDeadError
from v41.serve.errors import QueueFullError
from v41.serve.grpc_server import pb2, pb2_grpc, serve_grpc
from v41.testing.tiny import make_tiny

ROOT = Path(__file__).resolve().parents[1]
RUST_CLIENT = next((p for p in (ROOT / "target/debug/v41-client", ROOT / "target/release/v41-client")
                    if p.is_file()), None)
ENGINE_KW = dict(block_size=16, kv_cache_bytes=32 << 20)
PROMPT_IDS = [0, 17, 301, 55, 900, 12, 640, 33, 7, 418, 250, 99]
PROMPT_TEXT = "Here is the English alphabet: ABC"
MAX_TOKENS = 12
TIMEOUT_S = 30


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("v41-grpc"), "deepseek_v41")


@pytest.fixture(scope="module")
def expected(ckpt):
    """v41.LLM's greedy outputs for the token and text prompts."""
    llm = v41.LLM(str(ckpt), **ENGINE_KW)
    sp = v41.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ids, text = llm.generate([PROMPT_IDS, PROMPT_TEXT], sp, use_tqdm=False)
    return SimpleNamespace(ids=ids.outputs[0], text=text.outputs[0], text_prompt_ids=text.prompt_token_ids)


@pytest.fixture(scope="module")
def server(ckpt):
    """serve_grpc on a private event loop thread; stopped (and the engine shut down) in finally."""
    engine = AsyncEngine(model=str(ckpt), **ENGINE_KW)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="grpc-test-loop", daemon=True)
    thread.start()
    port = _free_port()
    srv = None
    try:
        srv = asyncio.run_coroutine_threadsafe(serve_grpc(engine, "127.0.0.1", port, "tiny-v41"),
                                               loop).result(TIMEOUT_S)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield SimpleNamespace(engine=engine, port=port, channel=channel, stub=pb2_grpc.EngineStub(channel))
    finally:
        if srv is not None:
            asyncio.run_coroutine_threadsafe(srv.stop(0), loop).result(TIMEOUT_S)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(TIMEOUT_S)
        engine.shutdown()


def _greedy(max_tokens: int = MAX_TOKENS, **kw):
    return pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def _generate(stub, **req):
    """All responses of one Generate call."""
    return list(stub.Generate(pb2.GenerateRequest(**req), timeout=TIMEOUT_S))


def _wait_idle(server, timeout_s: float = 10.0):
    """GetLoads until nothing runs or waits; returns the last Loads."""
    deadline = time.monotonic() + timeout_s
    while True:
        loads = server.stub.GetLoads(pb2.GetLoadsRequest(), timeout=TIMEOUT_S)
        if (loads.running == 0 and loads.waiting == 0) or time.monotonic() > deadline:
            return loads
        time.sleep(0.05)


def _assert_all_blocks_free(server):
    loads = _wait_idle(server)
    assert loads.running == 0 and loads.waiting == 0, loads
    server.engine.core.scheduler.reset_prefix_cache()  # cached prefixes hold blocks by design
    loads = server.stub.GetLoads(pb2.GetLoadsRequest(), timeout=TIMEOUT_S)
    assert loads.caches and all(c.used_blocks == 0 for c in loads.caches), loads


# ------------------------------------------------------------------------------------------ Generate
@pytest.mark.parametrize("stream", [True, False])
def test_generate_tokens_gives_llm_greedy_tokens(server, expected, stream, monkeypatch):
    aborted = []
    real_abort = server.engine.abort

    async def spy_abort(rid):
        aborted.append(rid)
        await real_abort(rid)

    monkeypatch.setattr(server.engine, "abort", spy_abort)
    msgs = _generate(server.stub, request_id=f"ids-{stream}", tokens=pb2.TokenIds(ids=PROMPT_IDS),
                     sampling_params=_greedy(), stream=stream)
    assert not aborted  # KF-17: a stream that finished normally sends no abort
    assert all(m.request_id == f"ids-{stream}" for m in msgs)
    kinds = [m.WhichOneof("response") for m in msgs]
    assert kinds.count("complete") == 1 and kinds[-1] == "complete"
    done = msgs[-1].complete
    assert list(done.token_ids) == expected.ids.token_ids
    assert done.text == expected.ids.text
    assert done.finish_reason == "length" and done.WhichOneof("matched_stop") is None
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (len(PROMPT_IDS), MAX_TOKENS)
    assert done.timings.total_s >= done.timings.ttft_s > 0
    chunks = [m.chunk for m in msgs[:-1]]
    if stream:
        assert sum((list(c.token_ids) for c in chunks), []) == expected.ids.token_ids
        assert "".join(c.text for c in chunks) == expected.ids.text
        assert [c.usage.completion_tokens for c in chunks] == sorted(c.usage.completion_tokens for c in chunks)
    else:
        assert not chunks


def test_generate_text_gives_llm_greedy_tokens(server, expected):
    msgs = _generate(server.stub, text=PROMPT_TEXT, sampling_params=_greedy(), stream=True)
    assert msgs[0].request_id  # assigned by the server
    done = msgs[-1].complete
    assert list(done.token_ids) == expected.text.token_ids and done.text == expected.text.text
    assert done.usage.prompt_tokens == len(expected.text_prompt_ids)


def test_stop_token_and_logprobs_come_back(server, expected):
    stop_id = expected.ids.token_ids[3]
    cut = expected.ids.token_ids.index(stop_id) + 1
    msgs = _generate(server.stub, tokens=pb2.TokenIds(ids=PROMPT_IDS), stream=False,
                     sampling_params=_greedy(stop_token_ids=[stop_id], logprobs=2, prompt_logprobs=1))
    done = msgs[-1].complete
    assert list(done.token_ids) == expected.ids.token_ids[:cut]
    assert done.finish_reason == "stop" and done.stop_token_id == stop_id
    assert [lp.token_id for lp in done.logprobs] == list(done.token_ids)
    assert all(lp.rank == 1 and len(lp.top_logprobs) == 2 and lp.top_logprobs[0].token_id == lp.token_id
               for lp in done.logprobs)  # greedy: the sampled token is the most likely one
    assert done.HasField("cumulative_logprob")
    assert [lp.token_id for lp in done.prompt_logprobs] == PROMPT_IDS[1:]  # nothing scores token 0
    assert all(lp.logprob <= 0 and len(lp.top_logprobs) == 1 for lp in done.prompt_logprobs)


def test_n_completions_each_end_with_their_complete(server, expected):
    msgs = _generate(server.stub, tokens=pb2.TokenIds(ids=PROMPT_IDS), sampling_params=_greedy(n=2), stream=True)
    completes = {m.complete.index: m.complete for m in msgs if m.WhichOneof("response") == "complete"}
    assert set(completes) == {0, 1} and msgs[-1].WhichOneof("response") == "complete"
    for i, done in completes.items():
        streamed = sum((list(m.chunk.token_ids) for m in msgs if m.WhichOneof("response") == "chunk"
                        and m.chunk.index == i), [])
        assert streamed == list(done.token_ids) == expected.ids.token_ids


# ------------------------------------------------------------------------------------------ unary RPCs
def test_tokenize_and_detokenize_match_the_engine(server, expected):
    tok = server.stub.Tokenize(pb2.TokenizeRequest(text=PROMPT_TEXT), timeout=TIMEOUT_S)
    assert list(tok.token_ids) == expected.text_prompt_ids
    assert tok.max_model_len == server.engine.max_model_len
    bare = server.stub.Tokenize(pb2.TokenizeRequest(text=PROMPT_TEXT, add_special_tokens=False))
    assert list(bare.token_ids) == expected.text_prompt_ids[1:]
    text = server.stub.Detokenize(pb2.DetokenizeRequest(token_ids=expected.ids.token_ids)).text
    assert text == server.engine.tokenizer.decode(expected.ids.token_ids, skip_special_tokens=True)
    with pytest.raises(grpc.RpcError) as e:
        server.stub.Detokenize(pb2.DetokenizeRequest(token_ids=[1 << 20]))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_model_info_server_info_and_loads(server, ckpt):
    info = server.stub.GetModelInfo(pb2.GetModelInfoRequest(), timeout=TIMEOUT_S)
    cfg = server.engine.cfg
    assert info.served_model_name == "tiny-v41" and info.architecture == cfg.arch == "deepseek_v41"
    assert info.vocab_size == cfg.vocab_size and list(info.eos_token_ids) == list(cfg.eos_token_ids)
    assert info.bos_token_id == cfg.bos_token_id and info.max_context_length == server.engine.max_model_len
    assert info.kv_block_size == 16 and info.capabilities.prefix_caching
    assert info.tokenizer_sha256 == hashlib.sha256((Path(ckpt) / "tokenizer.json").read_bytes()).hexdigest()
    assert "swa" in info.capabilities.cache_kinds
    si = server.stub.GetServerInfo(pb2.GetServerInfoRequest(), timeout=TIMEOUT_S)
    assert si.version == v41.__version__ and si.uptime_s > 0 and json.loads(si.config_json)["block_tokens"] == 16
    assert json.loads(si.config_json)["tensor_parallel_size"] == 1
    loads = _wait_idle(server)
    assert {c.kind for c in loads.caches} == set(info.capabilities.cache_kinds)
    assert all(c.used_blocks + c.cached_blocks + c.free_blocks == c.total_blocks > 0 for c in loads.caches)
    assert 0.0 <= loads.prefix_hit_rate <= 1.0


def test_loads_count_blocks_left_to_the_prefix_cache_as_cached_not_used(server):
    """Issue 13: pages a finished request left to the prefix cache are ``cached_blocks`` (evictable), not
    ``used_blocks``; a running request's blocks are used."""
    _generate(server.stub, tokens=pb2.TokenIds(ids=list(range(100, 148))), sampling_params=_greedy(2))
    idle = {c.kind: c for c in _wait_idle(server).caches}
    assert all(c.used_blocks == 0 for c in idle.values()), idle
    assert all(c.cached_blocks > 0 for k, c in idle.items() if k != "cstate"), idle
    call = server.stub.Generate(pb2.GenerateRequest(stream=True, **LONG), timeout=TIMEOUT_S)
    try:
        assert next(call).chunk.token_ids
        busy = {c.kind: c for c in server.stub.GetLoads(pb2.GetLoadsRequest(), timeout=TIMEOUT_S).caches}
        assert busy["ckv1"].used_blocks > 0 and busy["cstate"].used_blocks == 1, busy
        assert all(c.used_blocks + c.cached_blocks + c.free_blocks == c.total_blocks for c in busy.values())
    finally:
        call.cancel()


def test_served_grpc_reports_the_engine_configuration(ckpt, tmp_path):
    """Issue 13 item 8: ``v41-serve --grpc`` (the engine in its own process, behind ``EngineClient``) reports
    the engine's real block size, prefix caching and configuration, not zeros and defaults."""
    flags = ("--grpc", "--block-size", "16", "--kv-cache-bytes", str(8 << 20), "--max-num-seqs", "4",
             "--max-model-len", "512")
    with serve(ckpt, tmp_path / "grpc.log", *flags) as srv, grpc.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
        stub = pb2_grpc.EngineStub(ch)
        info = stub.GetModelInfo(pb2.GetModelInfoRequest(), timeout=TIMEOUT_S)
        assert info.kv_block_size == 16 and info.capabilities.prefix_caching and info.max_context_length == 512
        assert "ckv1" in info.capabilities.cache_kinds
        config = json.loads(stub.GetServerInfo(pb2.GetServerInfoRequest(), timeout=TIMEOUT_S).config_json)
        assert config["block_tokens"] == 16 and config["enable_prefix_caching"] is True
        assert config["max_num_seqs"] == 4 and config["num_blocks"]["cstate"] == 4 and config["num_blocks"]["swa"] > 0
        assert config["dtype"] == "float32" and config["device"] == "cpu" and config["max_model_len"] == 512
        assert config["engine_args"]["kv_cache_bytes"] == 8 << 20


def test_health_is_serving_and_reflection_lists_the_services(server):
    health = health_pb2_grpc.HealthStub(server.channel)
    for service in ("", "v41.v1.Engine"):
        resp = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT_S)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    services = ProtoReflectionDescriptorDatabase(server.channel).get_services()
    assert "v41.v1.Engine" in services and "grpc.health.v1.Health" in services


def test_cache_salt_scopes_prefix_hits_and_priority_reaches_the_scheduler(server, monkeypatch):
    seen, add = [], server.engine.core.add_request

    def recording_add(*args, **kw):
        seen.append((kw["priority"], kw["cache_salt"]))
        return add(*args, **kw)

    monkeypatch.setattr(server.engine.core, "add_request", recording_add)
    prompt = pb2.TokenIds(ids=[0] + list(range(200, 247)))  # 48 tokens: three full pages

    def cached(salt: str, priority: int = 0) -> int:
        msgs = _generate(server.stub, tokens=prompt, sampling_params=_greedy(2), cache_salt=salt,
                         priority=priority)
        return msgs[-1].complete.usage.cached_tokens

    assert cached("grpc-alice", priority=-7) == 0
    assert cached("grpc-bob", priority=2**31 - 1) == 0  # a salt of its own: no hit on alice's prefix
    assert cached("grpc-alice") >= 32
    assert seen == [(-7, "grpc-alice"), (2**31 - 1, "grpc-bob"), (0, "grpc-alice")]


# ------------------------------------------------------------------------------------------ bad input
HI = '[{"role": "user", "content": "hi"}]'


@pytest.mark.parametrize("req, message", [
    (dict(tokens=pb2.TokenIds(ids=[])), "empty"),  # KF-16
    (dict(text=""), "empty"),  # KF-16
    (dict(), "needs an input"),
    (dict(tokens=pb2.TokenIds(ids=[0, 1 << 20])), "token ids"),
    (dict(tokens=pb2.TokenIds(ids=[0] * 5000)), "max_model_len"),
    (dict(tokens=pb2.TokenIds(ids=[0, 5]), sampling_params=pb2.SamplingParams(max_tokens=0)), "max_tokens"),
    (dict(tokens=pb2.TokenIds(ids=[0, 5]), sampling_params=pb2.SamplingParams(temperature=-1)), "temperature"),
    (dict(tokens=pb2.TokenIds(ids=[0, 5]), sampling_params=pb2.SamplingParams(top_p=0)), "top_p"),
    (dict(tokens=pb2.TokenIds(ids=[0, 5]), sampling_params=pb2.SamplingParams(n=0)), "n must be"),
    (dict(tokens=pb2.TokenIds(ids=[0, 5]), sampling_params=pb2.SamplingParams(n=100000)), "n must be at most 128"),
    (dict(chat=pb2.ChatInput(messages_json="[{")), "not valid JSON"),
    (dict(chat=pb2.ChatInput(messages_json="[]")), "empty"),  # KF-16
    (dict(chat=pb2.ChatInput(messages_json='[{"role": "user", "content": "hi"}]', tools_json='{"a": 1}')),
     "tools_json"),
    (dict(chat=pb2.ChatInput(messages_json=r'[{"role": "user", "content": "a\udfffb"}]')),
     "chat.messages_json[0].content must be valid UTF-8 text: a lone surrogate (U+DFFF) at character 1"),
    # issue 13 item 10: the checks of the HTTP chat route (serve/validation.py), which gRPC skipped
    (dict(chat=pb2.ChatInput(messages_json=HI, tools_json='[{"type": "function", "function": {"parameters": {}}}]')),
     "chat.tools_json[0].function.name must be a non-empty string"),
    (dict(chat=pb2.ChatInput(messages_json=HI, tools_json='[{"type": "function", "function": {"name": "f", '
                                                        '"parameters": "x"}}]')),
     "chat.tools_json[0].function.parameters must be a JSON Schema object"),
    (dict(chat=pb2.ChatInput(messages_json='[{"role": "user", "content": ""}]')),
     "chat.messages_json[0].content is empty"),
    (dict(chat=pb2.ChatInput(messages_json='[{"role": "assistant", "content": "", "tool_calls": [{"type": "function", '
                                           '"function": {"name": "f", "arguments": "{oops"}}]}, ' + HI[1:])),
     "chat.messages_json[0].tool_calls[0].function.arguments must be a JSON object"),
    # issue 13 item 11: no vision input, no unknown part types
    (dict(chat=pb2.ChatInput(messages_json='[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": '
                                           '"data:image/png;base64,AAAA"}}, {"type": "text", "text": "hi"}]}]')),
     "chat.messages_json[0].content[0] is an image part ('image_url'), but the served model takes no image input"),
    (dict(chat=pb2.ChatInput(messages_json='[{"role": "user", "content": [{"type": "text", "text": "hi"}, '
                                           '{"type": "bogus"}]}]')),
     "chat.messages_json[0].content[1] has the unsupported content part type 'bogus'"),
], ids=["empty-tokens", "empty-text", "no-input", "id-outside-vocab", "too-long", "max-tokens-0",
        "temperature-negative", "top-p-0", "n-0", "n-above-max-n", "malformed-chat", "no-messages", "tools-not-a-list",
        "lone-surrogate", "tool-without-name", "tool-parameters-not-an-object", "empty-user-message",
        "tool-call-arguments-not-json", "image-part", "unknown-part"])
def test_bad_input_is_invalid_argument_and_the_engine_lives_on(server, req, message):
    with pytest.raises(grpc.RpcError) as e:
        _generate(server.stub, **req)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
    assert message in e.value.details()
    assert server.engine.is_running
    msgs = _generate(server.stub, tokens=pb2.TokenIds(ids=[0, 5]), sampling_params=_greedy(2))
    assert msgs[-1].complete.usage.completion_tokens == 2


@pytest.mark.parametrize("method, streaming", [("Generate", True), ("Tokenize", False)])
@pytest.mark.parametrize("data", [b"\xff\xff\xff", b"\x0a\x02\xff\xfe"], ids=["bad-wire-format", "bad-utf8"])
def test_corrupt_request_bytes_are_invalid_argument(server, method, streaming, data):
    """Issue 13 item 12: bytes that are no valid request message gave UNKNOWN (field 1 is a string in both
    request types, so b"\\x0a\\x02\\xff\\xfe" is bad UTF-8 there)."""
    path = f"/v41.v1.Engine/{method}"
    call = server.channel.unary_stream(path) if streaming else server.channel.unary_unary(path)
    with pytest.raises(grpc.RpcError) as e:  # no serializer: the bytes go out as they are
        list(call(data, timeout=TIMEOUT_S)) if streaming else call(data, timeout=TIMEOUT_S)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
    assert f"not a valid v41.v1.{method}Request message" in e.value.details()
    assert _generate(server.stub, tokens=pb2.TokenIds(ids=[0, 5]), sampling_params=_greedy(2))[-1].complete


# ------------------------------------------------------------------------------------------ cancel / abort
LONG = dict(tokens=pb2.TokenIds(ids=PROMPT_IDS), sampling_params=_greedy(2000))


def test_cancelled_calls_abort_their_requests_and_free_their_blocks(server):
    """KF-17 over gRPC: a streaming call cancelled after two chunks and a non-streaming call cancelled while
    it waits both leave nothing running and every block free."""
    for _ in range(3):
        call = server.stub.Generate(pb2.GenerateRequest(stream=True, **LONG), timeout=TIMEOUT_S)
        assert next(call).WhichOneof("response") == "chunk" and next(call).chunk
        call.cancel()
        quiet = server.stub.Generate(pb2.GenerateRequest(stream=False, **LONG), timeout=TIMEOUT_S)
        try:  # wait until it runs (a loaded CI machine may take a while to admit it)
            deadline = time.monotonic() + TIMEOUT_S
            while server.stub.GetLoads(pb2.GetLoadsRequest()).running < 1:
                assert time.monotonic() < deadline, "the non-streaming request never started"
                time.sleep(0.05)
        finally:
            quiet.cancel()
        _assert_all_blocks_free(server)


def test_abort_rpc_ends_the_stream_with_abort_and_is_idempotent(server):
    call = server.stub.Generate(pb2.GenerateRequest(request_id="to-abort", stream=True, **LONG), timeout=TIMEOUT_S)
    assert next(call).chunk.token_ids
    with pytest.raises(grpc.RpcError) as e:  # the id is in flight
        _generate(server.stub, request_id="to-abort", **LONG)
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
    server.stub.Abort(pb2.AbortRequest(request_ids=["to-abort", "never-seen"], reason="test"), timeout=TIMEOUT_S)
    rest = list(call)
    assert rest[-1].complete.finish_reason == "abort"
    assert [m.WhichOneof("response") for m in rest].count("complete") == 1
    server.stub.Abort(pb2.AbortRequest(request_ids=["to-abort"]), timeout=TIMEOUT_S)  # again: OK
    _assert_all_blocks_free(server)


class _FailingEngine:
    """An EngineProtocol stand-in whose generate and stats raise ``error``; dead when it is EngineDeadError."""

    def __init__(self, error: Exception):
        self.error = error
        self.cfg = SimpleNamespace(vocab_size=1024, is_v41=True)
        self.is_running = not isinstance(error, EngineDeadError)
        self.last_heartbeat_s = time.monotonic() - (60 if isinstance(error, EngineDeadError) else 0)

    async def generate(self, prompt, params, request_id, *, priority=0, cache_salt=None):
        raise self.error
        yield  # an async generator

    async def abort(self, request_id):
        pass

    async def stats(self):
        raise self.error


@pytest.mark.parametrize("error, code, serving", [
    (EngineDeadError("the engine loop stopped"), grpc.StatusCode.UNAVAILABLE, False),
    (QueueFullError("64 requests in flight"), grpc.StatusCode.RESOURCE_EXHAUSTED, True),
])
def test_engine_failures_map_to_their_status_and_health(error, code, serving):
    async def run():
        port = _free_port()
        srv = await serve_grpc(_FailingEngine(error), "127.0.0.1", port, "failing")
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb2_grpc.EngineStub(channel)
                for call in (stub.Generate(pb2.GenerateRequest(tokens=pb2.TokenIds(ids=[0, 5]))),
                             stub.GetLoads(pb2.GetLoadsRequest())):
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        _ = [m async for m in call] if hasattr(call, "__aiter__") else await call
                    assert e.value.code() == code and str(error) in e.value.details()
                check = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
                want = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
                assert check.status == want
        finally:
            await srv.stop(0)

    asyncio.run(asyncio.wait_for(run(), TIMEOUT_S))


def test_health_watch_sees_the_engine_die():
    engine = _FailingEngine(QueueFullError("unused"))

    async def run():
        port = _free_port()
        srv = await serve_grpc(engine, "127.0.0.1", port, "dying")
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                request = health_pb2.HealthCheckRequest(service="v41.v1.Engine")
                watch = health_pb2_grpc.HealthStub(channel).Watch(request)
                first = await watch.read()
                assert first.status == health_pb2.HealthCheckResponse.SERVING
                engine.is_running = False
                second = await asyncio.wait_for(watch.read(), 5)
                assert second.status == health_pb2.HealthCheckResponse.NOT_SERVING
                watch.cancel()
        finally:
            await srv.stop(0)

    asyncio.run(asyncio.wait_for(run(), TIMEOUT_S))


# ------------------------------------------------------------------------------------------ chat
def test_chat_input_is_encoded_and_parsed(server):
    messages = '[{"role": "user", "content": "Hello"}]'
    ids = v41.chat.encode_messages(server.engine.tokenizer, [{"role": "user", "content": "Hello"}])
    tok = server.stub.Tokenize(pb2.TokenizeRequest(chat=pb2.ChatInput(messages_json=messages)))
    assert list(tok.token_ids) == list(ids)
    msgs = _generate(server.stub, chat=pb2.ChatInput(messages_json=messages), sampling_params=_greedy(8),
                     stream=True, parse_output=True)
    done = msgs[-1].complete
    assert done.usage.prompt_tokens == len(ids) and len(done.token_ids) == 8
    streamed = "".join(m.chunk.reasoning_delta + m.chunk.content_delta for m in msgs[:-1])
    assert streamed == done.reasoning_content + done.content


# ------------------------------------------------------------------------------------------ Rust client
def _rust(*args: str) -> str:
    proc = subprocess.run([str(RUST_CLIENT), *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.skipif(RUST_CLIENT is None, reason="v41-client is not built (cargo build -p v41-client)")
@pytest.mark.parametrize("stream", [False, True])
def test_rust_client_generate_gives_llm_greedy_tokens(server, expected, stream):
    addr = f"http://127.0.0.1:{server.port}"
    common = ["--addr", addr, "--max-tokens", str(MAX_TOKENS), "--temperature", "0", "--ignore-eos"]
    out = _rust("generate", "--token-ids", ",".join(map(str, PROMPT_IDS)), *common,
                *(["--stream"] if stream else []))
    ids = re.search(r"^token_ids: (.*)$", out, re.M).group(1).split()
    assert [int(t) for t in ids] == expected.ids.token_ids
    assert out.startswith(expected.ids.text) and "finish_reason: length" in out
    out = _rust("generate", "--prompt", PROMPT_TEXT, *common)
    ids = re.search(r"^token_ids: (.*)$", out, re.M).group(1).split()
    assert [int(t) for t in ids] == expected.text.token_ids


@pytest.mark.skipif(RUST_CLIENT is None, reason="v41-client is not built (cargo build -p v41-client)")
def test_rust_client_bench_prints_its_table(server):
    out = _rust("bench", "--addr", f"http://127.0.0.1:{server.port}", "--num-requests", "4", "--concurrency",
                "2", "--input-len", "8", "--output-len", "4", "--warmup", "1", "--batches", "2")
    lines = out.splitlines()
    assert "prefill tok/s" in out and "decode tok/s" in out and "TTFT p50 s" in out
    rows = {ln.split()[0]: ln.split() for ln in lines if ln and ln.split()[0] in ("1", "2", "all")}
    assert set(rows) == {"1", "2", "all"}
    assert all(float(r[1]) > 0 and float(r[2]) > 0 for r in rows.values())  # prefill and decode tok/s
    assert rows["all"][-1] == "-"  # no speculative decoding yet: no acceptance length
    _assert_all_blocks_free(server)
