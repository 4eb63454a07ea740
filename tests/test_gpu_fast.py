"""The fast path on a GPU (skipped without CUDA; run on the device machine by ``benches/gpu/flash_slice.sh``):
every Triton kernel vs its reference in bf16 and float32 (fresh random inputs, poisoned outputs); the fast engine
on CUDA gives the CPU engine's greedy tokens (tiny models, float32); CUDA-graph replay gives eager's tokens and
logits at every captured size, padded batches included; speculation replays verify and draft graphs and gives
the eager tokens; a decode step makes no host synchronisation (with the compute-dtype cache and with FP8
records)."""

from __future__ import annotations

import gc

import pytest
import torch

from kernel_checks import CHECKS, run

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("check", [c.__name__ for c in CHECKS])
def test_triton_kernel_equals_its_reference_on_the_gpu(check, dtype, monkeypatch):
    monkeypatch.setenv("V41_KERNELS", "triton")  # the CUDA kernels: tests/test_gpu_cuda.py
    bad = [(n, e, t) for n, e, t in run(check, "cuda", dtype) if not e <= t]
    assert not bad, bad


def _prompts():
    return [[0] + list(range(5, 5 + n)) for n in (3, 17, 40, 63)]


@pytest.mark.parametrize("kv", ["auto", "fp8"])
@pytest.mark.parametrize("arch", ["deepseek_v41", "deepseek_v4"])
def test_fast_engine_on_cuda_gives_the_cpu_engines_greedy_tokens(tmp_path, arch, kv):
    from v41 import LLM, SamplingParams
    from v41.testing.tiny import make_tiny

    gc.collect()  # an earlier test's engine must not hold the memory this one budgets
    torch.cuda.empty_cache()
    path = str(make_tiny(tmp_path / arch, arch))
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    cpu = [o.outputs[0].token_ids
           for o in LLM(path, block_size=16, kv_cache_dtype=kv).generate(_prompts(), sp, use_tqdm=False)]
    for eager in (True, False):
        llm = LLM(path, block_size=16, device="cuda", dtype="float32", enforce_eager=eager,
                  gpu_memory_utilization=0.2, kv_cache_dtype=kv)
        gpu = [o.outputs[0].token_ids for o in llm.generate(_prompts(), sp, use_tqdm=False)]
        assert gpu == cpu, (eager, gpu, cpu)
        del llm
        gc.collect()
        torch.cuda.empty_cache()


@pytest.mark.parametrize("arch", ["deepseek_v41", "deepseek_v4"])
def test_graph_replay_equals_eager_at_every_captured_size(tmp_path, arch):
    from v41.engine.args import EngineArgs
    from v41.engine.model_runner import ModelRunner
    from v41.models.engram_loader import engram_hasher
    from v41.testing.tiny import make_tiny

    from engine_helpers import host_step

    path = make_tiny(tmp_path / arch, arch)
    runners = []
    for eager in (False, True):
        args = EngineArgs(model=str(path), device="cuda", dtype="bfloat16", max_num_seqs=16,
                          max_cudagraph_capture_size=16, enforce_eager=eager)
        runner = ModelRunner(args, "cuda")
        runner.init_cache(num_blocks=16 * 8, num_state_rows=16, block_tokens=16, max_model_len=128)
        runners.append(runner)
    graphed, eager = runners
    assert graphed.graphs is not None and graphed.graphs.sizes == [1, 2, 4, 8, 16] and eager.graphs is None
    layout = graphed.cache_layout(16)
    hasher = engram_hasher(graphed.cfg, path / "tokenizer.json")
    gen = torch.Generator().manual_seed(0)
    for r in (1, 3, 8, 13, 16):
        prompts = [torch.randint(3, 1000, (int(n),), generator=gen).tolist() for n in torch.randint(4, 30, (r,))]
        prefill = host_step(layout, [(s, p, 0, []) for s, p in enumerate(prompts)], 8, False, hasher)
        outs = [run.execute(prefill) for run in runners]
        for _ in range(3):  # decode steps, teacher-forced with the eager argmax
            nxt = outs[1].argmax(-1).tolist()
            step = host_step(layout, [(s, [nxt[s]], len(p), p) for s, p in enumerate(prompts)], 8, False, hasher,
                             send_tables=False)
            assert graphed.graphs.fits(step)
            for s, p in enumerate(prompts):
                p.append(nxt[s])
            outs = [run.execute(step).float() for run in runners]
            assert torch.equal(outs[0].argmax(-1), outs[1].argmax(-1)), r
            assert ((outs[0] - outs[1]).norm(dim=-1) / outs[1].norm(dim=-1)).max() < 1e-2, r


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_speculation_replays_verify_and_draft_graphs_and_gives_the_eager_tokens(temperature):
    """The embedded model with its trained drafter, K = 3: verify steps (4 rows per request, padded batches) and
    draft passes replay graphs, and give the tokens of the eager speculative engine (seeded when sampled), which
    for greedy requests are the plain engine's."""
    spec = {"num_speculative_tokens": 3}
    plain = _generate(temperature, {})
    eager = _generate(temperature, {"speculative_config": spec, "enforce_eager": True})
    graphs = _generate(temperature, {"speculative_config": spec}, expect_graphs=True)
    assert graphs == eager
    if temperature == 0.0:
        assert graphs == plain


