"""What an engine core is running with, as one JSON-able dict: the facts front ends report (gRPC
``GetModelInfo`` / ``GetServerInfo``, the start-up log) beyond the model config. The engine-core process sends
it in ``messages.Ready.info``; the in-process ``AsyncEngine`` builds it from its core. One function, so both
engines report the same keys."""

from __future__ import annotations

from dataclasses import asdict


def engine_info(core) -> dict:
    """The resolved configuration of ``core`` (a loaded :class:`~v41.engine.core.EngineCore`).

    Keys: ``arch``, ``vocab_size``, ``bos_token_id``, ``eos_token_ids``, ``pad_token_id`` (model);
    ``max_model_len`` (tokens, after the KV-cache cap), ``block_tokens`` (tokens per KV block = prefix-cache
    page), ``kinds`` (cache kind names, docs/cache.md), ``num_blocks`` ({kind: blocks or rows}),
    ``max_num_seqs``, ``max_num_batched_tokens``, ``enable_prefix_caching``, ``dtype`` (the compute dtype,
    resolved: ``float32``, ``bfloat16``, ...), ``kv_cache_dtype`` (resolved: ``auto`` or ``fp8`` records), ``device``,
    ``numerics``, ``model_impl`` (resolved),
    ``tensor_parallel_size``, ``all_reduce_backend`` (the backend in use, None at TP=1), ``engine_args``
    (every :class:`~v41.engine.args.EngineArgs` field as given)."""
    cfg, args = core.cfg, core.args
    blocks = core.stats()["blocks"]
    return {
        "arch": cfg.arch, "vocab_size": cfg.vocab_size, "bos_token_id": cfg.bos_token_id,
        "eos_token_ids": list(cfg.eos_token_ids), "pad_token_id": cfg.pad_token_id,
        "max_model_len": core.max_model_len, "block_tokens": core.layout.block_tokens, "kinds": list(blocks),
        "num_blocks": {k: v["total"] for k, v in blocks.items()}, "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens, "enable_prefix_caching": args.enable_prefix_caching,
        "dtype": str(args.torch_dtype()).removeprefix("torch."), "kv_cache_dtype": args.resolved_kv_cache_dtype(),
        "device": str(core.device),
        "numerics": args.numerics, "model_impl": args.resolved_model_impl(),
        "tensor_parallel_size": args.tensor_parallel_size,
        "all_reduce_backend": getattr(core.executor, "backend", None), "engine_args": asdict(args)}
