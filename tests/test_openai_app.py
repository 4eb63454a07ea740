"""The OpenAI-compatible HTTP app (issue 6 items 3 and 5; docs/known-failures.md KF-12, KF-13, KF-16..KF-18).

One tiny V4.1 engine (``v41.AsyncEngine``) serves one app on a real uvicorn server on 127.0.0.1 for the whole
module; tests talk to it with httpx (and once with the official ``openai`` client). Apps over test doubles
(a scripted engine, a failing engine) run in process through ``httpx.ASGITransport``.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
import pytest
import uvicorn

import v41
import v41.chat
from v41.engine.async_engine import EngineDeadError
from v41.engine.params import CompletionOutput, RequestOutput
from v41.serve.errors import QueueFullError
from v41.serve.metrics import METRIC_NAMES
from v41.serve.openai_app import build_app
from v41.testing.tiny import make_tiny

MODEL = "tiny-v41"
ENGINE_KW = dict(block_size=16, kv_cache_bytes=32 << 20)
GREEDY = {"temperature": 0, "ignore_eos": True}



# -------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("v41"), "deepseek_v41")


@pytest.fixture(scope="module")
def engine(ckpt):
    eng = v41.AsyncEngine(model=str(ckpt), **ENGINE_KW)
    yield eng
    eng.shutdown()


class Reference:
    """``v41.LLM`` greedy results, computed on a worker thread: on a loaded small CPU box the main thread's
    OpenMP team runs the tiny model ~10x slower than a fresh thread's (as the engine's own thread)."""

    def __init__(self, ckpt):
        self.pool = ThreadPoolExecutor(1)
        self.llm = self.pool.submit(v41.LLM, str(ckpt), **ENGINE_KW).result()

    def generate(self, prompts, params):
        return self.pool.submit(self.llm.generate, prompts, params, use_tqdm=False).result()

    def get_tokenizer(self):
        return self.llm.get_tokenizer()


@pytest.fixture(scope="module")
def llm(ckpt):
    ref = Reference(ckpt)
    yield ref
    ref.pool.shutdown()


class _Server:
    """uvicorn on a background thread, bound to a free port on 127.0.0.1."""

    def __init__(self, app):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


@pytest.fixture(scope="module")
def server(engine):
    with _Server(build_app(engine, MODEL, enable_auto_tool_choice=True)) as s:
        yield s


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def wait_idle(engine, timeout_s: float = 10.0) -> dict:
    """Engine stats once nothing runs or waits (fails after ``timeout_s``). Asked through the engine loop:
    the scheduler is borrowed by the engine thread during a step, so ``engine.core.stats()`` from this thread
    can fail with "Already mutably borrowed"."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = asyncio.run(engine.stats())
        if stats["running"] == 0 and stats["waiting"] == 0 and not engine.core.has_unfinished():
            return stats
        assert time.monotonic() < deadline, f"engine still busy: {stats}"
        time.sleep(0.02)


def sse(text: str) -> list:
    """The JSON events of an SSE body, then the literal "[DONE]" (which must be last)."""
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]] + ["[DONE]"]


def assert_error(r: httpx.Response, status: int, *words: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    for w in words:
        assert w in err["message"], err
    return err


# ------------------------------------------------------------------------------------------ completions


def test_completion_greedy_equals_llm(client, llm):
    prompts = ["Here is the English alphabet: ABC", "The capital of France is"]
    sp = v41.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = llm.generate(prompts, sp)
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": prompts, "max_tokens": 12, **GREEDY})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert [c["text"] for c in body["choices"]] == [w.outputs[0].text for w in want]
    assert all(c["finish_reason"] == "length" for c in body["choices"])
    ids = want[0].prompt_token_ids
    r = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 12, **GREEDY})
    assert r.json()["choices"][0]["text"] == want[0].outputs[0].text


