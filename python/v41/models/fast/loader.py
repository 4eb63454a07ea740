"""``load_fast(path)``: the fast model of a checkpoint, weights in their storage formats on the device
(docs/architecture.md §3a; tensor names docs/model.md §5).

The model is built on the meta device and every tensor is then set from the checkpoint (or random, with
``load_format="dummy"``), already sharded for this rank (:func:`v41.models.sharding.shard_plan`). Routed experts
are stacked per layer as ``w13 [E, 2·I_r, D]`` (w1 over w3) and ``w2 [E, D, I_r]``; the shared expert's w1/w3 are
fused the same way. DSpark stages (``mtp.*``) are loaded when the model speculates (``lookahead_tokens``), else read past.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ...checkpoint_packed import DummyReader, PackedReader
from ...config import load_config
from ...distributed.group import SINGLE, Shard, TPGroup, check_tp
from ...kernels.packed import concat_rows, stack_experts
from ..engram_host import CHUNK_ROWS, HostTable, RecordFormat, load_records
from ..engram_loader import engram_hasher
from ..sharding import shard_plan
from .layers import PackedLinear
from .model import FastModel
from .moe import FastMoE

FAST_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
QUANTIZATIONS = ("auto", "none")


class _Loader:
    def __init__(self, reader, shards, dtype: torch.dtype, device: torch.device, keep_packed: bool,
                 engram_hosts: dict[int, HostTable] | None = None):
        self.reader, self.shards, self.dtype, self.device, self.keep = reader, shards, dtype, device, keep_packed
        self.engram_hosts = engram_hosts or {}  # offload: Engram layer id → its host table, filled by _load

    def tensor(self, module: nn.Module, attr: str, name: str) -> None:
        """Set parameter / buffer ``attr`` of ``module`` from checkpoint tensor ``name``."""
        local = getattr(module, attr)
        t = self.reader.dense(name, tuple(local.shape), self.shards.get(name), self.dtype).to(self.device)
        if attr in module._parameters:
            module._parameters[attr] = nn.Parameter(t, requires_grad=False)
        else:
            module._buffers[attr] = t

    def weight(self, name: str, shape: tuple[int, int]):
        return self.reader.packed(name, shape, self.shards.get(name), self.dtype, self.keep)

    def linear(self, module: PackedLinear, name: str) -> None:
        module.set(self.weight(name, (module.out_features, module.in_features)).to(self.device))

    def fused(self, names: list[str], shapes: list[tuple[int, int]]):
        return concat_rows([self.weight(n, s) for n, s in zip(names, shapes)])

    def moe(self, moe: FastMoE, p: str, d: int, inter: int) -> None:
        self.linear(moe.gate, f"{p}gate.weight")
        for attr in ("bias", "bias_vl", "tid2eid"):
            if hasattr(moe, attr):
                self.tensor(moe, attr, f"{p}gate.{attr}")
        up, down = (inter, d), (d, inter)
        w13 = [self.fused([f"{p}experts.{e}.w1.weight", f"{p}experts.{e}.w3.weight"], [up, up])
               for e in range(moe.n_experts)]
        moe.w13.set(stack_experts(w13).to(self.device))
        moe.w2.set(stack_experts([self.weight(f"{p}experts.{e}.w2.weight", down)
                                  for e in range(moe.n_experts)]).to(self.device))
        if moe.n_shared:
            moe.shared_w13.set(self.fused([f"{p}shared_experts.w1.weight", f"{p}shared_experts.w3.weight"],
                                          [up, up]).to(self.device))
            self.linear(moe.shared_w2, f"{p}shared_experts.w2.weight")

    def modules(self, root: nn.Module, prefix: str) -> None:
        """Every PackedLinear under ``root`` from ``prefix + path + '.weight'``, every parameter from its name."""
        for path, mod in root.named_modules():
            if isinstance(mod, PackedLinear):
                self.linear(mod, f"{prefix}{path}.weight")
        for path, _ in root.named_parameters():
            mod_path, _, attr = path.rpartition(".")
            self.tensor(root.get_submodule(mod_path) if mod_path else root, attr, f"{prefix}{path}")


def load_fast(path: str | Path, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cuda",
              quantization: str = "auto", load_format: str = "auto", seed: int = 0,
              tp: TPGroup | None = None, config_overrides: dict | None = None,
              lookahead_tokens: int = 0, draft_sharded: bool = True, engram_shm_prefix: str | None = None,
              engram_pin: bool = False) -> FastModel:
    """Load a V4 / V4.1 checkpoint directory into the fast model on ``device``.

    dtype: compute dtype (activations and caches; bfloat16, float16, float32 or float64). quantization: ``auto``
    keeps FP8 / MXFP4 weights packed (dequantized in the kernels), ``none`` dequantizes them once to ``dtype``.
    load_format: ``auto`` (safetensors) or ``dummy`` (random weights made on ``device`` from ``seed``). tp: this
    rank's group. config_overrides: fields replacing those of ``config.json`` (:func:`v41.config.load_config`).
    lookahead_tokens: draft tokens per verify step (speculative decoding): > 0 loads the DSpark stages
    (``mtp.*``, :mod:`.dspark`) and sizes the cache for them; 0 reads past them. draft_sharded: False loads the
    stages whole on every rank (``draft_tensor_parallel_size`` 1 under TP; :func:`v41.models.sharding.shard_plan`).
    engram_shm_prefix: keep the Engram tables in host memory (:class:`~v41.models.engram_host.HostTable`) under
    ``/dev/shm`` names starting with this string, shared by the engine's ranks (every rank maps them, then the
    names are removed: nothing stays in /dev/shm); None = on the device. engram_pin: page-lock them (the ``uva``
    transfer).
    Raises ValueError (ConfigError, CheckpointError) for bad options, configs or checkpoints,
    FileNotFoundError for a missing directory, ``config.json`` or (Engram) ``tokenizer.json``.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory not found: {path}")
    if dtype not in FAST_DTYPES:
        raise ValueError(f"dtype must be one of {FAST_DTYPES}, got {dtype}")
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    if load_format not in ("auto", "dummy"):
        raise ValueError(f"load_format must be 'auto' or 'dummy', got {load_format!r}")
    cfg = load_config(path, config_overrides)
    rank, world = (tp.rank, tp.world_size) if tp is not None else (0, 1)
    check_tp(cfg, world)
    hasher = engram_hasher(cfg, path / "tokenizer.json")
    primes = {lid: list(hasher.primes[lid]) for lid in cfg.engram_layer_ids} if hasher else None
    device = torch.device(device)
    with torch.device("meta"):
        model = FastModel(cfg, dtype, device, primes, tp, lookahead_tokens, draft_sharded)
    reader = DummyReader(cfg, device, seed) if load_format == "dummy" else PackedReader(path, cfg)
    if isinstance(reader, PackedReader) and model.drafter is None:
        reader.used.update(n for n in reader.tensors if n.startswith("mtp."))
    ld = _Loader(reader, shard_plan(cfg, rank, world, hasher, draft_sharded), dtype, device, quantization == "auto")
    if engram_shm_prefix is not None:
        ld.engram_hosts = _engram_hosts(ld, model, engram_shm_prefix, engram_pin, tp)
    try:
        _load(ld, model)
    except BaseException:
        for host in ld.engram_hosts.values():
            host.close()
        raise
    reader.finish()
    for m in model.modules():  # what modules derive from their loaded tensors (V4's head and compressor gates)
        if hasattr(m, "finish_loading"):
            m.finish_loading()
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"fast model tensors left unloaded (a loader bug): {left[:10]}")
    if model.fuse_siblings() and device.type == "cuda":
        torch.cuda.empty_cache()  # the members' old blocks: the KV-cache budget reads the free device memory
    return model.eval()


