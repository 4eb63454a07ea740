"""Sibling projections stacked into one GEMM (python/v41/models/fast/fused.py): the fast model's logits with the
stacked weights equal those of the separate projections, the members become views of the stacked weight, and
groups that cannot stay packed are left alone."""

from __future__ import annotations

import pytest
import torch

from test_fast_model import rel_l2, run
from kernel_checks import packed
from v41.kernels.packed import from_dense
from v41.models.fast import load_fast
from v41.models.fast.fused import SiblingLinears
from v41.models.fast.layers import PackedLinear
from v41.models.fast.model import FastModel
from v41.testing.tiny import make_tiny


def groups(model):
    return [g for m in model.modules() for g in getattr(m, "siblings", {}).values()]


@pytest.mark.parametrize("arch", ["deepseek_v41", "deepseek_v4"])
def test_stacked_projections_give_the_separate_projections_logits(tmp_path, arch, monkeypatch):
    path = make_tiny(tmp_path / arch, arch)
    ids = torch.randint(3, 1000, (37,), generator=torch.Generator().manual_seed(6)).tolist()
    fused = load_fast(path, torch.float32, "cpu")
    stacked = [g for g in groups(fused) if g.stacked is not None]
    assert stacked, "no group was stacked"
    for g in stacked:  # every member reads its rows of the stacked weight: no copy
        base = g.stacked.weight.untyped_storage().data_ptr()
        assert all(m.weight.untyped_storage().data_ptr() == base for m in g.members)
    monkeypatch.setattr(FastModel, "fuse_siblings", lambda self: 0)
    separate = load_fast(path, torch.float32, "cpu")
    assert all(g.stacked is None for g in groups(separate))
    assert rel_l2(run(fused, path, ids, chunk=9), run(separate, path, ids, chunk=9)) <= 1e-6


def _linear(w, fp8_input=False):
    m = PackedLinear(w.in_features, w.out_features, fp8_input=fp8_input)
    m.set(w)
    return m


def test_sibling_linears_stack_packed_weights_and_decline_what_would_not_stay_packed():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=g)
    fp8 = [packed(torch.randn(n, 64, generator=g) / 8, "fp8", (32, 32)) for n in (64, 32, 40)]
    want = [_linear(w)(x) for w in fp8]
    group = SiblingLinears([_linear(w) for w in fp8])  # the last member may end inside a scale tile
    assert group.fuse() and group.stacked.fmt == "fp8" and group.stacked.shape == (136, 64)
    for got, ref in zip(group(x), want):
        assert got.shape == ref.shape and torch.allclose(got, ref, rtol=1e-6, atol=1e-6)
    assert not SiblingLinears([_linear(fp8[2]), _linear(fp8[0])]).fuse()  # 40 rows then another: not packed
    assert not SiblingLinears([_linear(fp8[0]), _linear(fp8[1], fp8_input=True)]).fuse()
    other_k = packed(torch.randn(32, 96, generator=g), "fp8", (32, 32))
    assert not SiblingLinears([_linear(fp8[0]), _linear(other_k)]).fuse()
    dense = from_dense(torch.randn(32, 64, generator=g))
    assert not SiblingLinears([_linear(fp8[0]), _linear(dense)]).fuse()  # formats differ
    left = SiblingLinears([_linear(fp8[0]), _linear(dense)])
    assert [t.shape for t in left(x)] == [(5, 64), (5, 32)]  # unstacked: one call per member