def test_streamed_completion_concatenates_to_the_non_streamed_text(client):
    req = {"prompt": "Once upon a time", "max_tokens": 16, **GREEDY}
    whole = client.post("/v1/completions", json=req).json()
    r = client.post("/v1/completions", json={**req, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse(r.text)
    chunks, usage = events[:-2], events[-2]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert [c["choices"][0].get("finish_reason") for c in chunks].count("length") == 1
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    # stream chunks leave out null fields (spec_decode when the engine does not speculate), the full body keeps them
    assert usage["choices"] == [] and usage["usage"] == {k: v for k, v in whole["usage"].items() if v is not None}


def test_usage_counts_prompt_completion_and_cached_tokens(client, engine):
    prompt = "count the cached tokens of this prompt, " * 4
    n_prompt = len(client.post("/tokenize", json={"prompt": prompt}).json()["tokens"])
    assert n_prompt >= 33
    req = {"prompt": prompt, "max_tokens": 5, "n": 2, **GREEDY}
    first = client.post("/v1/completions", json=req).json()["usage"]
    again = client.post("/v1/completions", json=req).json()["usage"]
    for u in (first, again):
        assert u["prompt_tokens"] == n_prompt and u["completion_tokens"] == 10 and u["total_tokens"] == n_prompt + 10
    assert again["prompt_tokens_details"]["cached_tokens"] >= 32  # two whole 16-token blocks at least


def test_cache_salt_scopes_cached_tokens_and_priority_is_accepted(client, engine, monkeypatch):
    seen, add = [], engine.core.add_request

    def recording_add(*args, **kw):
        seen.append((kw["priority"], kw["cache_salt"]))
        return add(*args, **kw)

    monkeypatch.setattr(engine.core, "add_request", recording_add)
    prompt = list(range(300, 348))  # 48 tokens: three full pages

    def cached(path: str, **extra) -> int:
        body = {"max_tokens": 2, **GREEDY, **extra}
        body |= {"prompt": prompt} if path == "/v1/completions" else {
            "messages": [{"role": "user", "content": "salted " * 40}]}
        r = client.post(path, json=body)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    for path in ("/v1/completions", "/v1/chat/completions"):
        assert cached(path, cache_salt=f"{path}-a", priority=-2) == 0
        assert cached(path, cache_salt=f"{path}-b") == 0  # another namespace: no hit on a's prefix
        assert cached(path, cache_salt=f"{path}-a", priority=9) >= 32
        assert seen[-3:] == [(-2, f"{path}-a"), (0, f"{path}-b"), (9, f"{path}-a")]


def test_completion_logprobs_and_echo(client):
    r = client.post("/v1/completions", json={"prompt": "abc def", "max_tokens": 3, "logprobs": 2, "echo": True,
                                             **GREEDY})
    choice = r.json()["choices"][0]
    assert choice["text"].startswith("abc def")
    lp = choice["logprobs"]
    n = len(lp["tokens"])
    assert n == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"])
    assert all(x <= 0 for x in lp["token_logprobs"])  # the BOS the server added is not echoed
    assert all(len(t) <= 3 for t in lp["top_logprobs"])
    ids = client.post("/tokenize", json={"prompt": "abc def"}).json()["tokens"]
    r = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 3, "logprobs": 2, "echo": True, **GREEDY})
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 3
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # nothing predicts token 0


# --------------------------------------------------------------------------------------- known failures


def test_kf12_min_tokens_masks_every_eos_id_through_the_server(client, engine):
    eos = engine.core.cfg.eos_token_ids
    assert len(eos) >= 2
    req = {"prompt": "KF-12", "temperature": 0, "min_tokens": 32, "max_tokens": 64,
           "logit_bias": {str(t): 100 for t in eos}}  # EOS would win every step without the mask
    r = client.post("/v1/completions", json=req).json()
    assert r["usage"]["completion_tokens"] == 33 and r["choices"][0]["finish_reason"] == "stop"
    r = client.post("/v1/completions", json={**req, "logprobs": 0}).json()
    tokens = r["choices"][0]["logprobs"]["tokens"]
    eos_texts = {engine.core.tokenizer.decode([t], skip_special_tokens=False) for t in eos}
    assert len(tokens) == 33 and not set(tokens[:32]) & eos_texts and tokens[32] in eos_texts


@pytest.mark.parametrize("variant", ["plain", "n2", "logprobs"])
def test_kf13_max_tokens_one_next_to_a_penalized_request(server, variant):
    a = {"prompt": "short one", "max_tokens": 1, "temperature": 0, "seed": 1,
         "n": 2 if variant == "n2" else 1, **({"logprobs": 2} if variant == "logprobs" else {})}
    b = {"prompt": "the penalised request", "max_tokens": 10, "repetition_penalty": 1.05, **GREEDY}

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            alone = (await c.post("/v1/completions", json=b)).json()
            ra, rb = await asyncio.gather(c.post("/v1/completions", json=a), c.post("/v1/completions", json=b))
            bad = await asyncio.gather(*(c.post("/v1/completions", json={**a, "max_tokens": m}) for m in (0, -1)))
            return alone, ra, rb, bad

    alone, ra, rb, bad = asyncio.run(run())
    assert ra.status_code == rb.status_code == 200
    assert len(ra.json()["choices"]) == a["n"]
    for c in ra.json()["choices"]:
        assert c["finish_reason"] == "length"
    assert ra.json()["usage"]["completion_tokens"] == a["n"]
    if variant == "logprobs":
        assert len(ra.json()["choices"][0]["logprobs"]["tokens"]) == 1
    assert rb.json()["choices"][0]["text"] == alone["choices"][0]["text"]
    for r in bad:
        assert_error(r, 400, "max_tokens")


