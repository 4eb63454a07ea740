"""Per-layer decode times of the fast model against each layer's bytes floor (docs/benchmarking.md, issue 12's
"flash-slice-v41 decode at batch 1 within 3× of its floor per layer"), used by ``flash_slice.py --per-layer``.

After a decode cell's timed steps, the CUDA graph of the step's padded batch size holds that step's inputs
(every request decoding at its context). Each decoder layer (its Engram module included) is captured alone in
its own graph over those inputs, with the step context built once outside (RoPE angles, window slots,
segments: the step's prologue) and a random hidden state, then replayed and timed with events; the LM head
(final norm + head over the batch's rows) is the last row. Each floor is the bytes that layer must read —
its weights in the format used (routed experts at the uniform-routing expectation, Engram: the looked-up rows
only) plus its KV reads — over the copy bandwidth measured in the same call.
"""

from __future__ import annotations

import torch

from event_timing import median_ms


def is_routed_expert(name: str) -> bool:
    """Whether a fast-model tensor name belongs to the routed experts' packed weights (``w13`` / ``w2``, not the
    shared expert's)."""
    return (".w13." in f".{name}." or ".w2." in f".{name}.") and "shared" not in name


def _module_bytes(module: torch.nn.Module, touched: float, experts: int) -> tuple[int, float]:
    """(dense bytes, routed-expert bytes read at ``touched`` of ``experts`` experts) of a module's weights; Engram
    tables are left out (a step reads only its rows)."""
    dense, routed = 0, 0.0
    for name, t in list(module.named_buffers()) + list(module.named_parameters()):
        n = t.numel() * t.element_size()
        if "engram.table" in name:
            continue
        if is_routed_expert(name):
            routed += n * touched / experts
        else:
            dense += n
    return dense, routed


def gemm_flops_per_token(model, top_k: int) -> float:
    """FLOPs per prefill token of the fast model's linears over packed weights: 2 · out · in for each dense one
    (grouped ``wo_a`` stores only its diagonal blocks), ``top_k`` of the routed experts; the LM head (one row per
    prefill), the embedding and the Engram tables (gathers), attention's score / value products and the mHC mixes
    are left out, so a rate against it understates the work done (the prefill roofline of flash_slice.py)."""
    from v41.models.fast.layers import PackedModule

    flops = 0.0
    for name, mod in model.named_modules():
        if not isinstance(mod, PackedModule) or name.startswith("head.") or name == "head":
            continue
        *experts, out, inp = mod.shape
        flops += 2.0 * out * inp * (top_k if experts and is_routed_expert(name) else experts[0] if experts else 1)
    return flops


def layer_kv_bytes(cfg, plan, batch: int, context: int, layout=None) -> int:
    """KV bytes one attention layer reads per decode step: window, selected or all compressed entries, and the
    index keys an index source scores, in the rows ``layout`` (a :class:`~v41.cache.layout.CacheLayout`) stores
    (bf16 rows when None); plus the Engram rows of an Engram layer."""
    def row(kind: str, dims: int) -> int:
        return layout.kind(kind).row_bytes(2) if layout is not None else dims * 2

    kv = batch * min(cfg.sliding_window, context) * row("swa", cfg.head_dim)
    if plan.ratio > 0:
        n = context // plan.ratio
        selected = n if plan.attn_type == "hca" else min(cfg.index_topk, n)
        kv += batch * selected * row(f"ckv{plan.ratio}", cfg.head_dim)
        if plan.attn_type in ("csa", "csa2") and plan.is_index_source:
            kv += batch * n * row(f"idx{plan.ratio}", cfg.index_head_dim)
    if plan.engram:
        cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
        kv += batch * cols * (cfg.engram_head_dim + cfg.engram_head_dim // 32)
    return kv


@torch.no_grad()
def per_layer(core, batch: int, context: int, copy_gbps: float) -> list[dict]:
    """Rows {what, ms, floor_ms, ratio} per decoder layer and the LM head, at the state the engine's last decode
    step left (call right after a decode cell of ``batch`` requests at ``context``, before they are aborted)."""
    runner = core.executor.runner
    model, cfg = runner.model, core.cfg
    size = next(s for s in runner.graphs.sizes if s >= batch)
    inputs = runner.graphs.inputs[size]
    step_batch = inputs.batch()
    ctx = model.prepare(step_batch)
    t = step_batch.num_tokens
    gen = torch.Generator(device=model.device).manual_seed(batch)
    h0 = torch.randn(t, cfg.hc_mult, cfg.hidden_size, device=model.device, dtype=model.dtype, generator=gen)
    pre_mix = torch.full((t, cfg.hc_mult), 1.0 / cfg.hc_mult, device=model.device, dtype=torch.float32)
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    touched = e * (1 - (1 - k / e) ** batch)
    rows = []

    def run_layer(plan, layer):
        h = layer.engram(h0, step_batch.engram_rows[plan.layer_id]) if plan.engram else h0
        return layer(h, pre_mix, step_batch.token_ids, ctx)

    for plan, layer in zip(cfg.plan, model.layers):
        run_layer(plan, layer)  # warm-up: Triton compiles, index sources publish their top-k into ctx
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run_layer(plan, layer)
        dense, routed = _module_bytes(layer, touched, e)
        floor = 1e3 * (dense + routed + layer_kv_bytes(cfg, plan, batch, context, core.layout)) / (copy_gbps * 1e9)
        name = plan.attn_type + (f"/{plan.ratio}" if plan.ratio else "") + (" +engram" if plan.engram else "")
        rows.append({"what": f"layer {plan.layer_id} ({name})", "ms": median_ms(graph.replay, 50), "floor_ms": floor})
        del graph
    sel = step_batch.logits_rows
    head_graph = torch.cuda.CUDAGraph()
    x = h0[sel].mean(dim=1)
    model.head(model.norm(x))
    with torch.cuda.graph(head_graph):
        model.head(model.norm(x))
    head_bytes = model.head.proj.packed.nbytes
    rows.append({"what": "final norm + LM head", "ms": median_ms(head_graph.replay, 50),
                 "floor_ms": 1e3 * head_bytes / (copy_gbps * 1e9)})
    for r in rows:
        r["ratio"] = r["ms"] / r["floor_ms"]
    return rows
