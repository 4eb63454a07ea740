"""Engram offload paging in the engine (issue 16; docs/engram.md) on the embedded tiny V4.1 model: with the tables in
host memory and a device row cache of 16 slots (evictions every step), greedy and seeded tokens equal the
device-resident tables' through chunked prefill, prefix hits, preemption, speculation and TP = 2; the counters add
up; bad options and bad tables are clear errors."""

from __future__ import annotations

import glob
import os
import re

import numpy as np
import pytest
import torch

from v41.engine.engram_config import EngramConfig
from v41.engine.llm import LLM
from v41.engine.params import SamplingParams

OFFLOAD = {"cpu_offload": True, "hot_rows": 16}
PROMPTS = [[0, 17, 45, 300, 12, 9, 9, 81, 640, 5], [0, 3, 4, 5, 6, 7] * 6, [0, 999, 2], [0] + list(range(100, 140))]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
          SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=16, ignore_eos=True),
          SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
          SamplingParams(temperature=1.0, seed=3, max_tokens=14, ignore_eos=True)]


def tokens(llm: LLM, prompts=PROMPTS, params=PARAMS) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def resident():
    return tokens(LLM(None, max_num_seqs=4))


def assert_engram_counts(llm: LLM) -> dict:
    s = llm.engine.stats()["engram"]
    assert s["hits"] + s["misses"] == s["lookups"] > 0
    assert s["evictions"] > 0 and s["transfer"] in ("copy", "uva")
    return s


def shm_paths(llm: LLM) -> list[str]:
    """The /dev/shm files rank 0's host tables were mapped from (they must be gone: removed after mapping)."""
    return [p.engram.host.path for p in llm.engine.executor.runner.engram.layers.values()]


@pytest.mark.parametrize("hot", [0, 12, 16])
def test_offload_with_a_tiny_cache_gives_the_resident_tokens(resident, hot):
    """hot 0: every row copied every step (staging only); 12: one set of 8 ways; 16: two sets."""
    llm = LLM(None, max_num_seqs=4, engram_config={"cpu_offload": True, "hot_rows": hot})
    paths = shm_paths(llm)
    assert all(p is not None and p.startswith("/dev/shm/v41-engram-") and not os.path.exists(p) for p in paths)
    assert tokens(llm) == resident
    s = llm.engine.stats()["engram"]
    assert s["hits"] + s["misses"] == s["lookups"] > 0
    assert s["hot_rows"] == {1: hot // 8 * 8, 4: hot // 8 * 8}
    assert (s["evictions"] > 0) == (hot > 0) and (s["hits"] > 0) == (hot > 0)


def test_slot_cache_bindings():
    from v41 import _native

    assert [_native.EngramSlotCache(h, 4, 100).hot_rows for h in (0, 5, 12, 16)] == [0, 5, 8, 16]
    c = _native.EngramSlotCache(2, 1, 100)
    slots, rows, dst = c.plan(1, np.array([7, 8, 7], dtype=np.int64))
    assert slots.tolist() == [0, 1, 0] and rows.tolist() == [7, 8] and dst.tolist() == [0, 1]
    with pytest.raises(ValueError, match="needs 2 slots for its missing rows, only 1 are free"):
        c.plan(2, np.array([9, 10], dtype=np.int64))  # 7 and 8 pinned by step 1, one staging slot
    c.release(1)
    assert c.stats() == {"lookups": 2, "hits": 0, "misses": 2, "evictions": 0, "staged": 0}
    with pytest.raises(ValueError, match="outside the table"):
        c.plan(3, np.array([100], dtype=np.int64))
    with pytest.raises(ValueError, match="not in flight"):
        c.release(3)
    with pytest.raises(ValueError, match="below 2\\^40 rows"):
        _native.EngramSlotCache(8, 8, 1 << 41)


def test_a_failed_plan_leaves_nothing_pinned():
    """A step whose rows fall outside the table is a ValueError; the layers that planned it are released."""
    import dataclasses

    llm = LLM(None, max_num_seqs=4, engram_config={"cpu_offload": True, "hot_rows": 8})
    pager = llm.engine.executor.runner.engram
    good = tokens(llm, PROMPTS[:1], PARAMS[:1])
    lids = sorted(pager.layers)
    rows = {lids[0]: np.zeros((3, 12), dtype=np.int64), lids[1]: np.full((3, 12), 10**9, dtype=np.int64)}
    fake = dataclasses.replace(_one_step(llm), engram_rows=rows)
    with pytest.raises(ValueError, match="outside the table"):
        pager.prepare(fake)
    pager.release()
    assert all(p.cache.stats()["lookups"] >= 0 for p in pager.layers.values())
    assert tokens(llm, PROMPTS[:1], PARAMS[:1]) == good  # every slot still usable: 8 hot, nothing stuck


def _one_step(llm):
    from v41.engine.host_step import HostStep

    z = np.zeros(3, dtype=np.int64)
    return HostStep(token_ids=z, positions=z, num_scheduled=np.array([3]), start_pos=np.array([0]),
                    table_rows=np.array([0], dtype=np.int32), table_diffs={}, max_blocks={}, slot_mapping={},
                    state_rows=np.array([-1], dtype=np.int32), logits_rows=np.array([2]))


def test_default_cache_is_sized_by_the_tiny_table_and_hits(resident):
    """The default budget (1 GiB of slots) exceeds the tiny tables: the cache takes their size, rounded down to
    whole sets of 8 ways."""
    llm = LLM(None, max_num_seqs=4, engram_config={"cpu_offload": True})
    assert tokens(llm) == resident
    s = llm.engine.stats()["engram"]
    assert s["hot_rows"] == {1: 656, 4: 864} and s["hits"] > 0


@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_offload_through_chunked_prefill(resident, chunk):
    llm = LLM(None, max_num_seqs=4, engram_config=OFFLOAD, max_num_batched_tokens=max(chunk, 4) * 4,
              long_prefill_token_threshold=chunk)
    assert tokens(llm) == resident
    assert_engram_counts(llm)


def test_a_long_step_plans_its_layers_on_threads():
    """A 300-token prefill step plans both Engram layers at once (PARALLEL_PLAN_TOKENS)."""
    from v41.engine.engram_pager import PARALLEL_PLAN_TOKENS

    prompt = [[0] + [(7 * i) % 1000 + 3 for i in range(299)]]
    greedy = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)]
    assert len(prompt[0]) >= PARALLEL_PLAN_TOKENS
    llm = LLM(None, engram_config=OFFLOAD)
    assert llm.engine.executor.runner.engram._pool is not None
    assert tokens(llm, prompt, greedy) == tokens(LLM(None), prompt, greedy)