@pytest.mark.parametrize("path,body,words", [
    ("/v1/completions", {"prompt": [""]}, ["prompt[0]", "empty"]),
    ("/v1/completions", {"prompt": []}, ["prompt", "empty"]),
    ("/v1/completions", {"prompt": ""}, ["prompt", "empty"]),
    ("/v1/completions", {"prompt": [[]]}, ["prompt[0]", "empty"]),
    ("/v1/chat/completions", {"messages": []}, ["messages", "empty"]),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": ""}]}, ["messages[0].content", "empty"]),
])
def test_kf16_empty_prompt_is_a_400_naming_it_and_the_engine_lives_on(client, engine, path, body, words):
    assert_error(client.post(path, json={"model": MODEL, **body}), 400, *words)
    assert engine.is_running
    r = client.post("/v1/completions", json={"prompt": "still alive", "max_tokens": 2, **GREEDY})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_kf17_disconnect_aborts_and_a_finished_request_sends_no_abort(server, engine):
    aborted: list[str] = []
    core = engine.core
    real_abort = core.abort_request

    def spy(rid):
        aborted.append(rid)
        return real_abort(rid)

    core.abort_request = spy
    long = {"prompt": "never ending story", "max_tokens": 3000, **GREEDY}

    async def give_up(path, body):  # non-streaming: the client goes away once the request runs
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            task = asyncio.create_task(c.post(path, json=body))
            while not core.has_unfinished():
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    disconnects = 0
    try:
        for _ in range(3):
            asyncio.run(give_up("/v1/completions", long))
            disconnects += 1
            wait_idle(engine, 5)
        for path, body in [("/v1/completions", long)] + ([("/v1/chat/completions", {
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3000,
                "chat_template_kwargs": {"thinking": False}, **GREEDY})]):
            for _ in range(3):  # streaming: the client closes after 3 events
                with httpx.Client(base_url=server.url, timeout=30) as c:
                    with c.stream("POST", path, json={**body, "stream": True}) as r:
                        lines = r.iter_lines()
                        assert sum(1 for _, line in zip(range(6), lines) if line.startswith("data: ")) == 3
                disconnects += 1
                wait_idle(engine, 5)
        assert len(aborted) == disconnects  # one abort per request that lost its client
        stats = wait_idle(engine)
        assert stats["running"] == 0 and stats["waiting"] == 0
        aborted.clear()
        with httpx.Client(base_url=server.url, timeout=30) as c:
            r = c.post("/v1/completions", json={"prompt": "finish normally", "max_tokens": 4, "stream": True, **GREEDY})
            rid = sse(r.text)[0]["id"]
            r2 = c.post("/v1/completions", json={"prompt": "finish normally", "max_tokens": 4, **GREEDY})
        wait_idle(engine)
        assert aborted == [], (rid, r2.json()["id"], aborted)
    finally:
        core.abort_request = real_abort


def test_kf18_health_is_200_while_busy_and_503_once_the_engine_is_dead(client, server, ckpt):
    assert client.get("/health").status_code == 200
    long_prompt = list(range(3, 1003)) * 2  # 2000 tokens: a long prefill

    async def busy():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            task = asyncio.create_task(c.post("/v1/completions", json={"prompt": long_prompt, "max_tokens": 4,
                                                                       **GREEDY}))
            codes = []
            while not task.done():
                codes.append((await c.get("/health")).status_code)
                await asyncio.sleep(0.1)
            return codes, await task

    codes, r = asyncio.run(busy())
    assert r.status_code == 200 and codes and set(codes) == {200}

    eng = v41.AsyncEngine(model=str(ckpt), **ENGINE_KW)
    app = build_app(eng, MODEL)
    eng.shutdown()

    async def dead():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
            return (await c.get("/health"), await c.post("/v1/completions", json={"prompt": "x"}),
                    await c.post("/v1/completions", json={"prompt": "x", "stream": True}))

    health, plain, stream = asyncio.run(dead())
    assert health.status_code == 503
    assert_error(plain, 503)
    assert_error(stream, 503)


HEALTH_BOUND_S = 2.0  # /health must answer within this while the largest allowed n runs (issue 13 item 1)


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "many completions at once", "max_tokens": 16}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "many"}], "max_tokens": 16, "stream": True,
                              "chat_template_kwargs": {"thinking": False}}),
])
def test_health_answers_in_bounded_time_while_the_largest_allowed_n_runs(server, engine, path, body):
    """n = 1000000 froze the server (issue 13 item 1); n is now bounded by the engine's max_n, and a request at
    that bound keeps the event loop free: every /health poll during it answers 200 within HEALTH_BOUND_S."""
    assert engine.max_n == 128  # EngineArgs' default

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            task = asyncio.create_task(c.post(path, json={**body, "n": engine.max_n, **GREEDY}))
            while not engine.core.has_unfinished() and not task.done():
                await asyncio.sleep(0.01)
            polls = []
            while not task.done():
                t0 = time.monotonic()
                r = await c.get("/health", timeout=HEALTH_BOUND_S)  # raises ReadTimeout past the bound
                polls.append((r.status_code, time.monotonic() - t0))
                await asyncio.sleep(0.05)
            return await task, polls

    r, polls = asyncio.run(run())
    assert r.status_code == 200, r.text
    indices = {c["index"] for c in r.json()["choices"]} if not body.get("stream") else \
        {e["choices"][0]["index"] for e in sse(r.text)[:-1] if e["choices"]}
    assert indices == set(range(engine.max_n))
    assert polls and all(code == 200 and s < HEALTH_BOUND_S for code, s in polls), polls


