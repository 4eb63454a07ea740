"""flash-slice benchmark (docs/benchmarking.md, issue 12): real V4-Flash / V4.1-Flash layer shapes, random weights made on
the GPU, v41's engine (checkpoint formats: FP8 dense + MXFP4 experts, CUDA graphs) and, for V4, transformers
(bf16, eager, the same dequantized weights) side by side in one call.

    python3 benches/gpu/flash_slice.py --slice v4 [--transformers] [--cells 1x2048,8x2048] [--prefill 2048,8192]
    python3 benches/gpu/flash_slice.py --slice v41 --kv-cache-dtype fp8 --cells 1x1048320 --prefill , \
        --budget 8192 [--recent-index-prefill]        # a real 1M-token prefill (~4 min), then decode there;
                                                      # the flag prefills by recency in ~1 min (long_context.py)
    python3 benches/gpu/flash_slice.py --slice v41 --set v41.kernels.indexer.CUDA_MIN_ENTRIES=0 ...  # a kernel switch

Figures as docs/benchmarking.md "How a figure is taken": decode = median of 50 engine steps (scheduler + forward +
sampling) after 10 warm-ups with all B requests running (checked), every request prefilled to context C first,
tokens sampled at temperature 1 with a per-request seed (hash routing goes by token id); prefill = one request
of L tokens in one chunk, cold, median of 3 after a warm-up; floors = bytes the step must read (weights in the
format used — dense parts plus the experts uniform routing touches in expectation — and the KV read) over the
device-to-device copy bandwidth measured in the same call; a prefill's floor is its roofline, the tokens per second
at the bf16 dense-GEMM rate of the same call over the FLOPs of its linears per token (layer_times.py
``gemm_flops_per_token``: attention's products left out, so the percentage understates). Prints the environment,
writes JSON next to --out, prints one table last. The engines of this script and of the scripts that import
:func:`v41_engine` (profile_step.py, engram_offload.py) use ``gpu_memory_utilization`` ``$GPU_UTIL`` (default 0.9):
flash-slice-v41's weights take ~72 GB, so an 80 GB H100 needs about 0.97.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import os
import platform
import random
import re
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from event_timing import median_ms
from layer_times import gemm_flops_per_token, is_routed_expert, layer_kv_bytes, per_layer

V4_FLASH_4L = dict(  # V4-Flash layers 0-3: SWA, SWA, CSA (4), HCA (128); hash-MoE on the first three
    vocab_size=129280, hidden_size=4096, moe_intermediate_size=2048, num_hidden_layers=4, num_attention_heads=64,
    head_dim=512, qk_rope_head_dim=64, q_lora_rank=1024, o_lora_rank=1024, o_groups=8, n_routed_experts=256,
    n_shared_experts=1, num_experts_per_tok=6, num_hash_layers=3, sliding_window=128, index_n_heads=64,
    index_head_dim=128, index_topk=512, compress_ratios=[0, 0, 4, 128, 0], max_position_embeddings=1048576,
    quantization_config=dict(quant_method="fp8", fmt="e4m3", scale_fmt="ue8m0", activation_scheme="dynamic",
                             weight_block_size=[128, 128]))
V41_FLASH_SLICE = dict(  # real layers 0, 1, 2, 3, 14, 20, 21, 24, 25 of V4.1-Flash, roles kept; Engram folded
    vocab_size=129280, hidden_size=5120, moe_intermediate_size=2304, num_hidden_layers=9, num_attention_heads=64,
    head_dim=512, qk_rope_head_dim=64, q_lora_rank=1280, o_lora_rank=1024, o_groups=8, n_routed_experts=384,
    n_shared_experts=1, num_experts_per_tok=6, sliding_window=128, index_n_heads=32, index_head_dim=128,
    index_topk=512, compress_ratios=[0, 0, 2, 2, 2, 1, 1, 1, 1], kv_source_layer_ids=[2, 4, 5],
    index_source_layer_ids=[2, 4, 5, 7], candidate_source_layer_id=5, candidate_topk_blocks=2048,
    candidate_block_size=8, engram_layer_ids=[1, 4], engram_n_heads=8, engram_head_dim=256,
    engram_vocab_size=333333, num_nextn_predict_layers=0, dspark_target_layer_ids=[], max_position_embeddings=1048576)


def ceilings(dev: str) -> dict:
    """Device-to-device copy bandwidth (bytes read + written) and the bf16 matmul rate, by events."""
    def timed(fn):
        return median_ms(fn, 20) / 1e3

    src = torch.randn(1 << 29, device=dev)  # 2 GiB
    dst = torch.empty_like(src)
    copy_s = timed(lambda: dst.copy_(src))
    x = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    mm_s = timed(lambda: x @ x)
    del src, dst, x
    return {"copy_GBps": 2 * (1 << 31) / copy_s / 1e9, "bf16_TFLOPs": 2 * 8192 ** 3 / mm_s / 1e12}


def write_config(root: Path, which: str) -> Path:
    from v41.testing.tiny import make_tiny

    arch, over = ("deepseek_v4", V4_FLASH_4L) if which == "v4" else ("deepseek_v41", V41_FLASH_SLICE)
    return make_tiny(root / f"flash-slice-{which}", arch, weights=False, **over)


# -- v41 -----------------------------------------------------------------------------------------------------------
GPU_MEMORY_UTILIZATION = float(os.environ.get("GPU_UTIL", "0.9"))  # module docstring


def v41_engine(path: Path, max_seqs: int, max_tokens: int, max_len: int, quantization: str, **kw):
    from v41.engine.args import EngineArgs
    from v41.engine.core import EngineCore

    kw.setdefault("gpu_memory_utilization", GPU_MEMORY_UTILIZATION)

    args = EngineArgs(model=str(path), load_format="dummy", device="cuda", max_num_seqs=max_seqs,
                      max_num_batched_tokens=max_tokens, max_model_len=max_len, enable_prefix_caching=False,
                      quantization=quantization, num_kv_blocks=max(64, max_seqs * (-(-max_len // 64) + 2)), **kw)
    core = EngineCore(args)
    if core.engram_rows is not None:  # the slice's tokenizer is the tiny one: fold the 129k ids onto its token map
        rows, n = core.engram_rows.rows, core.engram_rows.vocab
        core.engram_rows.rows = lambda ids, counts, hist: rows(ids % n, counts, [[h % n for h in hh] for hh in hist])
        hasher = copy.copy(core.engram_rows.hasher)  # async scheduling's pending rows (engine/pending.py) alike
        hasher.token_map = hasher.token_map[np.arange(max(n, core.cfg.vocab_size)) % n]
        core.engram_rows.hasher = hasher
        resolver = core.executor.runner.resolver
        if resolver is not None:
            resolver.token_map = torch.from_numpy(hasher.token_map).to(resolver.device)
    return core


def decode_headroom(batch: int, context: int, budget: int, steps: int = 50, warmup: int = 10) -> int:
    """Tokens a decode cell's first request may generate: while the others prefill (chunked by what ``budget``
    tokens per step leaves after up to ``batch`` decoding requests) it already decodes, then the warm-up and timed
    steps, plus a margin."""
    return -(-batch * context // max(1, budget - batch)) + batch + warmup + steps + 16


def v41_decode(core, batch: int, context: int, steps: int = 50, warmup: int = 10, after=None,
               prefill_ctx=contextlib.nullcontext) -> float:
    """Median ms per engine step (the interval between consecutive step calls' returns) with ``batch`` requests
    decoding at ``context``; ``after(core)`` runs once the
    timed steps are checked, before the requests are aborted; the prefill runs inside ``prefill_ctx()``
    (long_context.recent_index_selection with ``--recent-index-prefill``)."""
    from v41.engine.params import SamplingParams

    rng = random.Random(batch * 7919 + context)
    vocab = core.cfg.vocab_size
    for i in range(batch):  # sampled, seeded: the ids fed to the hash-routed layers vary per request as in serving;
        # max_tokens None: no request may finish inside the timed window
        sp = SamplingParams(temperature=1.0, seed=i, ignore_eos=True, max_tokens=None)
        core.add_request(f"d{batch}-{context}-{i}", [rng.randrange(3, vocab) for _ in range(context)], sp)
    t0 = tick = time.perf_counter()
    n_steps = 0
    with prefill_ctx():
        while any(len(s.output_token_ids) == 0 for s in core.seqs.values()):
            core.step()
            n_steps += 1
            if time.perf_counter() - tick > 30:  # long prefills: progress, so a run cut short still says its rate
                tick = time.perf_counter()
                done = min(batch * context, n_steps * core.args.max_num_batched_tokens)
                print(f"  prefill: about {done:,} of {batch * context:,} tokens in {tick - t0:.0f} s", flush=True)
    print(f"v41 decode B={batch} C={context}: prefilled in {time.perf_counter() - t0:.0f} s", flush=True)
    times = []  # between consecutive step returns, no synchronisation in between: with async scheduling a call
    torch.cuda.synchronize()  # returns with its step still running, and the interval is the steady-state period
    t = time.perf_counter()
    for k in range(warmup + steps):
        core.step()
        now = time.perf_counter()
        if k >= warmup:
            times.append(now - t)
        t = now
    live = [s for s in core.seqs.values() if not s.finished]
    if len(live) != batch:  # a shrinking batch would time a smaller cell (decode_headroom sizes max_model_len)
        raise RuntimeError(f"decode B={batch}: only {len(live)} requests were still running after the timed steps")
    last = {s.output_token_ids[-1] for s in live}
    print(f"v41 decode B={batch} C={context}: {len(last)} distinct tokens in the last step", flush=True)
    if after is not None:
        after(core)
    for rid in list(core.requests):
        core.abort_request(rid)
    core.step()
    return 1e3 * statistics.median(times)


def v41_prefill(core, length: int, reps: int = 3) -> float:
    """tok/s of one cold request of ``length`` tokens prefilled in one chunk (median of ``reps`` after a warm-up)."""
    from v41.engine.params import SamplingParams

    rng = random.Random(length)
    vocab = core.cfg.vocab_size
    times = []
    for k in range(reps + 1):
        core.add_request(f"p{length}-{k}", [rng.randrange(3, vocab) for _ in range(length)],
                         SamplingParams(temperature=0.0, max_tokens=1))
        torch.cuda.synchronize()
        t = time.perf_counter()
        while core.has_unfinished():
            core.step()
        torch.cuda.synchronize()
        if k:
            times.append(time.perf_counter() - t)
    return length / statistics.median(times)


def weight_bytes(core) -> dict:
    """Device bytes of the fast model's weights: dense parts, one routed expert of a layer, the LM head."""
    model = core.executor.runner.model
    dense = expert = 0
    for name, buf in list(model.named_buffers()) + list(model.named_parameters()):
        n = buf.numel() * buf.element_size()
        if is_routed_expert(name):
            expert += n
            continue
        if name.startswith("head.") or name.startswith("embed.") or ".engram.table" in name:
            continue  # the head is counted apart; a step reads only its tokens' embedding and Engram rows
        dense += n
    n_moe = len(model.layers)
    per_expert = expert / (n_moe * model.cfg.n_routed_experts)
    head = model.head.proj.packed.nbytes
    return {"dense": dense, "expert_per_layer_each": per_expert, "n_moe": n_moe, "head": head}


def floor_ms(wb: dict, cfg, batch: int, context: int, copy_gbps: float, layout=None) -> float:
    """Bytes a decode step must read (uniform routing expectation; KV rows as ``layout`` stores them) over the copy
    bandwidth, in ms."""
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    touched = e * (1 - (1 - k / e) ** batch)
    weights = wb["dense"] + wb["n_moe"] * touched * wb["expert_per_layer_each"] + wb["head"]
    kv = sum(layer_kv_bytes(cfg, plan, batch, context, layout) for plan in cfg.plan)
    return 1e3 * (weights + kv) / (copy_gbps * 1e9)


def request_cache_bytes(layout, context: int) -> dict[str, int]:
    """Bytes one request at ``context`` tokens holds in each cache kind (window kinds keep their window), as the
    layout stores rows (bf16 or records)."""
    per = layout.bytes_per_token(2)
    return {k.name: int(per[k.name] * min(context, k.window_tokens or context)) for k in layout.kinds}


# -- transformers (V4) ------------------------------------------------------------------------------------------
def hf_from_v41(path: Path, core, dtype: torch.dtype = torch.bfloat16):
    """transformers' DeepseekV4ForCausalLM (``dtype``, eager) with v41's weights, dequantized, built in host memory:
    the caller moves it to the GPU once v41's engine is gone (on an 80 GB H100 the two do not fit together). Built
    without transformers' random initialization (every weight is copied in; any parameter v41 does not export is
    drawn from N(0, 0.02²) and named). In bf16 the tensors transformers keeps in float32 when it loads a bf16
    checkpoint (the model's ``_keep_in_fp32_modules_strict``, matched as ``from_pretrained`` matches them: a search
    in the tensor's name) are float32 here too. Built in float32 from a float32 fast model it reproduces the oracle
    (tests/test_bench_transformers.py)."""
    import transformers
    from transformers.initialization import no_init_weights
    from v41.checkpoint_names import bare_to_hf

    raw = json.loads((path / "config.json").read_text())
    names = {"swa": "sliding_attention", "csa": "compressed_sparse_attention", "hca": "heavily_compressed_attention"}
    plan = core.cfg.plan
    kw = {k: v for k, v in raw.items() if k not in ("architectures", "model_type", "compress_ratios", "num_hash_layers")}
    kw.update(layer_types=[names[p.attn_type] for p in plan],
              compress_rates={names[p.attn_type]: p.ratio for p in plan if p.ratio},
              mlp_layer_types=["hash_moe" if p.hash_moe else "moe" for p in plan])
    cfg = transformers.DeepseekV4Config(**kw)
    cfg._attn_implementation = "eager"
    torch.set_default_dtype(dtype)
    with no_init_weights():
        hf = transformers.DeepseekV4ForCausalLM(cfg).eval()
    torch.set_default_dtype(torch.float32)
    if hf._keep_in_fp32_modules_strict:  # what from_pretrained keeps in float32 for bf16
        fp32 = re.compile("|".join(map(re.escape, hf._keep_in_fp32_modules_strict)))
        for name, t in [*hf.named_parameters(), *hf.named_buffers()]:
            if t.is_floating_point() and fp32.search(name):
                t.data = t.data.float()
    params = dict(hf.named_parameters())
    params.update(dict(hf.named_buffers()))
    written = set()
    for bare, t in export_dense(core.executor.runner.model):
        name = bare if bare.startswith("model.") else bare_to_hf(bare)
        with torch.no_grad():
            params[name].copy_(t.to(params[name].dtype))
        written.add(name)
    rest = [name for name, _ in hf.named_parameters() if name not in written]
    with torch.no_grad():
        for name in rest:
            torch.nn.init.normal_(params[name], std=0.02)
    if rest:
        print(f"transformers: {len(rest)} parameters not exported by v41, drawn at random: {rest[:4]}", flush=True)
    return hf


def export_dense(model):
    """(bare name or HF fused-expert name, dense tensor) for every weight of the fast model."""
    yield "embed.weight", model.embed.weight
    yield "norm.weight", model.norm.weight
    yield "head.weight", model.head.proj.packed.dequantize(torch.bfloat16)
    if hasattr(model, "hc_head"):  # the checkpoint's rows of the head's seam mixes (HcHead.finish_loading)
        hc = model.cfg.hc_mult
        for a, rows in (("fn", hc), ("base", hc), ("scale", 1)):
            yield f"hc_head_{a}", getattr(model.hc_head, a)[:rows]
    for i, block in enumerate(model.layers):
        p = f"layers.{i}."
        for norm in ("attn_norm", "ffn_norm"):
            yield f"{p}{norm}.weight", getattr(block, norm).weight
        for sub in ("attn", "ffn"):
            for a in ("fn", "base", "scale"):
                yield f"{p}hc_{sub}_{a}", getattr(getattr(block, f"hc_{sub}"), a)
        for name, mod in block.attn.named_modules():
            if hasattr(mod, "packed") and hasattr(mod, "in_features"):
                yield f"{p}attn.{name}.weight", mod.packed.dequantize(torch.bfloat16)
        for name, t in block.attn.named_parameters():
            yield f"{p}attn.{name}", t
        ffn = block.ffn
        yield f"{p}ffn.gate.weight", ffn.gate.packed.dequantize(torch.bfloat16)
        yield (f"{p}ffn.gate.tid2eid", ffn.tid2eid) if ffn.is_hash else (f"{p}ffn.gate.bias", ffn.bias)
        yield f"model.layers.{i}.mlp.experts.gate_up_proj", ffn.w13.packed.dequantize(torch.bfloat16)
        yield f"model.layers.{i}.mlp.experts.down_proj", ffn.w2.packed.dequantize(torch.bfloat16)
        w1, w3 = ffn.shared_w13.packed.dequantize(torch.bfloat16).chunk(2)
        yield f"{p}ffn.shared_experts.w1.weight", w1
        yield f"{p}ffn.shared_experts.w3.weight", w3
        yield f"{p}ffn.shared_experts.w2.weight", ffn.shared_w2.packed.dequantize(torch.bfloat16)


@torch.no_grad()
def hf_decode(hf, vocab: int, batch: int, context: int, steps: int = 20, warmup: int = 3) -> float:
    g = torch.Generator(device="cuda").manual_seed(batch + context)
    ids = torch.randint(3, vocab, (batch, context), device="cuda", generator=g)
    def sample(logits):  # temperature 1, as v41's decode cells
        return torch.multinomial(torch.softmax(logits[:, -1].float(), dim=-1), 1, generator=g)

    out = hf(input_ids=ids, use_cache=True)
    past, nxt = out.past_key_values, sample(out.logits)
    times = []
    for k in range(warmup + steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = hf(input_ids=nxt, past_key_values=past, use_cache=True)
        past, nxt = out.past_key_values, sample(out.logits)
        torch.cuda.synchronize()
        if k >= warmup:
            times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


@torch.no_grad()
def hf_prefill(hf, vocab: int, length: int, reps: int = 3) -> float:
    ids = torch.randint(3, vocab, (1, length), device="cuda")
    times = []
    for k in range(reps + 1):
        torch.cuda.synchronize()
        t = time.perf_counter()
        hf(input_ids=ids, use_cache=True)
        torch.cuda.synchronize()
        if k:
            times.append(time.perf_counter() - t)
    return length / statistics.median(times)


def apply_overrides(items: list[str]) -> dict[str, object]:
    """``MODULE.ATTR=VALUE`` settings applied with setattr, VALUE cast to the attribute's current type (bool from
    0/1); returns them. Raises SystemExit for an unknown module or attribute."""
    import importlib

    done = {}
    for item in items:
        name, _, raw = item.partition("=")
        mod_name, _, attr = name.rpartition(".")
        try:
            mod = importlib.import_module(mod_name)
            old = getattr(mod, attr)
        except (ImportError, AttributeError, ValueError) as e:
            raise SystemExit(f"--set {item}: {e}") from None
        value = bool(int(raw)) if isinstance(old, bool) else type(old)(raw)
        setattr(mod, attr, value)
        done[name] = value
        print(f"--set {name} = {value!r} (was {old!r})", flush=True)
    return done


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--slice", choices=("v4", "v41"), default="v4")
    ap.add_argument("--cells", default="1x2048,8x2048,64x2048", help="BATCHxCONTEXT decode cells")
    ap.add_argument("--prefill", default="2048,8192", help="prefill lengths")
    ap.add_argument("--transformers", action="store_true", help="also run transformers (V4 only)")
    ap.add_argument("--per-layer", default="", help="BATCHxCONTEXT decode cells also timed layer by layer")
    ap.add_argument("--quantization", default="auto", choices=("auto", "none"))
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"))
    ap.add_argument("--async-output-proc", action=argparse.BooleanOptionalAction, default=True,
                    help="the engine's async_output_proc (default on: a step's tokens detokenized and reported while "
                         "the GPU runs the next step)")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                    help="the engine's async_scheduling (default on: each step launched while the previous runs)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=GPU_MEMORY_UTILIZATION,
                    help="the engine's gpu_memory_utilization (default $GPU_UTIL or 0.9; flash-slice-v41's weights "
                    "take ~72 GB: an 80 GB H100 needs about 0.97)")
    ap.add_argument("--budget", type=int, default=0, help="max_num_batched_tokens (default: the longest prefill, "
                    "at least 256)")
    ap.add_argument("--recent-index-prefill", action="store_true", help="decode cells prefill with recency "
                    "selection in the index sources (long_context.py; the timed decode steps index for real)")
    ap.add_argument("--set", action="append", default=[], metavar="MODULE.ATTR=VALUE",
                    help="override a kernel switch before the engine starts, e.g. v41.kernels.indexer.CUDA_SCORER=0 "
                    "(repeatable; same-call A/B of kernel choices)")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    a = ap.parse_args()
    overrides = apply_overrides(a.set)
    cells = [tuple(int(x) for x in c.split("x")) for c in a.cells.split(",") if c]
    prefills = [int(x) for x in a.prefill.split(",") if x]
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
           "commit": os.environ.get("V41_COMMIT", "?")}
    import triton
    env["triton"] = triton.__version__
    env.update(ceilings("cuda"))
    print("environment:", json.dumps(env), flush=True)
    root = Path(tempfile.mkdtemp())
    path = write_config(root, a.slice)
    budget = a.budget or max(prefills + [256])
    max_len = max([c + decode_headroom(b, c, budget) for b, c in cells] + [p + 80 for p in prefills])
    t = time.perf_counter()
    core = v41_engine(path, max((b for b, _ in cells), default=1), budget, max_len, a.quantization,
                      kv_cache_dtype=a.kv_cache_dtype, async_output_proc=a.async_output_proc,
                      async_scheduling=a.async_scheduling, gpu_memory_utilization=a.gpu_memory_utilization)
    print(f"v41 engine ready in {time.perf_counter() - t:.0f} s; KV cache {a.kv_cache_dtype}: "
          f"{core.layout.describe(2)}", flush=True)
    env["kv_cache_dtype"] = a.kv_cache_dtype
    env["async_output_proc"] = a.async_output_proc
    env["async_scheduling"] = a.async_scheduling
    env["overrides"] = overrides
    wb = weight_bytes(core)
    flops = gemm_flops_per_token(core.executor.runner.model, core.cfg.num_experts_per_tok)
    rows = []
    for length in prefills:  # floor: the roofline, tok/s at the bf16 rate of this call over the linears' FLOPs
        rows.append({"what": f"prefill {length}", "v41": v41_prefill(core, length), "unit": "tok/s",
                     "floor": env["bf16_TFLOPs"] * 1e12 / flops, "gemm_flops_per_token": flops})
        print(rows[-1], flush=True)
    layered = {tuple(int(x) for x in c.split("x")) for c in a.per_layer.split(",") if c}
    layer_rows: dict[str, list[dict]] = {}
    for batch, context in cells:
        what = f"decode B={batch} C={context}"
        after = None
        if (batch, context) in layered:
            def after(core, what=what, batch=batch, context=context):
                layer_rows[what] = per_layer(core, batch, context, env["copy_GBps"])
        if a.recent_index_prefill:
            from long_context import recent_index_selection
            what += " (recency prefill)"
        ctx = recent_index_selection if a.recent_index_prefill else contextlib.nullcontext
        rows.append({"what": what, "v41": v41_decode(core, batch, context, after=after, prefill_ctx=ctx), "unit": "ms",
                     "floor": floor_ms(wb, core.cfg, batch, context, env["copy_GBps"], core.layout),
                     "request_cache_bytes": request_cache_bytes(core.layout, context)})
        print(rows[-1], flush=True)
    if a.transformers and a.slice == "v4":
        hf = hf_from_v41(path, core)
        vocab = core.cfg.vocab_size
        del core
        gc.collect()
        torch.cuda.empty_cache()
        try:
            hf = hf.to("cuda")
        except torch.OutOfMemoryError as e:
            hf, moved = None, f"OOM ({str(e)[:60]})"
        for row in rows:
            kind, *rest = row["what"].split()
            if hf is None:
                row["transformers"] = moved
                continue
            try:
                if kind == "prefill":
                    row["transformers"] = hf_prefill(hf, vocab, int(rest[0]))
                else:
                    b, c = int(rest[0][2:]), int(rest[1][2:])
                    row["transformers"] = hf_decode(hf, vocab, b, c)
            except torch.OutOfMemoryError as e:
                row["transformers"] = f"OOM ({str(e)[:60]})"
            print(row, flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / f"flash_slice_{a.slice}_{a.kv_cache_dtype}.json").write_text(json.dumps({"env": env, "weights": wb, "rows": rows,
                                                                               "per_layer": layer_rows}))
    for r in rows:
        if "request_cache_bytes" in r:
            per = r["request_cache_bytes"]
            print(f"{r['what']}: KV cache per request ({a.kv_cache_dtype}) {sum(per.values()) / 2**20:.1f} MiB: "
                  + ", ".join(f"{k} {v / 2**20:.2f}" for k, v in per.items()))
    for what, lrows in layer_rows.items():
        print(f"\nflash-slice-{a.slice} {what}, layer by layer (graph per layer; floor = its bytes / copy bandwidth)")
        for r in lrows:
            print(f"{r['what']:<32}{r['ms']:>9.3f} ms{r['floor_ms']:>9.3f} ms{r['ratio']:>8.1f}x")
        print(f"{'sum':<32}{sum(r['ms'] for r in lrows):>9.3f} ms{sum(r['floor_ms'] for r in lrows):>9.3f} ms")
    print(f"\nflash-slice-{a.slice} ({env['gpu']}; copy {env['copy_GBps']:.0f} GB/s, bf16 {env['bf16_TFLOPs']:.0f} "
          f"TFLOP/s; v41 {a.quantization} weights, {a.kv_cache_dtype} KV cache)")
    print(f"{'cell':<24}{'v41':>12}{'floor':>10}{'v41/floor':>11}{'transformers':>14}")
    for r in rows:
        fl, v = r.get("floor"), r["v41"]
        hf_v = r.get("transformers", "")
        hf_s = f"{hf_v:.1f}" if isinstance(hf_v, float) else str(hf_v)[:13]
        fl_s, ratio = ("", "") if fl is None else (f"{fl:.2f}", f"{v / fl:.1f}x")
        if fl is not None and r["unit"] == "tok/s":  # a prefill rate against its roofline
            fl_s, ratio = f"{fl:.0f}", f"{100 * v / fl:.0f}% roof"
        print(f"{r['what']:<24}{v:>10.2f} {r['unit']:<2}{fl_s:>9}{ratio:>11}{hf_s:>14}")

if __name__ == "__main__":
    main()