@pytest.mark.slow  # ~120 s on 2 cores; the tiny-cache and chunked tests stay in CI
def test_offload_with_prefix_hits_and_preemption():
    base = [0] + list(range(200, 260))
    prompts = [base + [7, 8], base + [9], base + [10, 11, 12]]
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)] * 3
    want = tokens(LLM(None, max_num_seqs=3, enable_prefix_caching=False), prompts, params)
    hits = LLM(None, max_num_seqs=3, block_size=16, engram_config=OFFLOAD)
    assert tokens(hits, prompts[:1], params[:1]) + tokens(hits, prompts[1:], params[1:]) == want
    assert hits.engine.stats()["prefix_hit_rate"] > 0
    tight = LLM(None, max_num_seqs=3, block_size=16, num_kv_blocks=7, engram_config=OFFLOAD)
    assert tokens(tight, prompts, params) == want
    assert tight.engine.stats()["num_preemptions"] > 0


def test_offload_with_speculation(resident):
    llm = LLM(None, max_num_seqs=4, engram_config=OFFLOAD,
              speculative_config={"method": "dspark", "num_speculative_tokens": 3})
    assert tokens(llm)[0::2] == resident[0::2]  # greedy requests: speculation is exact
    assert_engram_counts(llm)


def test_offload_over_tp2(resident):
    with LLM(None, max_num_seqs=4, engram_config=OFFLOAD, tensor_parallel_size=2,
             all_reduce_backend="host") as llm:
        assert not any(os.path.exists(p) for p in shm_paths(llm) if p is not None)
        assert tokens(llm) == resident
        assert_engram_counts(llm)


@pytest.mark.parametrize("bad, match", [
    ({"cpu_offload": True, "hot": 3}, "unknown key 'hot'"),
    ({"cpu_offload": "yes"}, "cpu_offload must be true or false"),
    ({"cpu_offload": True, "hot_rows": -1}, "hot_rows must be an integer >= 0"),
    ({"cpu_offload": True, "hot_rows": 2.5}, "hot_rows must be an integer"),
    ({"cpu_offload": True, "transfer": "dma"}, "transfer must be one of 'uva', 'copy'"),
    ("[1]", "must be a JSON object"),
    ("{", "not valid JSON"),
])
def test_bad_engram_config_is_a_value_error(bad, match):
    with pytest.raises(ValueError, match=match):
        EngramConfig.parse(bad)


def test_offload_on_the_paged_bridge_is_refused():
    with pytest.raises(ValueError, match="Engram offload runs on the fast model"):
        LLM(None, model_impl="paged", engram_config={"cpu_offload": True})