def test_health_follows_the_heartbeat(engine):
    @dataclass
    class Beating:
        last_heartbeat_s: float
        is_running: bool = True

    async def get(eng):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(build_app(eng, MODEL)), base_url="http://t") as c:
            return (await c.get("/health")).status_code

    assert asyncio.run(get(Beating(time.monotonic()))) == 200
    assert asyncio.run(get(Beating(time.monotonic() - 60))) == 503
    assert asyncio.run(get(Beating(time.monotonic(), is_running=False))) == 503


# ----------------------------------------------------------------------------------------- bad inputs


@pytest.mark.parametrize("body,param", [
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"n": 0}, "n"),
    ({"n": 129}, "n"),  # above the engine's max_n (128)
    ({"n": 1000000, "max_tokens": 2}, "n"),  # froze the server (issue 13 item 1)
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"prompt": list(range(3, 1003)) * 5}, "prompt"),  # 5000 tokens > max_model_len 4096
    ({"prompt": list(range(3, 103)), "max_tokens": 4000}, "max_tokens"),
    ({"model": "no-such-model"}, "model"),
    ({"temperature": "hot"}, "temperature"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"priority": 2**31}, "priority"),
    ({"priority": 1.5}, "priority"),
    ({"priority": True}, "priority"),
    ({"priority": "1"}, "priority"),
    ({"cache_salt": 5}, "cache_salt"),
    ({"cache_salt": ""}, "cache_salt"),
])
def test_bad_completion_inputs_are_400(client, engine, body, param):
    err = assert_error(client.post("/v1/completions", json={"prompt": "x", **body}), 400)
    assert err["param"] == param, err
    assert engine.is_running


CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"max_tokens": "5"}, "max_tokens"),  # the three of issue 13 item 9
    ("/v1/completions", {"n": "3"}, "n"),
    ("/v1/completions", {"stream": "yes"}, "stream"),
    ("/v1/completions", {"n": 2.0}, "n"),
    ("/v1/completions", {"temperature": True}, "temperature"),
    ("/v1/completions", {"top_p": "0.5"}, "top_p"),
    ("/v1/completions", {"top_k": "5"}, "top_k"),
    ("/v1/completions", {"seed": "7"}, "seed"),
    ("/v1/completions", {"min_tokens": "1"}, "min_tokens"),
    ("/v1/completions", {"stop_token_ids": ["5"]}, "stop_token_ids.0"),
    ("/v1/completions", {"logit_bias": {"5": "1"}}, "logit_bias.5"),
    ("/v1/completions", {"ignore_eos": 1}, "ignore_eos"),
    ("/v1/completions", {"echo": "true"}, "echo"),
    ("/v1/completions", {"logprobs": "1"}, "logprobs"),
    ("/v1/completions", {"skip_special_tokens": "false"}, "skip_special_tokens"),
    ("/v1/completions", {"include_stop_str_in_output": 0}, "include_stop_str_in_output"),
    ("/v1/completions", {"stream": True, "stream_options": {"include_usage": "yes"}},
     "stream_options.include_usage"),
    ("/v1/completions", {"prompt": [0, "5"]}, "prompt"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": "5"}, "max_completion_tokens"),
    ("/v1/chat/completions", {**CHAT, "logprobs": "true"}, "logprobs"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": "2"}, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ("/v1/chat/completions", {**CHAT, "presence_penalty": "0.5"}, "presence_penalty"),
    ("/tokenize", {"add_special_tokens": "no"}, "add_special_tokens"),
    ("/detokenize", {"tokens": ["5"]}, "tokens.0"),
    ("/detokenize", {"tokens": [5], "skip_special_tokens": 1}, "skip_special_tokens"),
])
def test_numbers_and_booleans_of_the_wrong_json_type_are_400_not_coerced(client, engine, path, body, param):
    base = {"prompt": "x", "max_tokens": 2} if path in ("/v1/completions", "/tokenize") else {}
    err = assert_error(client.post(path, json={**base, **body}), 400)
    assert (err["param"] or "").startswith(param), err
    assert engine.is_running


