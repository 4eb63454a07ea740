"""Both step models reproduce the reference model over the paged caches (docs/numerics.md §4: paged vs dense, batched vs
alone, chunked vs whole), for V4.1 and V4, with a trivial block planner (no scheduler): the fast model
(``models/fast``, float32 on the CPU here: its PyTorch kernels) and the paged parity bridge (``models/paged``).
The bridge's full chunk matrix is ``slow`` (docs/numerics.md §4a); CI runs a subset."""

from __future__ import annotations

import pytest
import torch

from engine_helpers import StepDriver
from v41.models.engram_loader import engram_hasher
from v41.models.fast import load_fast
from v41.models.paged import PagedModel
from v41.models.reference import load
from v41.testing.tiny import make_tiny

TOL = 1e-4
CHUNKS = [1, 2, 3, 7, 64]
CI_PAGED_CHUNKS = [7]


def setup(arch: str, impl: str, tmp, block_tokens: int, index_scratch_bytes: int | None = None):
    """The reference and a driven step model; ``index_scratch_bytes`` (default: 4 KiB for the paged model, the fast
    model's own) sets the indexer's scratch cap."""
    path = make_tiny(tmp, arch)
    ref = load(path)
    model = PagedModel(ref, index_scratch_bytes or 4096) if impl == "paged" else load_fast(path, torch.float32, "cpu")
    if index_scratch_bytes is not None:
        model.index_scratch_bytes = index_scratch_bytes
    return ref, StepDriver(model, engram_hasher(ref.cfg, path / "tokenizer.json"), block_tokens)


def rel_l2(a, b):
    return ((a - b).norm(dim=-1) / b.norm(dim=-1)).max().item()


def _chunk_cases():
    for arch in ("deepseek_v41", "deepseek_v4"):
        for chunk in CHUNKS:
            yield pytest.param(arch, "fast", chunk, id=f"{arch}-fast-{chunk}")
            marks = () if chunk in CI_PAGED_CHUNKS else (pytest.mark.slow,)
            yield pytest.param(arch, "paged", chunk, marks=marks, id=f"{arch}-paged-{chunk}")


@pytest.mark.parametrize("arch,impl,chunk", list(_chunk_cases()))
def test_chunked_prefill_equals_reference_whole_sequence(tmp_path, arch, impl, chunk):
    ref, drv = setup(arch, impl, tmp_path / "m", block_tokens=8 if arch == "deepseek_v41" else 16)
    ids = torch.randint(3, 1000, (41,), generator=torch.Generator().manual_seed(2)).tolist()
    whole = ref(torch.tensor([ids]))[0]
    got = [drv.execute([(0, ids[a:a + chunk], a, ids[:a])]) for a in range(0, len(ids), chunk)]
    assert rel_l2(torch.cat(got), whole) <= TOL


@pytest.mark.parametrize("impl", ["fast", "paged"])
@pytest.mark.parametrize("arch", ["deepseek_v41", "deepseek_v4"])
def test_mixed_batch_of_prefills_and_decodes_equals_each_request_alone(tmp_path, arch, impl):
    ref, drv = setup(arch, impl, tmp_path / "m", block_tokens=16)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 1000, (n,), generator=gen).tolist() for n in (37, 5, 19, 40)]
    # step 1: first chunks of different sizes; step 2: the rest; then 3 decode steps of all four together
    cuts = [9, 5, 11, 24]
    expected = [ref(torch.tensor([p]))[0][-1] for p in prompts]
    out1 = drv.execute([(s, p[:c], 0, []) for s, (p, c) in enumerate(zip(prompts, cuts))], all_rows=False)
    rest = [s for s, (p, c) in enumerate(zip(prompts, cuts)) if c < len(p)]
    out2 = drv.execute([(s, prompts[s][cuts[s]:], cuts[s], prompts[s][:cuts[s]]) for s in rest], all_rows=False)
    finals = {s: out2[i] for i, s in enumerate(rest)}
    finals[1] = out1[1]
    for s, p in enumerate(prompts):
        assert rel_l2(finals[s][None], expected[s][None]) <= TOL
    seqs = [list(p) for p in prompts]
    for _ in range(3):
        nxt = [int(finals[s].argmax()) for s in range(4)]
        out = drv.execute([(s, [nxt[s]], len(seqs[s]), seqs[s]) for s in range(4)], all_rows=False)
        for s in range(4):
            seqs[s].append(nxt[s])
            want = ref(torch.tensor([seqs[s]]))[0][-1]
            assert rel_l2(out[s][None], want[None]) <= TOL
            finals[s] = out[s]


@pytest.mark.parametrize("impl", ["fast", "paged"])
def test_indexer_scratch_cap_does_not_change_results(tmp_path, impl):
    ref, small = setup("deepseek_v41", impl, tmp_path / "m", block_tokens=8, index_scratch_bytes=4096)
    _, big = setup("deepseek_v41", impl, tmp_path / "m", block_tokens=8, index_scratch_bytes=1 << 30)
    ids = torch.randint(3, 1000, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    assert rel_l2(big.execute([(1, ids, 0, [])]), small.execute([(2, ids, 0, [])])) <= 1e-6


@pytest.mark.parametrize("impl", ["fast", "paged"])
def test_step_model_exports_dspark_aux_states_equal_to_reference(tmp_path, impl):
    ref, drv = setup("deepseek_v41", impl, tmp_path / "m", block_tokens=8)
    ids = torch.randint(3, 1000, (20,), generator=torch.Generator().manual_seed(5)).tolist()
    _, aux = drv.execute([(0, ids, 0, [])], return_aux=True)
    _, ref_aux = ref.forward_chunk(torch.tensor(ids), ref.new_cache(), return_aux=True)
    assert rel_l2(aux, ref_aux) <= TOL
