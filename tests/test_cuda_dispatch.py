"""The kernel dispatch without the CUDA extension (CPU, CI): CUDA → Triton → PyTorch falls back cleanly when
``v41._cuda`` is absent, mode ``cuda`` says why it cannot run, ``v41 --version`` reports the path, and the launch
arithmetic of the weight-streaming kernel (``kernels/wstream.py``) holds. The kernels themselves are tested on a
GPU in ``tests/test_gpu_cuda.py``."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from v41.kernels import dispatch, indexer, linear, mhc, mhc_cuda, moe, moe_align, router, wstream
from v41.kernels.packed import PackedWeight, from_dense


@pytest.fixture
def no_extension(monkeypatch):
    monkeypatch.setattr(dispatch, "_CUDA_EXT", None)
    monkeypatch.setattr(dispatch, "_CUDA_WHY", ["not built (test)"])


def test_without_the_extension_cuda_is_never_chosen_and_mode_cuda_says_why(no_extension, monkeypatch):
    assert dispatch.cuda_ext() is None
    assert "cuda" not in dispatch.available_modes("cuda")
    assert "not built (test)" in dispatch.cuda_status()
    x = torch.zeros(2, 4)
    assert not dispatch.use_cuda(x)
    monkeypatch.setenv("V41_KERNELS", "cuda")
    assert not dispatch.use_cuda(x)  # CPU tensors never needed it

    class OnGpu:  # what the check reads of a CUDA tensor, without a GPU
        is_cuda = True
        device = torch.device("cuda", 0)

    with pytest.raises(ValueError, match="make cuda"):
        dispatch.use_cuda(OnGpu())


def test_cpu_tensors_never_take_the_cuda_path():
    assert not dispatch.use_cuda(torch.zeros(1))
    assert "cuda" not in dispatch.available_modes("cpu")
    assert not dispatch.cuda_runs_on(torch.device("cpu"))


def test_mode_triton_runs_cpu_tensors_only_under_the_interpreter(monkeypatch):
    """Without ``TRITON_INTERPRET=1`` a CPU tensor (a reference computed on the CPU beside a GPU kernel) runs the
    reference in mode ``triton``; under the interpreter it runs the Triton kernel."""
    monkeypatch.setenv("V41_KERNELS", "triton")
    x = torch.zeros(2, 4)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not dispatch.use_triton(x)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert dispatch.use_triton(x) == (dispatch.triton is not None)


@pytest.mark.parametrize("mode", ["auto", "cuda", "torch"])
def test_linear_and_grouped_fall_back_to_the_reference_on_the_cpu(no_extension, monkeypatch, mode):
    """With the extension absent the CPU path still computes (mode ``cuda`` only insists for CUDA tensors'
    ops, which there are none of here)."""
    monkeypatch.setenv("V41_KERNELS", mode)
    g = torch.Generator().manual_seed(0)
    w = PackedWeight(torch.randn(64, 128, generator=g).to(torch.float8_e4m3fn),
                     torch.full((2, 4), 120, dtype=torch.uint8), "fp8", (32, 32)).check()
    x = torch.randn(3, 128, generator=g)
    assert torch.allclose(linear.linear(x, w), linear.linear_ref(x, w))
    ws = PackedWeight(w.data.unsqueeze(0).repeat(3, 1, 1), w.scale.unsqueeze(0).repeat(3, 1, 1), "fp8", (32, 32))
    pairs = moe_align.route_pairs(torch.tensor([[0, 2], [2, 0], [1, 2]]), 3)
    got = moe.grouped_linear(x, ws, pairs.offsets, pairs.rows, active=pairs.active)
    assert torch.allclose(got, moe.grouped_linear_ref(x, ws, pairs.offsets, pairs.rows))


def test_version_reports_the_cuda_kernel_path():
    out = subprocess.run([sys.executable, "-m", "v41.cli", "--version"], capture_output=True, text=True, check=True)
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("cuda kernels:"))
    assert "unavailable" in line or "built for sm_90a" in line, out.stdout
    paths = next(ln for ln in out.stdout.splitlines() if ln.startswith("kernel paths:"))
    assert "PyTorch references" in paths or "sparse attention:" in paths, out.stdout


def test_the_start_up_log_names_each_op_familys_path(monkeypatch):
    """With the extension running on the GPU, the ops with a CUDA kernel say so; a family set to another mode
    and the ops without one name their Triton / PyTorch path."""
    if dispatch.triton is None:
        pytest.skip("needs Triton installed")
    monkeypatch.setattr(dispatch, "cuda_runs_on", lambda device: True)
    for var in ("V41_KERNELS", "V41_MOE_KERNELS", "V41_ATTENTION_KERNELS"):
        monkeypatch.delenv(var, raising=False)
    line = dispatch.describe_paths("cuda")
    assert "sparse attention: CUDA for bf16, else Triton" in line, line
    assert "indexer scores: CUDA over long contexts, else Triton" in line and "other ops: Triton" in line, line
    assert "MoE experts: CUDA at decode sizes, else Triton" in line, line
    assert "mHC seams: CUDA at decode sizes, else Triton" in line, line
    assert "launches: " in line, line  # programmatic dependent (PDL) on sm_90+, else serial
    from v41.kernels import sparse_attention
    monkeypatch.setattr(sparse_attention, "WIDE_MIN_TOKENS", 256)  # the wide Triton tiling for prefill steps
    assert ("sparse attention: Triton wide for steps of ≥ 256 tokens over bf16 rows, CUDA for bf16, else Triton;"
            in dispatch.describe_paths("cuda"))
    monkeypatch.setenv("V41_ATTENTION_KERNELS", "triton")
    line = dispatch.describe_paths("cuda")
    assert "sparse attention: Triton wide for steps of ≥ 256 tokens over bf16 rows, Triton;" in line, line
    monkeypatch.setattr(sparse_attention, "WIDE_MIN_TOKENS", 0)
    assert "sparse attention: Triton;" in dispatch.describe_paths("cuda")
    monkeypatch.setenv("V41_KERNELS", "torch")
    assert "dense linears: PyTorch;" in dispatch.describe_paths("cuda")


def test_the_kernel_declines_operands_it_cannot_read():
    """Shapes and dtypes the CUDA kernel does not take return None before any launch (the caller runs Triton)."""
    w = PackedWeight(torch.zeros(64, 96, dtype=torch.float8_e4m3fn), torch.zeros(2, 3, dtype=torch.uint8), "fp8",
                     (32, 32))
    assert not wstream._takes(torch.zeros(2, 96, dtype=torch.bfloat16), w, 96, 64)  # K not whole 64-input chunks
    w = PackedWeight(torch.zeros(64, 128, dtype=torch.float8_e4m3fn), torch.zeros(2, 4, dtype=torch.uint8), "fp8",
                     (32, 32))
    assert wstream._takes(torch.zeros(2, 128, dtype=torch.bfloat16), w, 128, 64)
    assert not wstream._takes(torch.zeros(2, 128), w, 128, 64)  # float32 activations
    assert not wstream._takes(torch.zeros(2, 128, dtype=torch.bfloat16), w, 128, 40)  # groups of partial tiles
    w48 = PackedWeight(torch.zeros(64, 192, dtype=torch.float8_e4m3fn), torch.zeros(2, 4, dtype=torch.uint8), "fp8",
                       (32, 48))
    assert not wstream._takes(torch.zeros(2, 192, dtype=torch.bfloat16), w48, 192, 64)  # 48-input scale blocks
    assert wstream.linear(torch.zeros(wstream.MAX_ROWS + 1, 128, dtype=torch.bfloat16), w, torch.bfloat16) is None


def test_the_cuda_seam_takes_decode_sized_bf16_steps_only():
    """cuda/mhc/hc_seam.cu takes contiguous 8-byte aligned bf16 copies of 1..MAX_TOKENS tokens, hc = 4, D a
    positive multiple of 64, float32 mix parameters, a bf16 norm weight; anything else goes to Triton (checked
    before any launch, so CPU tensors show it)."""
    def case(t=1, d=512, dtype=torch.bfloat16, hc=4, fn_dtype=torch.float32, norm_dtype=torch.bfloat16, offset=0):
        h = torch.zeros(t * hc * d + offset, dtype=dtype)[offset:].view(t, hc, d)
        return mhc_cuda.takes(h, torch.zeros(24, 4 * d, dtype=fn_dtype), torch.ones(3), torch.zeros(24),
                              torch.ones(d, dtype=norm_dtype))
    assert case() and case(t=mhc_cuda.MAX_TOKENS) and case(d=5120)
    assert not case(t=mhc_cuda.MAX_TOKENS + 1)  # prefill-sized steps
    assert not case(t=0) and not case(d=96) and not case(dtype=torch.float32) and not case(hc=2)
    assert not case(fn_dtype=torch.bfloat16) and not case(norm_dtype=torch.float32)
    assert not case(offset=1)  # h not 8-byte aligned
    d = mhc_cuda.FRESH_MAX_D + 64  # the seam's own pre over rows longer than the last CTA's registers hold
    h = torch.zeros(1, 4, d, dtype=torch.bfloat16)
    assert mhc_cuda.seam(h, torch.zeros(24, 4 * d), torch.ones(3), torch.zeros(24), 20, 1e-6, 1e-6,
                         collapse=(None, torch.ones(d, dtype=torch.bfloat16), 1e-6)) is None


@pytest.mark.parametrize("given", [True, False])
@pytest.mark.parametrize("mode", ["auto", "cuda", "torch"])
def test_the_seam_falls_back_to_expand_mixes_and_collapse_on_the_cpu(no_extension, monkeypatch, mode, given):
    monkeypatch.setenv("V41_KERNELS", mode)
    g = torch.Generator().manual_seed(1)
    h, y = torch.randn(3, 4, 64, generator=g), torch.randn(3, 64, generator=g)
    post, comb = torch.rand(3, 4, generator=g), torch.rand(3, 4, 4, generator=g)
    fn, scale, base = torch.randn(24, 256, generator=g) * 0.1, torch.ones(3), torch.randn(24, generator=g)
    pre_c, norm_w = (torch.rand(3, 4, generator=g) if given else None), torch.rand(64, generator=g)
    got = mhc.hc_seam(h, fn, scale, base, 4, 20, 1e-6, 1e-6, pre_c, 1e-5, norm_w, y, post, comb)
    h2 = mhc.hc_expand_ref(h, y, post, comb)
    mixes = mhc.hc_mixes_ref(h2, fn, scale, base, 4, 20, 1e-6, 1e-6)
    x = mhc.hc_collapse_norm_ref(h2, mixes[0] if pre_c is None else pre_c, 1e-5, norm_w)
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(got, (h2, *mixes, x)))


@pytest.mark.parametrize("mode", ["auto", "cuda", "torch"])
def test_the_router_falls_back_to_the_gate_linear_and_route_on_the_cpu(no_extension, monkeypatch, mode):
    monkeypatch.setenv("V41_KERNELS", mode)
    monkeypatch.setattr(router, "CUDA_ROUTER", True)
    monkeypatch.setattr(router, "CUDA_ROUTER_MAX_TOKENS", router.ROUTER_MAX_TOKENS)
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(3, 64, generator=g), torch.randn(32, 64, generator=g)
    bias = torch.randn(32, generator=g) * 0.1
    got = router.route_fused(x, from_dense(w), bias, None, 6, 1.5, True, 2.5)
    want = router.route_ref(linear.linear_ref(x, from_dense(w), torch.float32), bias, None, 6, 1.5, True, 2.5)
    assert torch.equal(got[0], want[0]) and torch.allclose(got[1], want[1])


def test_the_cuda_router_declines_what_it_cannot_read():
    """Checked before any launch, so CPU tensors show it: the CUDA router takes bf16 decode steps over a bf16 gate
    of at most 512 experts and top-16, with exactly one of a float32 bias and hash ids."""
    x, w = torch.zeros(2, 64, dtype=torch.bfloat16), from_dense(torch.zeros(32, 64, dtype=torch.bfloat16))
    bias = torch.zeros(32)
    decline = [(x.float(), w, 6), (torch.zeros(17, 64, dtype=torch.bfloat16), w, 6),
               (x, from_dense(torch.zeros(32, 64)), 6),  # a float32 gate
               (x, w, 17), (x, w, 33), (torch.zeros(2, 60, dtype=torch.bfloat16), w, 6),
               (x, from_dense(torch.zeros(513, 64, dtype=torch.bfloat16)), 6), (x[0], w, 6)]
    for xi, wi, k in decline:
        b = torch.zeros(wi.data.shape[0])
        assert router._route_cuda(xi, wi, b, None, k, 1.0, True, 1.0) is None
    assert router._route_cuda(x, w, bias.double(), None, 6, 1.0, True, 1.0) is None  # a float64 bias
    assert router._route_cuda(x, w, bias[:31], None, 6, 1.0, True, 1.0) is None  # a bias per expert
    hashed = torch.zeros(2, 6, dtype=torch.int64)
    assert router._route_cuda(x, w, bias, hashed, 6, 1.0, True, 1.0) is None  # both a bias and hash ids
    assert router._route_cuda(x, w, None, None, 6, 1.0, True, 1.0) is None  # neither


def test_grouped_takes_decode_steps_and_leaves_prefill_to_triton():
    """The expert kernel is taken while pairs per expert slot stay within MAX_ROWS_PER_EXPERT (decode), never for
    a prefill-sized step; checked before any launch, so CPU tensors show it."""
    e, n, k = 16, 64, 128
    w = PackedWeight(torch.zeros(e, n, k // 2, dtype=torch.uint8), torch.zeros(e, n, k // 32, dtype=torch.uint8),
                     "mxfp4", (1, 32))
    big = moe_align.route_pairs(torch.randint(0, e, (64, 6)), e)
    x = torch.zeros(64, k, dtype=torch.bfloat16)
    assert wstream.grouped(x, w, big.offsets, big.rows, big.active) is None  # 384 pairs over 16 slots


@pytest.mark.parametrize("t,n,requests",
                         [(1, 2048, 1), (64, 8192, 1), (8, 131072, 8), (2048, 8192, 1), (64, 1 << 20, 2)])
@pytest.mark.parametrize("heads", [16, 32, 64])
def test_the_cuda_scorers_launch_shape(t, n, requests, heads):
    qb, entries = indexer.cuda_tiles(t, n, requests, heads, 132)
    assert qb == ((8 if heads <= 32 else 4) if indexer.query_blocked(t, requests) else 1)
    assert entries % 128 == 0 and 64 * qb <= entries <= 4096


@pytest.mark.parametrize("m", [1, 8, 16, 17, 32, 64, 300])
@pytest.mark.parametrize("n,ng", [(1280, 1280), (32768, 32768), (8192, 1024), (4608, 4608), (129280, 129280)])
def test_the_triton_linears_tiles(m, n, ng):
    """BN divides the group; above 16 rows BN is 128 only where BN 64 would already fill TARGET_PROGRAMS tiles."""
    bm, bn, warps, stages = linear.linear_tiles(m, n, ng)
    assert bm == (16 if m <= 16 else 32 if m <= 32 else 64) and ng % bn == 0 and bn <= 128
    if m > 16:
        wide = -(-m // bm) * (n // 64) >= linear.TARGET_PROGRAMS
        assert bn == (128 if wide else 64)


def test_side_work_runs_inline_on_cpu_tensors(monkeypatch):
    """kernels/side_stream.py: without a CUDA device the side function runs at once, on the main lane, even for a
    one-token step of an enabled site; beside asks side_stream.takes."""
    from v41.kernels import side_stream

    monkeypatch.setattr(side_stream, "ENABLED", True)
    monkeypatch.setattr(side_stream, "MAX_TOKENS", 1)
    x = torch.ones(1, 3)
    pending = side_stream.beside(lambda: (side_stream.lane(), x + 1), x, "shared_expert")
    lane, y = pending.wait()
    assert lane == 0 and torch.equal(y, torch.full((1, 3), 2.0))
    asked = []
    monkeypatch.setattr(side_stream, "takes", lambda like, site: asked.append(site) or False)
    side_stream.beside(lambda: None, x, "cache_and_index")
    assert asked == ["cache_and_index"]


def test_side_stream_and_pdl_defaults():
    """The defaults measured on 2026-12-05 (benches/RESULTS.md): the side stream on for steps of up to 8 tokens at
    both sites, with programmatic dependent launch."""
    from v41.kernels import pdl, side_stream

    assert side_stream.ENABLED and side_stream.MAX_TOKENS == 8
    assert side_stream.SITES.split(",") == ["shared_expert", "cache_and_index"]
    assert pdl.ENABLED and pdl.WITH_SIDE_STREAM


def test_side_stream_takes_one_token_cuda_steps_of_its_sites(monkeypatch):
    """side_stream.takes: work goes on the side stream only when it is enabled, for a listed site, for a CUDA
    step of at most MAX_TOKENS rows, and not from inside side work; else it runs inline."""
    from types import SimpleNamespace

    from v41.kernels import side_stream

    def step(rows, device="cuda"):
        return SimpleNamespace(shape=(rows, 4096), device=torch.device(device))

    monkeypatch.setattr(side_stream, "ENABLED", True)
    monkeypatch.setattr(side_stream, "MAX_TOKENS", 1)
    monkeypatch.setattr(side_stream, "SITES", "shared_expert,cache_and_index")
    assert side_stream.takes(step(1), "shared_expert") and side_stream.takes(step(1), "cache_and_index")
    assert not side_stream.takes(step(2), "shared_expert")  # a longer step: inline
    assert not side_stream.takes(step(1, "cpu"), "shared_expert")
    assert not side_stream.takes(step(1), "other_site")
    monkeypatch.setattr(side_stream, "MAX_TOKENS", 64)
    assert side_stream.takes(step(64), "shared_expert") and not side_stream.takes(step(65), "shared_expert")
    monkeypatch.setattr(side_stream, "_lane", [1])  # inside side work
    assert not side_stream.takes(step(1), "shared_expert")
    monkeypatch.setattr(side_stream, "_lane", [0])
    monkeypatch.setattr(side_stream, "ENABLED", False)
    assert not side_stream.takes(step(1), "shared_expert")


def test_programmatic_dependent_launch_switches(monkeypatch):
    """PDL is used on sm_90+ CUDA devices only, never under Triton's interpreter or on the CPU, off with
    pdl.ENABLED = False, and off while the side stream is on when pdl.WITH_SIDE_STREAM is False (kernels/pdl.py); Triton
    launches get its keywords."""
    from v41.kernels import pdl, side_stream

    dev = torch.device("cuda", 0)
    monkeypatch.setattr(pdl, "_CAPABLE", {0: True})
    monkeypatch.setattr(pdl, "interpreting", lambda: False)
    monkeypatch.setattr(side_stream, "ENABLED", False)
    assert pdl.enabled(dev) and pdl.triton_kw(dev) == {"PDL": True, "launch_pdl": True}
    assert not pdl.enabled(torch.device("cpu")) and pdl.triton_kw(torch.device("cpu")) == {"PDL": False}
    monkeypatch.setattr(side_stream, "ENABLED", True)
    monkeypatch.setattr(pdl, "WITH_SIDE_STREAM", False)
    assert not pdl.enabled(dev)
    monkeypatch.setattr(pdl, "WITH_SIDE_STREAM", True)  # both (the default)
    assert pdl.enabled(dev)
    monkeypatch.setattr(pdl, "WITH_SIDE_STREAM", False)
    monkeypatch.setattr(side_stream, "ENABLED", False)
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert not pdl.enabled(dev)
    monkeypatch.setattr(pdl, "ENABLED", True)
    monkeypatch.setattr(pdl, "_CAPABLE", {0: False})  # an sm_80 device
    assert not pdl.enabled(dev)
    monkeypatch.setattr(pdl, "interpreting", lambda: True)
    monkeypatch.setattr(pdl, "_CAPABLE", {0: True})
    assert not pdl.enabled(dev)


def test_weight_streaming_slices_keep_their_byte_floor(monkeypatch):
    """wstream.MIN_SLICE_BYTES caps the split-K slices so that each streams at least that many weight bytes; 0 leaves
    the CTAS_PER_SM split (V4.1's wkv [512, 5120] FP8 at one row: 8 tiles of 64 rows, 80 chunks)."""
    monkeypatch.setattr(wstream, "sm_count", lambda device: 132)
    cpu = torch.device("cpu")
    monkeypatch.setattr(wstream, "MIN_SLICE_BYTES", 0)
    split, per = wstream._launch_shape(1, 512, 5120, "fp8", cpu)
    assert (split, per) == (40, 2)  # 8 KB slices
    monkeypatch.setattr(wstream, "MIN_SLICE_BYTES", 64 << 10)
    split, per = wstream._launch_shape(1, 512, 5120, "fp8", cpu)
    assert split == 5 and per * 64 * 64 >= 64 << 10 and split * per >= 80
    big = wstream._launch_shape(6, 4608, 5120, "mxfp4", cpu)  # experts: enough tiles, no split either way
    assert big[0] == 1


def test_the_double_buffer_goes_to_expert_launches_that_fit_the_gpu_at_once(monkeypatch):
    """wstream.double_buffer_chunks: expert GEMMs (no activation prefetch) whose CTAs all fit at the variant's
    occupancy (4 per SM) take it; dense linears and larger grids do not."""
    sms = 132
    assert wstream.double_buffer_chunks(432, False, sms) == wstream.DOUBLE_BUFFER == 2  # V4.1 w13 at one row
    assert wstream.double_buffer_chunks(4 * sms, False, sms) == 2
    assert wstream.double_buffer_chunks(4 * sms + 1, False, sms) == 0  # 8 rows: 3,456 CTAs
    assert wstream.double_buffer_chunks(100, True, sms) == 0  # a dense linear
    monkeypatch.setattr(wstream, "DOUBLE_BUFFER_CTAS_PER_SM", 3)
    assert wstream.double_buffer_chunks(432, False, sms) == 0  # would run in two waves
    monkeypatch.setattr(wstream, "DOUBLE_BUFFER", 0)
    assert wstream.double_buffer_chunks(1, False, sms) == 0