def test_a_cache_salt_with_a_lone_surrogate_is_a_400_naming_it(client, engine):
    body = b'{"prompt": "x", "max_tokens": 2, "cache_salt": "tenant-\\ud800"}'  # JSON may escape one; UTF-8 not
    r = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    err = assert_error(r, 400, "valid UTF-8")
    assert err["param"] == "cache_salt" and engine.is_running


@pytest.mark.parametrize("path,body,param", [  # raw JSON text: JSON may escape a lone surrogate, UTF-8 cannot
    ("/v1/completions", r'{"prompt": "a\udfffb", "max_tokens": 2}', "prompt"),
    ("/v1/completions", r'{"prompt": ["ok", "a\udfffb"], "max_tokens": 2}', "prompt[1]"),
    ("/v1/completions", r'{"prompt": "ok", "max_tokens": 2, "stop": ["\ud800"]}', "stop[0]"),
    ("/v1/chat/completions", r'{"messages": [{"role": "user", "content": "a\udfffb"}], "max_tokens": 2}',
     "messages[0].content"),
    ("/v1/chat/completions", r'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]}',
     "messages[0].content[0].text"),
    ("/v1/chat/completions", r'{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", '
     r'"function": {"name": "f", "description": "\udfff"}}]}', "tools[0].function.description"),
    ("/tokenize", r'{"prompt": "a\udfffb"}', "prompt"),
    ("/tokenize", r'{"messages": [{"role": "user", "content": "a\udfffb"}]}', "messages[0].content"),
    ("/detokenize", r'{"tokens": [5], "model": "\udfff"}', "model"),
])
def test_a_lone_surrogate_anywhere_is_a_400_naming_the_field_on_every_route(client, engine, path, body, param):
    r = client.post(path, content=body.encode(), headers={"content-type": "application/json"})
    err = assert_error(r, 400, f"{param} must be valid UTF-8 text", "lone surrogate")
    assert err["param"] == param and engine.is_running


