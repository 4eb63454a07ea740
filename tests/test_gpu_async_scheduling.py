"""Async scheduling on the GPU (engine/pending.py, engine/core.py): the pipelined engine — decode steps replayed
from CUDA graphs, each launched before the previous step's ids reach the host, those ids and their Engram rows
filled on the device — gives the synchronous engine's tokens, and launching a step makes no host synchronisation."""

from __future__ import annotations

import gc

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _prompts():
    return [[0] + list(range(5 + 7 * i, 5 + 7 * i + n)) for i, n in enumerate((3, 17, 40, 63, 9))]


def _params():
    from v41 import SamplingParams

    return [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
            SamplingParams(temperature=0.9, seed=1, max_tokens=30, ignore_eos=True, logprobs=2),
            SamplingParams(temperature=1.0, seed=2, top_k=20, max_tokens=25),
            SamplingParams(temperature=0.0, max_tokens=12, min_tokens=6),
            SamplingParams(temperature=0.8, seed=3, max_tokens=20, repetition_penalty=1.2)]


@pytest.mark.parametrize("kv", ["auto", "fp8"])
@pytest.mark.parametrize("arch", ["deepseek_v41", "deepseek_v4"])
def test_async_scheduling_on_cuda_gives_the_synchronous_tokens(tmp_path, arch, kv):
    from v41 import LLM
    from v41.testing.tiny import make_tiny

    path = str(make_tiny(tmp_path / arch, arch))
    got = {}
    for scheduling in (False, True):
        gc.collect()
        torch.cuda.empty_cache()
        llm = LLM(path, block_size=16, device="cuda", dtype="float32", gpu_memory_utilization=0.2, kv_cache_dtype=kv,
                  async_scheduling=scheduling)
        assert llm.engine._async_scheduling == scheduling and llm.engine.executor.runner.graphs is not None
        outs = [llm.generate([p], sp, use_tqdm=False)[0] for p, sp in zip(_prompts(), _params())]  # one by one
        outs += llm.generate(_prompts(), _params(), use_tqdm=False)  # one batch
        got[scheduling] = [(list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs]
        llm.engine.shutdown()
        del llm
    assert got[True] == got[False]


def test_launching_a_pipelined_decode_step_makes_no_host_synchronisation(tmp_path):
    from v41 import LLM, SamplingParams
    from v41.testing.tiny import make_tiny

    gc.collect()
    torch.cuda.empty_cache()
    llm = LLM(str(make_tiny(tmp_path / "m", "deepseek_v41")), block_size=16, device="cuda", dtype="bfloat16",
              gpu_memory_utilization=0.2)
    core = llm.engine
    for i, p in enumerate(_prompts()[:4]):
        core.add_request(str(i), p, SamplingParams(temperature=0.7 * (i % 2), seed=i, max_tokens=40,
                                                   ignore_eos=True))
    for _ in range(6):  # prefill, then decode steps replayed from graphs (warm)
        core.step()
    launch, checked = core._launch, []

    def strict(plan, prev=None):
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = launch(plan, prev)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        checked.append(prev is not None)
        return out

    core._launch = strict
    for _ in range(5):
        core.step()
    assert checked == [True] * 5  # every step launched behind the previous one, none synchronised
    while core.has_unfinished():
        core.step()
    core.shutdown()
