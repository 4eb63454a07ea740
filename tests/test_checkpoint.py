"""Tests for v41.checkpoint / v41.checkpoint_names and the tiny checkpoint generator (docs/model.md §2
"Weight storage dtypes", §5 checkpoint tensors; docs/architecture.md §1 tiny checkpoints).

Broken checkpoints are made by rewriting one shard of a fresh tiny checkpoint with safetensors.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from v41 import quant
from v41.checkpoint import CheckpointError, iter_raw
from v41.checkpoint_names import bare_to_hf, hf_to_bare, storage_format
from v41.models.reference import load
from v41.testing.tiny import make_tiny

V41, V4 = "deepseek_v41", "deepseek_v4"
INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny(root / arch, arch) for arch in (V41, V4)}


@pytest.fixture
def copy_of(ckpts, tmp_path):
    def _copy(arch: str) -> Path:
        return Path(shutil.copytree(ckpts[arch], tmp_path / arch))
    return _copy


def _index(path: Path) -> dict:
    return json.loads((path / INDEX).read_text())


def _shard_of(path: Path, name: str) -> Path:
    return path / _index(path)["weight_map"][name]


def _rewrite_shard(path: Path, shard: Path, edit) -> None:
    """Load ``shard``, let ``edit(tensors)`` change the dict in place, save it back, update the index."""
    tensors = load_file(str(shard))
    before = set(tensors)
    edit(tensors)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index = _index(path)
    for name in before - set(tensors):
        del index["weight_map"][name]
    for name in set(tensors) - before:
        index["weight_map"][name] = shard.name
    (path / INDEX).write_text(json.dumps(index))


def _disk_dtypes(path: Path) -> dict[str, str]:
    out = {}
    for fname in sorted(set(_index(path)["weight_map"].values())):
        with safe_open(str(path / fname), framework="pt") as f:
            for name in f.keys():
                out[name] = f.get_slice(name).get_dtype()
    return out


def _disk_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    out = {}
    for fname in sorted(set(_index(path)["weight_map"].values())):
        with safe_open(str(path / fname), framework="pt") as f:
            for name in f.keys():
                out[name] = tuple(f.get_slice(name).get_shape())
    return out


# --------------------------------------------------------------------------------------------------
# tiny checkpoints load
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("numerics", ["exact", "deployed"])
@pytest.mark.parametrize("arch", [V41, V4])
def test_tiny_checkpoint_loads_and_runs(ckpts, arch, numerics):
    model = load(ckpts[arch], numerics=numerics)
    assert model.numerics == numerics
    logits = model(torch.arange(3, 19).view(1, -1))
    assert logits.shape == (1, 16, model.cfg.vocab_size)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("arch", [V41, V4])
def test_tiny_checkpoint_has_two_shards_and_consistent_index(ckpts, arch):
    path = ckpts[arch]
    weight_map = _index(path)["weight_map"]
    shards = sorted(set(weight_map.values()))
    assert len(shards) >= 2
    assert sorted(p.name for p in path.glob("*.safetensors")) == shards
    on_disk = {}
    for fname in shards:
        with safe_open(str(path / fname), framework="pt") as f:
            on_disk.update({n: fname for n in f.keys()})
    assert on_disk == weight_map  # every tensor listed once, in the shard that holds it


@pytest.mark.parametrize("arch", [V41, V4])
def test_same_seed_gives_identical_bytes(tmp_path, arch):
    a = make_tiny(tmp_path / "a", arch, seed=7)
    b = make_tiny(tmp_path / "b", arch, seed=7)
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir())
    for name in files:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


@pytest.mark.parametrize("arch", [V41, V4])
def test_different_seed_gives_different_weights(tmp_path, arch):
    a = make_tiny(tmp_path / "a", arch, seed=0)
    b = make_tiny(tmp_path / "b", arch, seed=1)
    assert (a / "config.json").read_text() == (b / "config.json").read_text()
    ta, tb = dict(iter_raw(a)), dict(iter_raw(b))
    assert ta.keys() == tb.keys()
    # scales are powers of two from each tile's amax and may coincide; every weight differs
    weights = [n for n in ta if not n.endswith(".scale")]
    same = [n for n in weights if torch.equal(ta[n].view(torch.uint8), tb[n].view(torch.uint8))]
    assert same == []


# --------------------------------------------------------------------------------------------------
# broken checkpoints -> CheckpointError naming the tensor / file
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("victim", ["layers.3.attn_norm.weight", "layers.0.attn.wq_a.weight",
                                    "layers.2.ffn.experts.1.w2.weight"])
def test_deleted_tensor_is_listed_as_missing(copy_of, victim):
    path = copy_of(V41)
    _rewrite_shard(path, _shard_of(path, victim), lambda t: t.pop(victim))
    with pytest.raises(CheckpointError, match="missing") as e:
        load(path)
    assert victim in str(e.value)


def test_tensor_in_index_but_not_in_shard_names_tensor_and_shard(copy_of):
    path = copy_of(V41)
    victim = "layers.3.attn_norm.weight"
    shard = _shard_of(path, victim)
    tensors = load_file(str(shard))
    del tensors[victim]
    save_file(tensors, str(shard), metadata={"format": "pt"})  # index still lists it
    with pytest.raises(CheckpointError) as e:
        load(path)
    assert victim in str(e.value) and shard.name in str(e.value)


def test_extra_tensor_is_listed_as_unexpected(copy_of):
    path = copy_of(V41)
    shard = _shard_of(path, "norm.weight")
    _rewrite_shard(path, shard, lambda t: t.update({"layers.0.attn.bogus.weight": torch.zeros(4)}))
    with pytest.raises(CheckpointError, match="unexpected") as e:
        load(path)
    assert "layers.0.attn.bogus.weight" in str(e.value)


@pytest.mark.parametrize("victim,bad_shape", [("layers.0.attn_norm.weight", (65,)),
                                              ("layers.1.hc_attn_base", (25,))])
def test_wrong_shape_names_tensor_and_both_shapes(copy_of, victim, bad_shape):
    path = copy_of(V41)
    good_shape = _disk_shapes(path)[victim]

    def edit(t):
        t[victim] = torch.zeros(bad_shape, dtype=t[victim].dtype)

    _rewrite_shard(path, _shard_of(path, victim), edit)
    with pytest.raises(CheckpointError) as e:
        load(path)
    msg = str(e.value)
    assert victim in msg and str(tuple(bad_shape)) in msg and str(good_shape) in msg


def test_fp8_weight_stored_as_int8_is_a_dtype_error(copy_of):
    path = copy_of(V41)
    victim = "layers.0.attn.wq_a.weight"

    def edit(t):
        assert t[victim].dtype == torch.float8_e4m3fn
        t[victim] = t[victim].view(torch.int8).clone()

    _rewrite_shard(path, _shard_of(path, victim), edit)
    with pytest.raises(CheckpointError) as e:
        load(path)
    msg = str(e.value)
    assert victim in msg and "I8" in msg and "fp8" in msg


@pytest.mark.parametrize("keep", [0.5, 0.999])
def test_truncated_shard_names_the_file(copy_of, keep):
    path = copy_of(V41)
    shard = path / sorted(set(_index(path)["weight_map"].values()))[-1]
    data = shard.read_bytes()
    shard.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(CheckpointError) as e:
        load(path)
    assert shard.name in str(e.value)


def test_truncated_header_names_the_file(copy_of):
    path = copy_of(V4)
    shard = path / sorted(set(_index(path)["weight_map"].values()))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=shard.name):
        load(path)


def test_v4_mtp_tensors_on_disk_are_ignored(copy_of):
    path = copy_of(V4)
    mtp = [n for n in _index(path)["weight_map"] if n.startswith("mtp.")]
    assert "mtp.0.e_proj.weight" in mtp and "mtp.0.hc_head_fn" in mtp
    model = load(path)
    assert not any(k.startswith("mtp") for k in model.state_dict())
    # ignored, not matched: even a malformed MTP tensor does not matter
    victim = "mtp.0.attn_norm.weight"
    _rewrite_shard(path, _shard_of(path, victim), lambda t: t.update({victim: torch.zeros(3)}))
    load(path)


def test_v41_dspark_tensors_are_loaded(ckpts):
    model = load(ckpts[V41])
    keys = model.state_dict().keys()
    assert "mtp.0.main_proj.weight" in keys and "mtp.2.markov_head.embed.weight" in keys


# --------------------------------------------------------------------------------------------------
# transformers-style names (§5.2)
# --------------------------------------------------------------------------------------------------


def _write_hf_style(src: Path, dst: Path, keep_fp8: bool) -> None:
    """Re-save a bare V4 checkpoint with transformers names: bare_to_hf for unfused tensors, fused experts
    ``mlp.experts.gate_up_proj [E, 2I, D]`` = cat(w1, w3) and ``down_proj [E, D, I]`` (dequantized, BF16 is
    exact for MXFP4 values), FP8 ``.scale`` -> ``.weight_scale_inv`` (or dequantized floats)."""
    dst.mkdir()
    for f in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(src / f, dst / f)
    raw = dict(iter_raw(src))
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, int, str], torch.Tensor] = {}
    for name, t in raw.items():
        parts = name.split(".")
        if name.startswith("mtp."):
            out[name] = t
        elif ".ffn.experts." in name:
            if name.endswith(".weight"):
                w = quant.dequant_mxfp4(t, raw[name[: -len(".weight")] + ".scale"])
                experts[(int(parts[1]), int(parts[4]), parts[5])] = w
        elif name.endswith(".scale"):
            if keep_fp8:
                hf = bare_to_hf(name)
                out[hf[: -len(".scale")] + ".weight_scale_inv"] = t
        elif t.dtype == torch.float8_e4m3fn and not keep_fp8:
            out[bare_to_hf(name)] = quant.dequant_fp8_block(t, raw[name[: -len(".weight")] + ".scale"],
                                                            (128, 128))
        else:
            out[bare_to_hf(name)] = t
    layers = sorted({k[0] for k in experts})
    for layer in layers:
        n_exp = 1 + max(k[1] for k in experts if k[0] == layer)
        gate_up = torch.stack([torch.cat([experts[(layer, e, "w1")], experts[(layer, e, "w3")]]) for e in range(n_exp)])
        down = torch.stack([experts[(layer, e, "w2")] for e in range(n_exp)])
        out[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = gate_up.to(torch.bfloat16)
        out[f"model.layers.{layer}.mlp.experts.down_proj"] = down.to(torch.bfloat16)
    names = sorted(out)
    half = len(names) // 2
    weight_map = {}
    for i, chunk in enumerate((names[:half], names[half:])):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: out[n].contiguous() for n in chunk}, str(dst / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in chunk})
    (dst / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("keep_fp8", [True, False], ids=["fp8_weight_scale_inv", "dequantized"])
def test_v4_transformers_names_load_to_same_weights(ckpts, tmp_path, keep_fp8):
    hf_path = tmp_path / "hf"
    _write_hf_style(ckpts[V4], hf_path, keep_fp8)
    names = json.loads((hf_path / INDEX).read_text())["weight_map"]
    assert "model.layers.0.self_attn.q_a_proj.weight" in names and "lm_head.weight" in names
    assert "model.layers.3.mlp.experts.gate_up_proj" in names
    assert ("model.layers.0.self_attn.q_a_proj.weight_scale_inv" in names) == keep_fp8
    bare = load(ckpts[V4]).state_dict()
    hf = load(hf_path).state_dict()
    assert bare.keys() == hf.keys()
    differing = [k for k in bare if not torch.equal(bare[k], hf[k])]
    assert differing == []


def test_bare_to_hf_round_trips_every_unfused_v4_name(ckpts):
    names = [n for n in _index(ckpts[V4])["weight_map"] if not n.startswith("mtp.") and ".experts." not in n]
    for name in names:
        hf = bare_to_hf(name)
        assert hf != name, name
        assert hf_to_bare(hf) == name, (name, hf)


# --------------------------------------------------------------------------------------------------
# storage formats (§2, §5.1)
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,fmt", [
    ("layers.3.attn.wq_a.weight", "fp8"),
    ("layers.3.attn.wq_b.weight", "fp8"),
    ("layers.3.attn.wkv.weight", "fp8"),
    ("layers.3.attn.wo_a.weight", "fp8"),
    ("layers.3.attn.wo_b.weight", "fp8"),
    ("layers.24.attn.indexer.wq_b.weight", "fp8"),
    ("layers.3.ffn.shared_experts.w1.weight", "fp8"),
    ("layers.3.ffn.shared_experts.w2.weight", "fp8"),
    ("layers.14.engram.wkv.weight", "fp8"),
    ("layers.1.engram.embed.weight", "fp8"),
    ("mtp.0.main_proj.weight", "fp8"),
    ("layers.3.ffn.experts.0.w1.weight", "mxfp4"),
    ("layers.3.ffn.experts.383.w2.weight", "mxfp4"),
    ("layers.3.ffn.experts.17.w3.weight", "mxfp4"),
    ("mtp.1.ffn.experts.127.w1.weight", "mxfp4"),
    ("layers.3.hc_attn_fn", "f32"),
    ("layers.3.hc_attn_base", "f32"),
    ("layers.3.hc_ffn_scale", "f32"),
    ("layers.3.attn.attn_sink", "f32"),
    ("layers.3.ffn.gate.bias", "f32"),
    ("layers.3.ffn.gate.bias_vl", "f32"),
    ("hc_head_fn", "f32"),
    ("layers.2.attn.compressor.ape", "f32"),
    ("norm.weight", "bf16"),
    ("layers.3.attn_norm.weight", "bf16"),
    ("layers.3.attn.q_norm.weight", "bf16"),
    ("embed.weight", "bf16"),
    ("head.weight", "bf16"),
    ("layers.3.ffn.gate.weight", "bf16"),
    ("layers.2.attn.compressor.wkv.weight", "bf16"),
    ("layers.2.attn.indexer.wk.weight", "bf16"),
    ("layers.24.attn.indexer.weights_proj.weight", "bf16"),
    ("layers.1.engram.q_weight", "bf16"),
    ("mtp.2.markov_head.embed.weight", "bf16"),
    ("mtp.2.confidence_head.proj.weight", "bf16"),
    ("layers.0.ffn.gate.tid2eid", "i64"),
])
def test_storage_format_classifies_section_5_names(name, fmt):
    assert storage_format(name) == fmt


_EXPECTED_DISK_DTYPES = {"fp8": "F8_E4M3", "mxfp4": "I8", "bf16": "BF16", "f32": "F32", "i64": "I64"}


@pytest.mark.parametrize("arch", [V41, V4])
def test_disk_dtypes_follow_storage_format(ckpts, arch):
    dtypes = _disk_dtypes(ckpts[arch])
    for name, dt in dtypes.items():
        if name.endswith(".scale"):
            assert dt == "F8_E8M0", name
            assert name[: -len(".scale")] + ".weight" in dtypes, name
        else:
            assert dt == _EXPECTED_DISK_DTYPES[storage_format(name)], name
            if dt in ("F8_E4M3", "I8"):
                assert name[: -len(".weight")] + ".scale" in dtypes, name


def test_tiny_v41_disk_dtypes_by_role(ckpts):
    d = _disk_dtypes(ckpts[V41])
    for lin in ("attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_a", "attn.wo_b", "ffn.shared_experts.w1",
                "ffn.shared_experts.w2", "ffn.shared_experts.w3"):
        assert (d[f"layers.5.{lin}.weight"], d[f"layers.5.{lin}.scale"]) == ("F8_E4M3", "F8_E8M0"), lin
    assert (d["layers.6.attn.indexer.wq_b.weight"], d["layers.1.engram.wkv.weight"]) == ("F8_E4M3", "F8_E4M3")
    assert (d["layers.1.engram.embed.weight"], d["layers.1.engram.embed.scale"]) == ("F8_E4M3", "F8_E8M0")
    for w in ("w1", "w2", "w3"):
        assert (d[f"layers.5.ffn.experts.3.{w}.weight"], d[f"layers.5.ffn.experts.3.{w}.scale"]) == ("I8", "F8_E8M0")
    for bf16 in ("embed.weight", "head.weight", "norm.weight", "layers.5.attn_norm.weight",
                 "layers.5.ffn_norm.weight", "layers.5.attn.q_norm.weight", "layers.5.attn.kv_norm.weight",
                 "layers.5.ffn.gate.weight"):
        assert d[bf16] == "BF16", bf16
    for f32 in ("hc_attn_fn", "hc_attn_base", "hc_attn_scale", "hc_ffn_fn", "hc_ffn_base", "hc_ffn_scale",
                "attn.attn_sink", "ffn.gate.bias", "ffn.gate.bias_vl"):
        assert d[f"layers.5.{f32}"] == "F32", f32
    assert not any(n.startswith("hc_head") or n.endswith(("tid2eid", ".ape")) for n in d)  # none in V4.1
    assert set(d.values()) == {"F8_E4M3", "F8_E8M0", "I8", "BF16", "F32"}


@pytest.mark.parametrize("arch,block", [(V41, 32), (V4, 128)])
def test_fp8_scale_grids(ckpts, arch, block):
    shapes, dtypes = _disk_shapes(ckpts[arch]), _disk_dtypes(ckpts[arch])
    n_checked = 0
    for name, dt in dtypes.items():
        if dt != "F8_E4M3":
            continue
        out, inn = shapes[name]
        scale = shapes[name[: -len(".weight")] + ".scale"]
        if name.endswith("engram.embed.weight"):  # one scale per 32 along a row
            assert scale == (out, math.ceil(inn / 32)), name
        else:
            assert scale == (math.ceil(out / block), math.ceil(inn / block)), name
            n_checked += 1
    assert n_checked > 10
    for name, dt in dtypes.items():  # MXFP4: [out, in/2] bytes, one scale per 32 inputs
        if dt == "I8":
            out, half = shapes[name]
            assert shapes[name[: -len(".weight")] + ".scale"] == (out, 2 * half // 32), name


# --------------------------------------------------------------------------------------------------
# stored dtypes vs storage_format, scales, unindexed tensors, malformed index, tokenizer (§2, §5)
# --------------------------------------------------------------------------------------------------


def _replace(path: Path, victim: str, make) -> None:
    """Rewrite ``victim`` in its shard as ``make(old tensor, all tensors of the shard)``."""
    def edit(t):
        t[victim] = make(t[victim], t).contiguous()
    _rewrite_shard(path, _shard_of(path, victim), edit)


@pytest.mark.parametrize("victim,bad,fmt", [
    ("layers.3.attn_norm.weight", torch.float16, "bf16"),  # F16 anywhere is wrong
    ("embed.weight", torch.float64, "bf16"),
    ("layers.3.hc_attn_fn", torch.bfloat16, "f32"),  # f32 tensors must stay F32
    ("layers.3.attn.attn_sink", torch.float16, "f32"),
    ("layers.3.ffn.gate.bias", torch.bfloat16, "f32"),
])
def test_float_tensor_in_wrong_dtype_names_tensor_dtype_and_format(copy_of, victim, bad, fmt):
    path = copy_of(V41)
    _replace(path, victim, lambda t, _: t.to(bad))
    with pytest.raises(CheckpointError) as e:
        load(path)
    msg = str(e.value)
    assert victim in msg and {torch.float16: "F16", torch.float64: "F64", torch.bfloat16: "BF16"}[bad] in msg
    assert fmt in msg


@pytest.mark.parametrize("with_scale", [False, True])
def test_fp8_where_bf16_expected_is_a_dtype_error(copy_of, with_scale):
    path = copy_of(V41)
    victim = "layers.3.attn_norm.weight"

    def edit(t):
        t[victim] = t[victim].to(torch.float8_e4m3fn)
        if with_scale:
            t["layers.3.attn_norm.scale"] = torch.full((1, 1), 127, dtype=torch.uint8)

    _rewrite_shard(path, _shard_of(path, victim), edit)
    with pytest.raises(CheckpointError) as e:
        load(path)
    msg = str(e.value)
    assert victim in msg and "F8_E4M3" in msg and "bf16" in msg


def test_tid2eid_stored_as_float_is_a_dtype_error(copy_of):
    path = copy_of(V4)
    victim = "layers.0.ffn.gate.tid2eid"
    _replace(path, victim, lambda t, _: t.to(torch.float32))
    with pytest.raises(CheckpointError) as e:
        load(path)
    assert victim in str(e.value) and "F32" in str(e.value) and "i64" in str(e.value)


def test_dequantized_exports_load_to_the_same_weights(ckpts, copy_of):
    """bf16-format tensors stored F32, fp8 and mxfp4 weights stored dequantized (BF16/F32, no scale)."""
    path = copy_of(V41)
    raw = dict(iter_raw(path))
    fp8, mx, bf16 = "layers.5.attn.wq_a.weight", "layers.5.ffn.experts.3.w2.weight", "layers.5.attn_norm.weight"
    fp8_s, mx_s = "layers.5.attn.wq_a.scale", "layers.5.ffn.experts.3.w2.scale"
    new = {fp8: quant.dequant_fp8_block(raw[fp8], raw[fp8_s], (32, 32)).to(torch.bfloat16),
           mx: quant.dequant_mxfp4(raw[mx], raw[mx_s]).float(), bf16: raw[bf16].float()}

    def edit(t):
        for k in list(t):
            if k in (fp8_s, mx_s):
                del t[k]
            elif k in new:
                t[k] = new[k].contiguous()

    for shard in sorted(set(_index(path)["weight_map"].values())):
        _rewrite_shard(path, path / shard, edit)
    assert set(_disk_dtypes(path)[k] for k in new) == {"BF16", "F32"}
    want, got = load(ckpts[V41]).state_dict(), load(path).state_dict()
    assert [k for k in want if not torch.equal(want[k], got[k])] == []


def test_scale_in_wrong_dtype_names_the_scale(copy_of):
    path = copy_of(V41)
    victim = "layers.0.attn.wq_a.scale"
    _replace(path, victim, lambda t, _: quant.e8m0_to_float(t))
    with pytest.raises(CheckpointError, match="F8_E8M0") as e:
        load(path)
    assert victim in str(e.value) and "F32" in str(e.value)


def test_scale_beside_an_unquantized_weight_is_unexpected(copy_of):
    path = copy_of(V41)
    weight, scale = "layers.0.attn.wq_a.weight", "layers.0.attn.wq_a.scale"
    raw = dict(iter_raw(path))
    dense = quant.dequant_fp8_block(raw[weight], raw[scale], (32, 32)).to(torch.bfloat16)
    _replace(path, weight, lambda t, _: dense)  # the scale stays (possibly in the other shard)
    with pytest.raises(CheckpointError, match="unexpected") as e:
        load(path)
    assert scale in str(e.value)


def test_tensor_in_shard_but_not_in_index_is_unexpected(copy_of):
    path = copy_of(V41)
    shard = _shard_of(path, "norm.weight")
    tensors = load_file(str(shard))
    tensors["layers.0.attn.stray.weight"] = torch.zeros(4)
    save_file(tensors, str(shard), metadata={"format": "pt"})  # index not updated
    with pytest.raises(CheckpointError, match="unexpected") as e:
        load(path)
    msg = str(e.value)
    assert "layers.0.attn.stray.weight" in msg and "unindexed" in msg and shard.name in msg


@pytest.mark.parametrize("victim,shape", [("layers.0.attn.wq_a.scale", (1, 1)),
                                          ("layers.5.ffn.experts.3.w1.scale", (3, 3))])
def test_scale_of_wrong_shape_names_the_weight(copy_of, victim, shape):
    path = copy_of(V41)
    _replace(path, victim, lambda t, _: t[: shape[0], : shape[1]])
    with pytest.raises(CheckpointError) as e:
        load(path)
    assert victim.removesuffix(".scale") + ".weight" in str(e.value)


@pytest.mark.parametrize("content", ['{"metadata": {}}', '{"weight_map": [1]}', '{"weight_map": {',
                                     '[]', '{"weight_map": {"norm.weight": 3}}'])
def test_malformed_index_names_the_file(copy_of, content):
    path = copy_of(V41)
    (path / INDEX).write_text(content)
    with pytest.raises(CheckpointError, match=INDEX):
        load(path)


def test_shard_listed_in_index_but_absent_names_the_file(copy_of):
    path = copy_of(V41)
    shard = _shard_of(path, "norm.weight")
    shard.unlink()
    with pytest.raises(CheckpointError, match=shard.name):
        load(path)


def test_v41_engram_checkpoint_without_tokenizer_json_is_file_not_found(copy_of):
    path = copy_of(V41)
    (path / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError) as e:
        load(path)
    assert str(path / "tokenizer.json") in str(e.value)


def test_v41_malformed_tokenizer_json_is_a_value_error_naming_it(copy_of):
    path = copy_of(V41)
    (path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json"):
        load(path)


def test_v4_loads_without_tokenizer_json(copy_of):
    path = copy_of(V4)
    (path / "tokenizer.json").unlink()
    load(path)


def test_storage_format_follows_expert_dtype():
    name = "layers.3.ffn.experts.0.w1.weight"
    assert [storage_format(name, d) for d in ("fp4", "fp8", "bf16")] == ["mxfp4", "fp8", "bf16"]