@pytest.mark.parametrize("body,param", [
    ({"tools": "not a list"}, "tools"),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{not json"}}]},
     "tools.0.function.parameters"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]},
        {"role": "user", "content": "hi"}]}, "messages[0].tool_calls"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
    ({"model": "no-such-model"}, "model"),
    ({"temperature": -1}, "temperature"),
    ({"n": 1000000, "max_tokens": 2}, "n"),
])
def test_bad_chat_inputs_are_400(client, body, param):
    base = {"messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}
    err = assert_error(client.post("/v1/chat/completions", json={**base, **body}), 400)
    assert err["param"] == param or (err["param"] or "").startswith(param), err


IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
TEXT = {"type": "text", "text": "describe it"}


@pytest.mark.parametrize("path,parts,words", [
    ("/v1/chat/completions", [IMAGE, TEXT], ["messages[0].content[0] is an image part ('image_url')",
                                             "takes no image input"]),
    ("/v1/chat/completions", [TEXT, {"type": "image", "image": "AAAA"}], ["messages[0].content[1] is an image part"]),
    ("/v1/chat/completions", [TEXT, {"type": "bogus"}], ["messages[0].content[1]",
                                                         "unsupported content part type 'bogus'"]),
    ("/v1/chat/completions", [{"type": "refusal", "refusal": "no"}], ["unsupported content part type 'refusal'"]),
    ("/tokenize", [IMAGE, TEXT], ["messages[0].content[0] is an image part"]),
    ("/tokenize", [{"type": "bogus"}], ["messages[0].content[0] has the unsupported content part type"]),
])
def test_image_and_unknown_content_parts_are_400_naming_the_part(client, path, parts, words):
    """Issue 13 item 11: an image part (this build has no vision input) rendered as a bare image token, an unknown
    part as the literal text "[Unsupported bogus]"; both are refused, over gRPC too (serve/validation.py)."""
    body = {"messages": [{"role": "user", "content": parts}], "max_tokens": 2}
    err = assert_error(client.post(path, json=body), 400, *words)
    assert err["param"].startswith("messages[0].content["), err
    ok = client.post(path, json={**body, "messages": [{"role": "user", "content": [TEXT, TEXT]}]})
    assert ok.status_code == 200, ok.text  # text parts are fine


def test_malformed_json_body_is_400(client):
    r = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert_error(r, 400)


# --------------------------------------------------------------------------------------- test doubles


@dataclass
class ScriptedEngine:
    """Yields a fixed completion one token per step, then EOS (stop), for every request."""

    base: v41.AsyncEngine
    text: str
    aborted: list = field(default_factory=list)
    is_running: bool = True

    def __post_init__(self):
        core = self.base.core
        self.tokenizer, self.cfg, self.max_model_len = core.tokenizer, core.cfg, core.max_model_len
        self.ids = self.tokenizer.encode(self.text, add_special_tokens=False).ids + [self.cfg.eos_token_ids[0]]

    async def generate(self, prompt, params, request_id, *, priority=0, cache_salt=None):
        for k, tok in enumerate(self.ids):
            last = k == len(self.ids) - 1
            yield RequestOutput(request_id, None, prompt["prompt_token_ids"], None, [
                CompletionOutput(i, self.tokenizer.decode([tok]), [tok], None, None, "stop" if last else None)
                for i in range(params.n)], finished=last)
            await asyncio.sleep(0)

    async def abort(self, request_id):
        self.aborted.append(request_id)

    def stats(self):
        return {"running": 0, "waiting": 0, "blocks": {"swa": {"used": 1, "cached": 0, "free": 3, "total": 4}},
                "prefix_hit_rate": 0.5}


@dataclass
class FailingEngine(ScriptedEngine):
    """Raises ``error`` before any output (``after=0``) or after ``after`` outputs."""

    error: BaseException = None
    after: int = 0

    async def generate(self, prompt, params, request_id, *, priority=0, cache_salt=None):
        for k in range(self.after):
            yield RequestOutput(request_id, None, prompt["prompt_token_ids"], None,
                                [CompletionOutput(0, "x", [self.ids[0]], None, None)], finished=False)
        raise self.error


def asgi(app):
    return httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t", timeout=30)


@pytest.mark.parametrize("error,status", [(QueueFullError("the queue is full"), 429),
                                          (EngineDeadError("the engine died"), 503),
                                          (ValueError("prompt too weird"), 400)])
def test_engine_errors_map_to_their_status(engine, error, status):
    app = build_app(FailingEngine(engine, "x", error=error), MODEL)

    async def run():
        async with asgi(app) as c:
            plain = await c.post("/v1/completions", json={"prompt": "x"})
            stream = await c.post("/v1/completions", json={"prompt": "x", "stream": True})
            return plain, stream

    for r in asyncio.run(run()):
        assert_error(r, status, str(error))


def test_engine_death_mid_stream_ends_the_stream_with_an_error_event(engine):
    app = build_app(FailingEngine(engine, "x", error=EngineDeadError("the engine died"), after=2), MODEL)

    async def run():
        async with asgi(app) as c:
            return await c.post("/v1/completions", json={"prompt": "x", "stream": True})

    r = asyncio.run(run())
    assert r.status_code == 200
    events = sse(r.text)
    assert [e["choices"][0]["text"] for e in events[:2]] == ["x", "x"]
    assert events[2]["error"]["code"] == "engine_dead" and events[3] == "[DONE]"


def test_metrics_expose_every_name_per_app(client, engine):
    client.post("/v1/completions", json={"prompt": "metrics", "max_tokens": 3, **GREEDY})
    text = client.get("/metrics").text
    for name in METRIC_NAMES:
        assert name in text, name
    assert 'v41_requests_total{finish_reason="length"}' in text
    assert 'v41_kv_cache_usage_ratio{kind="swa"}' in text
    other = build_app(ScriptedEngine(engine, "hi"), MODEL)  # its own registry: no clash, no shared counts

    async def scrape():
        async with asgi(other) as c:
            return (await c.get("/metrics")).text

    fresh = asyncio.run(scrape())
    assert 'v41_kv_cache_usage_ratio{kind="swa"} 0.25' in fresh
    assert 'v41_requests_total{finish_reason="length"}' not in fresh


def test_kv_metrics_count_blocks_left_to_the_prefix_cache_as_cached_not_used(client, engine):
    """Issue 13: after a request the prefix cache keeps its pages; an idle server shows them as cached blocks
    (evictable), with 0 used and a usage ratio of 0 — not as used."""
    prompt = list(range(100, 148))  # 48 tokens: three full pages of 16 stay cached
    client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, **GREEDY})
    wait_idle(engine)
    text = client.get("/metrics").text

    def gauge(name: str, kind: str) -> float:
        return float(re.search(rf'^{name}{{kind="{kind}"}} (\S+)$', text, re.M).group(1))

    for kind in ("swa", "ckv1", "ckv2"):
        assert gauge("v41_kv_cache_used_blocks", kind) == 0 and gauge("v41_kv_cache_usage_ratio", kind) == 0
        assert 0 < gauge("v41_kv_cache_cached_blocks", kind) < gauge("v41_kv_cache_total_blocks", kind)


def test_models_tokenize_detokenize(client, engine):
    models = client.get("/v1/models").json()
    assert models["data"][0]["id"] == MODEL and models["data"][0]["max_model_len"] == engine.core.max_model_len
    tok = client.post("/tokenize", json={"prompt": "hello world"}).json()
    assert tok["tokens"][0] == engine.core.cfg.bos_token_id and tok["count"] == len(tok["tokens"])
    assert tok["max_model_len"] == engine.core.max_model_len
    text = client.post("/detokenize", json={"tokens": tok["tokens"][1:]}).json()["prompt"]
    assert text == "hello world"
    assert_error(client.post("/detokenize", json={"tokens": [10**6]}), 400, "vocabulary")