def test_adaptive_verification_replays_a_graph_set_per_query_token_count(monkeypatch):
    """Adaptive verification (K = 3) captures verify graphs for q = 1..4 and profiles them (uniform: graphs pad
    every request to the step's q). Under a profile where each verified draft costs 0.4 of a plain step, steps pick
    different q from the drafter's confidences, replay those sets, and greedy tokens stay the plain engine's."""
    import numpy as np

    from v41 import LLM, SamplingParams
    from v41.engine import model_runner
    from v41.engine.adaptive_verify import VerifyCosts

    prompts = ["def main(args):\n    ", "import os\nimport sys\n\n", "class Foo:\n"]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, seed=3)
    want = _generate(0.0, {})  # the same prompts and parameters
    measured = {}
    steep = VerifyCosts((1, 2, 4), np.array([[1.0, 1.4, 1.8, 2.2]] * 3), np.zeros(3), uniform=True)

    real = model_runner.measure_costs

    def profile(runner, k):  # the real profile runs (graph replays); the planner gets the steep one
        measured["costs"] = real(runner, k)
        return steep
    monkeypatch.setattr(model_runner, "measure_costs", profile)
    gc.collect()  # the plain engine holds its cache until collected
    torch.cuda.empty_cache()
    llm = LLM(None, device="cuda", dtype="float32", gpu_memory_utilization=0.2,
              speculative_config={"num_speculative_tokens": 3, "enable_adaptive_verification": True})
    runner = llm.engine.executor.runner
    assert [g.query_tokens for g in runner.narrow_graphs] == [1, 2, 3] and runner.graphs.query_tokens == 4
    assert measured["costs"].uniform and measured["costs"].verify_s.shape[1] == 4
    replays = {q: 0 for q in (1, 2, 3, 4)}
    for g in (*runner.narrow_graphs, runner.graphs):
        g.run = _counting(g.run, replays, g.query_tokens)
    got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]
    llm.engine.shutdown()
    del llm, runner
    gc.collect()
    assert got == want
    assert sum(1 for q in (2, 3, 4) if replays[q]) >= 2, replays


def _generate(temperature: float, extra: dict, expect_graphs: bool = False) -> list[list[int]]:
    """Token ids of three prompts from the embedded model (float32) built with ``extra`` options; with
    ``expect_graphs`` the verify and draft graphs must have replayed and drafts have been accepted."""
    from v41 import LLM, SamplingParams

    prompts = ["def main(args):\n    ", "import os\nimport sys\n\n", "class Foo:\n"]
    gc.collect()  # earlier engines hold their caches until collected
    torch.cuda.empty_cache()
    llm = LLM(None, device="cuda", dtype="float32", gpu_memory_utilization=0.2, **extra)
    replays = {"verify": 0, "draft": 0}
    if expect_graphs:
        runner = llm.engine.executor.runner
        assert runner.graphs.query_tokens == 4 and runner.draft_graphs is not None
        for key, obj in (("verify", runner.graphs), ("draft", runner.draft_graphs)):
            obj.run = _counting(obj.run, replays, key)
    sp = SamplingParams(temperature=temperature, max_tokens=40, ignore_eos=True, seed=3)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    if expect_graphs:
        assert replays["verify"] >= 5 and replays["draft"] >= 5, replays
        assert sum(o.outputs[0].spec_decode.num_accepted_tokens for o in outs) > 0
    llm.engine.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs]