def _load(ld: _Loader, model: FastModel) -> None:
    cfg = model.cfg
    ld.tensor(model.embed, "weight", "embed.weight")
    ld.tensor(model.norm, "weight", "norm.weight")
    ld.linear(model.head.proj, "head.weight")
    if not cfg.is_v41:
        for attr in ("fn", "base", "scale"):
            ld.tensor(model.hc_head, attr, f"hc_head_{attr}")
    for plan, block in zip(cfg.plan, model.layers):
        p = f"layers.{plan.layer_id}."
        _load_block(ld, block, p, cfg.hidden_size)
        if plan.engram:
            eng = block.engram
            name = f"{p}engram.embed.weight"
            if plan.layer_id in ld.engram_hosts:
                host = ld.engram_hosts[plan.layer_id]
                load_records(ld.reader, name, host, eng.table_rows, ld.dtype, CHUNK_ROWS)
                eng.set_host(host)
            else:
                eng.set_table(ld.weight(name, (eng.row1 - eng.row0, eng.head_dim)).to(ld.device))
            ld.modules(eng, f"{p}engram.")
    if model.drafter is not None:
        for s, stage in enumerate(model.drafter.stages):
            p = f"mtp.{s}."
            _load_block(ld, stage, p, cfg.hidden_size)
            if s == 0:
                ld.linear(stage.main_proj, f"{p}main_proj.weight")
            for name in ("main_norm", "norm", "markov_head", "confidence_head"):
                if hasattr(stage, name):
                    ld.modules(getattr(stage, name), f"{p}{name}.")


def _engram_hosts(ld: _Loader, model: FastModel, prefix: str, pin: bool, tp: TPGroup | None) -> dict[int, HostTable]:
    """This rank's host table of every Engram layer, mapped and allocated but not yet read; once every rank has
    mapped them (a barrier), their /dev/shm names are removed."""
    hosts = {}
    try:
        for plan, block in zip(model.cfg.plan, model.layers):
            if plan.engram:
                eng, name = block.engram, f"layers.{plan.layer_id}.engram.embed.weight"
                one = ld.reader.packed(name, (1, eng.head_dim), Shard(0, eng.row0, eng.row0 + 1, eng.table_rows),
                                       ld.dtype)
                hosts[plan.layer_id] = HostTable(RecordFormat.of(one), eng.table_rows, eng.row0, eng.row1, pin,
                                                 f"{prefix}-L{plan.layer_id}")
        (tp or SINGLE).barrier()
    finally:
        for host in hosts.values():
            host.unlink()
    return hosts


def _load_block(ld: _Loader, block: nn.Module, p: str, d: int) -> None:
    """Norms, mHC seams, attention and MoE of a backbone layer or DSpark stage under prefix ``p``."""
    for norm in ("attn_norm", "ffn_norm"):
        ld.tensor(getattr(block, norm), "weight", f"{p}{norm}.weight")
    for sub in ("attn", "ffn"):
        for attr in ("fn", "base", "scale"):
            ld.tensor(getattr(block, f"hc_{sub}"), attr, f"{p}hc_{sub}_{attr}")
    ld.modules(block.attn, f"{p}attn.")
    ld.moe(block.ffn, f"{p}ffn.", d, block.ffn.w2.shape[2])