def test_64_concurrent_requests_complete(server, engine):
    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=60,
                                     limits=httpx.Limits(max_connections=64)) as c:
            reqs = [c.post("/v1/completions", json={"prompt": f"request number {i}", "max_tokens": 4,
                                                    "stream": i % 2 == 0, **GREEDY}) for i in range(64)]
            return await asyncio.gather(*reqs)

    rs = asyncio.run(run())
    assert all(r.status_code == 200 for r in rs), [r.text for r in rs if r.status_code != 200][:2]
    for i, r in enumerate(rs):
        if i % 2:
            assert r.json()["usage"]["completion_tokens"] == 4
        else:
            assert sse(r.text)[-2]["choices"][0]["finish_reason"] == "length"
    wait_idle(engine)


def test_openai_client_against_the_real_server(server, llm):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    want = llm.generate(["The quick brown fox"],
                        v41.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0].outputs[0].text
    extra = {"ignore_eos": True}
    got = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=8, temperature=0,
                                    extra_body=extra)
    assert got.choices[0].text == want and got.usage.completion_tokens == 8
    stream = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=8, temperature=0,
                                       stream=True, extra_body=extra)
    assert "".join(c.choices[0].text for c in stream if c.choices) == want
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=0)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"location": {"type": "string"}}}}}]
    msgs = [{"role": "user", "content": "Weather in Tokyo?"}]
    chat = client.chat.completions.create(model=MODEL, messages=msgs, tools=tools, max_tokens=8, temperature=0)
    assert chat.choices[0].finish_reason in ("length", "stop", "tool_calls")
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, tools=tools, max_tokens=8,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    streamed = "".join((c.choices[0].delta.content or "") for c in chunks if c.choices)
    assert streamed == (chat.choices[0].message.content or "")


# ------------------------------------------------------------------------------------------------ chat


@pytest.mark.parametrize("thinking", [True, False])
def test_chat_greedy_matches_llm_and_streaming(client, llm, thinking):
    msgs = [{"role": "user", "content": "Say hello."}]
    ids = v41.chat.encode_messages(llm.get_tokenizer(), msgs, thinking=thinking)
    want = llm.generate([ids], v41.SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))[0].outputs[0]
    req = {"model": MODEL, "messages": msgs, "max_tokens": 10, "chat_template_kwargs": {"thinking": thinking},
           **GREEDY}
    body = client.post("/v1/chat/completions", json=req).json()
    msg = body["choices"][0]["message"]
    assert body["usage"]["prompt_tokens"] == len(ids) and body["usage"]["completion_tokens"] == 10
    parser = v41.chat.OutputParser(llm.get_tokenizer(), thinking=thinking, prompt_ids=ids)
    parser.feed(want.token_ids)
    ref = parser.finish()
    assert msg["content"] == ref.content and msg["reasoning_content"] == ref.reasoning_content
    if not thinking:
        assert not msg["reasoning_content"]
        assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0
    events = sse(client.post("/v1/chat/completions", json={**req, "stream": True,
                                                           "stream_options": {"include_usage": True}}).text)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    deltas = [e["choices"][0]["delta"] for e in events[:-2]]
    assert "".join(d.get("content") or "" for d in deltas) == (msg["content"] or "")
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == (msg["reasoning_content"] or "")
    assert events[-3]["choices"][0]["finish_reason"] == body["choices"][0]["finish_reason"]
    usage = events[-2]["usage"]
    assert usage["prompt_tokens"] == len(ids) and usage["completion_tokens"] == 10
    assert usage["completion_tokens_details"] == body["usage"]["completion_tokens_details"]
    assert 0 <= usage["prompt_tokens_details"]["cached_tokens"] <= len(ids)


TOOL_TEXT = ("Let me check.</think>\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"get_weather\">\n"
             "<｜DSML｜ parameter name=\"location\" string=\"true\">Tokyo</｜DSML｜ parameter>\n"
             "</｜DSML｜ invoke>\n</｜DSML｜ calls>")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"location": {"type": "string"}}}}}]