def _counting(fn, counts: dict, key: str):
    def wrapped(*args):
        counts[key] += 1
        return fn(*args)
    return wrapped


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_decode_step_makes_no_host_synchronisation(tmp_path, kv):
    from v41.engine.args import EngineArgs
    from v41.engine.model_runner import ModelRunner
    from v41.models.engram_loader import engram_hasher
    from v41.testing.tiny import make_tiny

    from engine_helpers import host_step

    path = make_tiny(tmp_path / "m", "deepseek_v41")
    runner = ModelRunner(EngineArgs(model=str(path), device="cuda", enforce_eager=True, kv_cache_dtype=kv), "cuda")
    runner.init_cache(num_blocks=64, num_state_rows=4, block_tokens=16, max_model_len=256)
    layout = runner.cache_layout(16)
    hasher = engram_hasher(runner.cfg, path / "tokenizer.json")
    prompts = [list(range(5, 25)), list(range(30, 41))]
    runner.execute(host_step(layout, [(s, p, 0, []) for s, p in enumerate(prompts)], 8, False, hasher))
    step = host_step(layout, [(s, [7], len(p), p) for s, p in enumerate(prompts)], 8, False, hasher)
    batch = runner.buffers.load(step)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        runner.model.forward(batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_sampling_makes_no_host_synchronisation():
    """The sampler's parameters reach the device by non-blocking copies: a mixed batch (greedy, temperature,
    top-k, top-p, min-p, logit bias, min_tokens) samples under sync-debug mode "error" and gives the warm-up call's tokens."""
    from v41.engine.params import SamplingParams
    from v41.engine.sampler import Sampler, SamplingState

    sampler = Sampler()
    logits = torch.randn(8, 129280, device="cuda") * 3
    kinds = [dict(temperature=0.0), dict(temperature=0.7), dict(temperature=1.0, top_k=50),
             dict(temperature=0.9, top_p=0.9), dict(temperature=1.0, min_p=0.05),
             dict(temperature=1.2, top_k=20, top_p=0.8), dict(temperature=0.0, logit_bias={5: 3.0, 9: -2.0}),
             dict(temperature=0.8, min_tokens=4, stop_token_ids=[7])]
    states = [SamplingState.create(SamplingParams(seed=i, **kw), [1, 2, 3]) for i, kw in enumerate(kinds)]
    want = sampler(logits, states).sampled_token_ids.clone()  # warm-up: buffers, kernel compilation
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = sampler(logits, states).sampled_token_ids
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(got, want)
    assert got[0] == logits[0].argmax()


def test_sampling_copies_its_parameters_from_pinned_memory():
    """The sampler's per-step parameter copies are DMA from pinned buffers: no host-to-device copy from pageable
    memory (which may wait for the stream, and so for the step's forward) in a call with sampled rows."""
    from torch.profiler import ProfilerActivity, profile

    from v41.engine.params import SamplingParams
    from v41.engine.sampler import Sampler, SamplingState

    sampler = Sampler()
    logits = torch.randn(3, 4096, device="cuda")
    states = [SamplingState.create(SamplingParams(seed=i, temperature=0.8, top_k=50 if i else -1), [1, 2])
              for i in range(3)]
    sampler(logits, states)  # warm-up: buffers, kernel compilation
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        sampler(logits, states)
        torch.cuda.synchronize()
    copies = [e.name for e in prof.events() if "Memcpy HtoD" in e.name]
    assert copies and not [name for name in copies if "Pageable" in name], copies

