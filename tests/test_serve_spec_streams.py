"""Serving with real speculation (issue 15 tests; docs/speculative-decoding.md): the embedded model with its trained
drafter streams, over HTTP and gRPC, the same greedy text as the same model without speculation, usage counts the
emitted tokens only, and a request aborted while it has drafts waiting for verification (or whose stream is
dropped) gives back every block of every kind, the drafter's ``dspark`` rows included."""

from __future__ import annotations

import asyncio
import json
import pytest
from test_engine import assert_all_blocks_free
from test_serve_spec_decode import TIMEOUT_S, grpc_stub, http, last_usage

from v41.engine.async_engine import AsyncEngine
from v41.engine.llm import LLM
from v41.engine.params import SamplingParams
from v41.serve.grpc_server import pb2
from v41.serve.openai_app import build_app
from v41.testing.embedded import embedded_model_dir

SPEC = {"num_speculative_tokens": 3}
KW = dict(max_num_seqs=4, block_size=16)
TOKENS = 24


@pytest.fixture(scope="module")
def engines():
    path = str(embedded_model_dir())
    plain, spec = AsyncEngine(model=path, **KW), AsyncEngine(model=path, speculative_config=SPEC, **KW)
    yield plain, spec
    plain.shutdown()
    spec.shutdown()


def streamed_text(app, prompt: str) -> tuple[str, dict]:
    body = {"prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    (resp,) = http(app, ("POST", "/v1/completions", body))
    assert resp.status_code == 200, resp.text
    events = [json.loads(line[6:]) for line in resp.text.splitlines() if line.startswith("data: {")]
    return "".join(e["choices"][0]["text"] for e in events if e["choices"]), last_usage(resp.text)


@pytest.mark.parametrize("prompt", ["def main(args):\n    ", "import os\nimport sys\n\n"])
def test_http_stream_with_speculation_is_the_plain_text_and_counts_emitted_tokens(engines, prompt):
    plain, spec = engines
    want, plain_usage = streamed_text(build_app(plain, "m"), prompt)
    got, usage = streamed_text(build_app(spec, "m"), prompt)
    assert got == want and len(want) > 0
    assert usage["completion_tokens"] == plain_usage["completion_tokens"] == TOKENS
    counts = usage["spec_decode"]
    assert counts["num_drafts"] > 0 and 0 < counts["num_accepted_tokens"] <= counts["num_draft_tokens"]
    assert counts["num_drafts"] + counts["num_accepted_tokens"] >= TOKENS - 1  # each verify step commits 1 + a
    assert "spec_decode" not in plain_usage


def test_grpc_stream_with_speculation_gives_the_plain_token_ids(engines):
    plain, spec = engines
    ids = [0, 17, 301, 55, 900]

    async def plain_ids():
        got = []  # the stream yields deltas
        async for out in plain.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=TOKENS,
                                                                                   ignore_eos=True)):
            got.extend(out.outputs[0].token_ids)
        return got

    want = asyncio.run(plain_ids())
    req = pb2.GenerateRequest(tokens=pb2.TokenIds(ids=ids), stream=True, sampling_params=pb2.SamplingParams(
        temperature=0.0, max_tokens=TOKENS, ignore_eos=True))
    got, done = [], None
    with grpc_stub(spec) as stub:
        for r in stub.Generate(req, timeout=TIMEOUT_S):
            if r.HasField("chunk"):
                got.extend(r.chunk.token_ids)
            elif r.HasField("complete"):
                done = r.complete
    assert got == want
    assert done is not None and done.spec_decode.num_drafts > 0


def test_abort_with_drafts_pending_frees_every_block_and_ring():
    llm = LLM(None, speculative_config={"num_speculative_tokens": 5}, **KW)
    core = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    for i, p in enumerate(["def main(args):\n    ", "class Foo:\n", "import os\n"]):
        core.add_request(f"r{i}", core.tokenizer.encode(p).ids, sp)
    while not all(len(s.output_token_ids) >= 3 and s.draft for s in core.seqs.values()):
        core.step()
    assert core.stats()["blocks"]["dspark"]["used"] > 0
    core.abort_request("r1")  # its drafts were planned into the next verify step
    for _ in range(3):
        core.step()
    for rid in list(core.requests):
        core.abort_request(rid)
    core.step()
    assert_all_blocks_free(llm)


def test_dropping_a_speculative_stream_aborts_it_and_frees_its_blocks():
    spec = AsyncEngine(model=str(embedded_model_dir()), speculative_config=SPEC, enable_prefix_caching=False, **KW)

    async def run():
        n = 0
        async for _ in spec.generate("def main(args):\n    ", SamplingParams(temperature=0, max_tokens=200,
                                                                              ignore_eos=True)):
            n += 1
            if n == 3:
                break  # closes the stream: the engine aborts the request
        for _ in range(200):
            stats = await spec.stats()
            if stats["running"] == 0 and stats["waiting"] == 0:
                break
            await asyncio.sleep(0.05)
        return stats

    try:
        stats = asyncio.run(run())
    finally:
        spec.shutdown()
    assert stats["running"] == 0 and stats["waiting"] == 0
    assert all(pool["used"] == 0 for pool in stats["blocks"].values()), stats["blocks"]
    assert stats["spec_decode"]["num_drafts"] > 0  # it was speculating when dropped