def test_chat_tool_calls_streaming_and_not(engine):
    scripted = ScriptedEngine(engine, TOOL_TEXT)
    app = build_app(scripted, MODEL, enable_auto_tool_choice=True)
    req = {"messages": [{"role": "user", "content": "Weather in Tokyo?"}], "tools": TOOLS}

    async def run():
        async with asgi(app) as c:
            plain = (await c.post("/v1/chat/completions", json=req)).json()
            stream = await c.post("/v1/chat/completions", json={**req, "stream": True})
            none = (await c.post("/v1/chat/completions", json={**req, "tool_choice": "none"})).json()
            return plain, sse(stream.text), none

    plain, events, none = asyncio.run(run())
    choice = plain["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning_content"] == "Let me check."
    calls = choice["message"]["tool_calls"]
    assert len(calls) == 1 and calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"location": "Tokyo"}
    pieces: dict[int, dict] = {}
    for e in events[:-1]:
        for d in e["choices"][0]["delta"].get("tool_calls") or []:
            p = pieces.setdefault(d["index"], {"name": "", "arguments": ""})
            p["name"] += d["function"].get("name") or ""
            p["arguments"] += d["function"].get("arguments") or ""
    assert pieces == {0: {"name": "get_weather", "arguments": calls[0]["function"]["arguments"]}}
    assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"
    assert none["choices"][0]["finish_reason"] == "stop" and not none["choices"][0]["message"]["tool_calls"]
    assert scripted.aborted == []


def chat_both_ways(app, req: dict) -> tuple[dict, list]:
    """The JSON body of ``req`` and the SSE events of the same request streamed."""

    async def run():
        async with asgi(app) as c:
            plain = (await c.post("/v1/chat/completions", json=req)).json()
            stream = await c.post("/v1/chat/completions", json={**req, "stream": True})
            return plain, sse(stream.text)

    return asyncio.run(run())


def streamed_calls(events: list) -> dict[int, dict]:
    pieces: dict[int, dict] = {}
    for e in events[:-1]:
        for d in (e["choices"][0]["delta"].get("tool_calls") if e["choices"] else None) or []:
            p = pieces.setdefault(d["index"], {"name": "", "arguments": ""})
            p["name"] += d["function"].get("name") or ""
            p["arguments"] += d["function"].get("arguments") or ""
    return pieces


def test_truncated_tool_call_is_never_finish_reason_tool_calls_streaming_or_not(engine):
    """Issue 18 item 7 (docs/model.md §7.10a): the model stops inside a call; the cut non-string value is
    dropped, the call keeps what was complete, the finish reason stays the engine's."""
    cut = TOOL_TEXT.replace("</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ calls>",
                            '</｜DSML｜ parameter>\n<｜DSML｜ parameter name="days" string="false">[1, 2')
    assert cut != TOOL_TEXT
    app = build_app(ScriptedEngine(engine, cut), MODEL, enable_auto_tool_choice=True)
    plain, events = chat_both_ways(app, {"messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS})
    choice = plain["choices"][0]
    assert choice["finish_reason"] == "stop" and events[-2]["choices"][0]["finish_reason"] == "stop"
    calls = choice["message"]["tool_calls"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("get_weather", {"location": "Tokyo"})]
    assert streamed_calls(events) == {0: {"name": "get_weather", "arguments": calls[0]["function"]["arguments"]}}


@pytest.mark.parametrize("tool_choice, enabled, status", [
    (None, False, 400), ("auto", False, 400), ("none", False, 200), ("required", False, 200),
    ({"type": "function", "function": {"name": "get_weather"}}, False, 200), (None, True, 200), ("auto", True, 200),
])
def test_auto_tool_choice_needs_enable_auto_tool_choice_as_in_vllm(engine, tool_choice, enabled, status):
    app = build_app(ScriptedEngine(engine, TOOL_TEXT), MODEL, enable_auto_tool_choice=enabled)
    req = {"messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS}
    if tool_choice is not None:
        req["tool_choice"] = tool_choice

    async def run():
        async with asgi(app) as c:
            return await c.post("/v1/chat/completions", json=req)

    r = asyncio.run(run())
    if status == 400:
        err = assert_error(r, 400, "--enable-auto-tool-choice")
        assert err["param"] == "tool_choice"
    else:
        assert r.status_code == 200, r.text
    # Without tools, no flag is needed.
    plain = asyncio.run(_post_plain(build_app(ScriptedEngine(engine, "Hi."), MODEL)))
    assert plain.status_code == 200


async def _post_plain(app):
    async with asgi(app) as c:
        return await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})


def test_zero_argument_call_and_stray_closer_streaming_and_not(engine):
    """Issue 18 items 2 and 5 end to end: a self-closing invoke is a call with ``{}``; a stray DSML closer
    never reaches content."""
    text = 'Hmm.</think>Ok.</｜DSML｜ calls>\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather"/>\n</｜DSML｜ calls>'
    app = build_app(ScriptedEngine(engine, text), MODEL, enable_auto_tool_choice=True)
    plain, events = chat_both_ways(app, {"messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS})
    choice = plain["choices"][0]
    assert choice["message"]["content"] == "Ok." and choice["finish_reason"] == "tool_calls"
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]] == \
        [("get_weather", "{}")]
    assert "".join((e["choices"][0]["delta"].get("content") or "") for e in events[:-1] if e["choices"]) == "Ok."
    assert streamed_calls(events) == {0: {"name": "get_weather", "arguments": "{}"}}
    assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"