def test_a_table_that_disagrees_with_the_config_is_a_start_up_error(monkeypatch):
    """Other primes (engram_vocab_size) make other table sizes: the stored table no longer fits (and nothing is left
    in /dev/shm)."""
    import uuid

    session = uuid.uuid4()
    monkeypatch.setattr(uuid, "uuid4", lambda: session)
    with pytest.raises(ValueError, match="engram.embed.weight"):
        LLM(None, engram_config=OFFLOAD, hf_overrides={"engram_vocab_size": 103, "engram_num_embeddings": [690, 896]})
    assert not glob.glob(f"/dev/shm/v41-engram-{session.hex[:12]}-*")


def test_prometheus_engram_metrics_follow_the_engine_counts():
    from v41.serve.metrics import ServerMetrics

    llm = LLM(None, max_num_seqs=4, engram_config=OFFLOAD)
    metrics = ServerMetrics()
    tokens(llm, PROMPTS[:1], PARAMS[:1])
    older = llm.engine.stats()
    tokens(llm, PROMPTS[1:2], PARAMS[1:2])
    newer = llm.engine.stats()
    for snapshot in (older, newer, older):  # a stale snapshot after a fresh one adds nothing
        metrics.update_engine(snapshot, alive=True)
    text = metrics.render()[0].decode()
    for k in ("lookups", "hits", "evictions"):
        assert re.search(rf"^v41_engram_{k}_total {newer['engram'][k]}\.0$", text, re.M), (k, newer["engram"])
    assert re.search(r"^v41_engram_copy_seconds [0-9.e-]+$", text, re.M)
    assert newer["engram"]["lookups"] > older["engram"]["lookups"]


def test_dummy_tables_are_the_same_in_any_row_range():
    """load_format="dummy" draws Engram tables in fixed row blocks: a TP shard or an offload chunk is a slice of the
    whole table, and offload then gives the resident tokens."""
    from v41.checkpoint_packed import TABLE_BLOCK_ROWS, DummyReader
    from v41.config import load_config
    from v41.distributed.group import Shard
    from v41.testing.embedded import embedded_model_dir

    cfg = load_config(embedded_model_dir())
    reader = DummyReader(cfg, "cpu", seed=5)
    name, full = "layers.1.engram.embed.weight", (3 * TABLE_BLOCK_ROWS // 2, 32)
    whole = reader.packed(name, full, None, torch.float32)
    part = reader.packed(name, (1000, 32), Shard(0, TABLE_BLOCK_ROWS - 10, TABLE_BLOCK_ROWS + 990, full[0]),
                         torch.float32)
    assert torch.equal(part.data.view(torch.uint8), whole.data[TABLE_BLOCK_ROWS - 10:TABLE_BLOCK_ROWS + 990]
                       .view(torch.uint8))
    assert torch.equal(part.scale, whole.scale[TABLE_BLOCK_ROWS - 10:TABLE_BLOCK_ROWS + 990])
    dummy = tokens(LLM(None, max_num_seqs=4, load_format="dummy"), PROMPTS[:2], PARAMS[:2])
    assert tokens(LLM(None, max_num_seqs=4, load_format="dummy", engram_config=OFFLOAD), PROMPTS[:2],
                  PARAMS[:2]) == dummy
    dense = reader.packed(name, (1000, 32), Shard(0, 0, 1000, full[0]), torch.float32, keep_packed=False)
    assert dense.fmt == "dense" and torch.equal(dense.data, whole.dequantize(torch.float32)[:1000])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("transfer", ["uva", "copy"])
def test_offload_on_the_gpu_with_cuda_graphs_gives_the_resident_tokens(transfer):
    import gc

    gc.collect()
    torch.cuda.empty_cache()  # engines of earlier tests
    want = tokens(LLM(None, max_num_seqs=4, device="cuda", gpu_memory_utilization=0.3))
    gc.collect()
    torch.cuda.empty_cache()  # the first engine's cache must not count as in use for the second
    llm = LLM(None, max_num_seqs=4, device="cuda", gpu_memory_utilization=0.3,
              engram_config={**OFFLOAD, "transfer": transfer})
    assert llm.engine.executor.runner.graphs is not None
    assert tokens(llm) == want
    s = llm.engine.stats()["engram"]
    assert s["transfer"] == transfer and s["evictions"] > 0
    pager = llm.engine.executor.runner.engram
    assert all(p.records.is_pinned() == (transfer == "uva") for p in pager.layers.values())  # uva reads over the bus


def test_in_forward_fill_path_on_the_cpu(resident):
    """transfer "uva" on a CPU device: the copy lists travel in the step's inputs and the forward fills the slots
    (the PyTorch gather standing in for the UVA kernel), through chunks and batches."""
    llm = LLM(None, max_num_seqs=4, max_num_batched_tokens=16, long_prefill_token_threshold=5,
              engram_config={**OFFLOAD, "transfer": "uva"})
    assert tokens(llm) == resident
    s = llm.engine.stats()["engram"]
    assert s["transfer"] == "uva" and s["evictions"] > 0 and s["hits"] + s["misses"] == s["lookups"]
