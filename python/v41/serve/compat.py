"""What the flags of other engines' launch commands do in ``v41-serve`` (issue 18; README.md "Serving").

A user moving from vLLM, SGLang or Aphrodite keeps their command line. Each of those flags is honoured, refused
with a clear error, or accepted with one warning; none is ignored silently:

* ``--tokenizer-mode`` / ``--tool-call-parser`` / ``--reasoning-parser``: ``deepseek_v41`` or ``deepseek_v4``
  choose the chat format revision (docs/model.md §7.1) for the prompt encoder and the output parsers (one
  format for both, so names that disagree are an error); ``auto`` (tokenizer mode) or nothing: the model's.
* ``--enable-auto-tool-choice``: required for ``tool_choice: auto`` (also the default when a request brings
  tools), as in vLLM; ``none``, ``required`` and a named tool need nothing.
* ``--trust-remote-code``: accepted; v41 runs no code from a model repository.
* ``--hf-overrides``: merged into the config and validated like it (:func:`v41.config.with_overrides`).
* ``--moe-backend`` / ``--attention-backend``: v41's kernel path of that op family (docs/kernels.md §1 "Choosing
  a path"): ``auto``, ``torch``, ``triton``, ``cuda`` (the ``cuda/`` kernels where the family has them — MoE
  experts; attention runs Triton either way); other engines' names select ``auto`` with a warning.
* ``--attention-config``: ``indexer_tp_shard_min_rows`` (a positive integer) is checked; v41 replicates the
  indexer on every tensor-parallel rank (docs/architecture.md "TP workers"), so a warning says it has no effect.
* ``--enable-flashinfer-autotune`` / ``--no-...``, ``--mm-encoder-tp-mode``: no meaning for v41 (no FlashInfer,
  no vision encoder yet): one warning each.
* ``--speculative-config``: parsed into :class:`v41.engine.spec_config.SpeculativeConfig` (an unknown key, a
  wrong type or value is an error naming it) and handed to the engine, which checks it against the checkpoint;
  the seed's drafter kernel keys ``moe_backend`` / ``attention_backend`` name a path like the backend flags and
  get one warning each: v41's drafter runs the target's kernel paths.
* ``--engram-config``: parsed into :class:`v41.engine.engram_config.EngramConfig` (an unknown key, a wrong type
  or value is an error naming it) and handed to the engine (docs/engram.md).

Errors: :class:`FlagError` (a ``ValueError``; ``v41-serve`` exits with status 2).
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass

log = logging.getLogger("v41.serve")

FORMAT_NAMES = {"deepseek_v41": "v41", "deepseek_v4": "v4-original"}  # flag value -> chat format revision
_FORMAT_FLAGS = (("--tokenizer-mode", "tokenizer_mode"), ("--tool-call-parser", "tool_call_parser"),
                 ("--reasoning-parser", "reasoning_parser"))
KERNEL_FLAGS = {"moe": ("--moe-backend", "moe_backend"), "attention": ("--attention-backend", "attention_backend")}
# Other engines' backend names (vLLM, SGLang, Aphrodite); matched case-insensitively.
PEER_BACKENDS = {
    "moe": ("b12x", "marlin", "cutlass", "deep_gemm", "flashinfer_cutlass", "flashinfer_trtllm", "aiter"),
    "attention": ("b12x_dsv41", "flashmla", "flashmla_sparse", "flashinfer_mla", "triton_mla", "flash_attn",
                  "flashinfer", "cutlass_mla"),
}
ATTENTION_CONFIG_KEYS = ("indexer_tp_shard_min_rows",)


class FlagError(ValueError):
    """A flag v41 cannot honour; the message names it."""


@dataclass(frozen=True)
class PeerSettings:
    """What the peer flags decided. ``chat_revision``: the chat format (None: the model's);
    ``kernel_env``: environment of the engine process and its workers; ``enable_auto_tool_choice``."""

    chat_revision: str | None
    kernel_env: dict[str, str]
    enable_auto_tool_choice: bool


def resolve(opts: argparse.Namespace, device: str) -> PeerSettings:
    """Check the peer flags of ``opts`` for ``device`` (``cpu``, ``cuda``, ``cuda:N``), log their warnings, and
    return what they decide. Raises FlagError."""
    settings = PeerSettings(chat_revision(opts), kernel_env(opts, device), opts.enable_auto_tool_choice)
    check_attention_config(opts.attention_config)
    check_speculative_config(opts.speculative_config)
    check_engram_config(opts.engram_config)
    if opts.trust_remote_code:
        log.info("--trust-remote-code: accepted; v41 runs no code from the model repository")
    if opts.enable_flashinfer_autotune is not None:
        flag = "--enable-flashinfer-autotune" if opts.enable_flashinfer_autotune else "--no-enable-flashinfer-autotune"
        log.warning("%s has no meaning for v41 (it uses no FlashInfer kernels); ignored", flag)
    if opts.mm_encoder_tp_mode is not None:
        log.warning("--mm-encoder-tp-mode %s has no meaning for v41 until it serves images (docs/model.md §3.10); "
                    "ignored", opts.mm_encoder_tp_mode)
    return settings


def chat_revision(opts: argparse.Namespace) -> str | None:
    """The chat format revision the format flags choose (None: the model's). FlagError for an unknown name or
    names that disagree."""
    chosen: dict[str, str] = {}
    for flag, attr in _FORMAT_FLAGS:
        name = getattr(opts, attr)
        if name is None or (attr == "tokenizer_mode" and name == "auto"):
            continue
        if name not in FORMAT_NAMES:
            known = list(FORMAT_NAMES) + (["auto"] if attr == "tokenizer_mode" else [])
            raise FlagError(f"{flag} {name!r}: unknown; v41 knows {', '.join(known)}")
        chosen[flag] = name
    if len(set(chosen.values())) > 1:
        given = ", ".join(f"{flag} {name}" for flag, name in chosen.items())
        raise FlagError(f"{given}: these choose different chat formats, and v41 encodes prompts and parses "
                        f"outputs in one format; give the same name")
    return FORMAT_NAMES[next(iter(chosen.values()))] if chosen else None


def kernel_env(opts: argparse.Namespace, device: str) -> dict[str, str]:
    """Environment variables selecting the kernel path of each op family the backend flags name
    (``kernels/dispatch.py``). FlagError for an unknown name or a path ``device`` cannot run."""
    from ..kernels.dispatch import FAMILY_ENV, MODES, available_modes

    env: dict[str, str] = {}
    for family, (flag, attr) in KERNEL_FLAGS.items():
        name = getattr(opts, attr)
        if name is None:
            continue
        mode = name.lower()
        if mode in PEER_BACKENDS[family]:
            log.warning("%s %s: v41 has no such kernels; it runs its own %s path 'auto' (its CUDA or Triton "
                        "kernels on CUDA, the PyTorch references on CPU)", flag, name, family)
            mode = "auto"
        elif mode not in MODES:
            raise FlagError(f"{flag} {name!r}: unknown; v41's paths are {', '.join(MODES)} (other engines' names "
                            f"{', '.join(PEER_BACKENDS[family])} select auto)")
        available = available_modes(device)
        if mode not in available:
            raise FlagError(f"{flag} {name!r} cannot run on {device} here (Triton kernels need Triton and a CUDA "
                            f"device; CUDA kernels also v41._cuda built for it, `make cuda`); available: "
                            f"{', '.join(available)}")
        env[FAMILY_ENV[family]] = mode
    return env


def check_speculative_config(config: dict | None) -> None:
    """Parse ``--speculative-config`` (FlagError naming the flag and the key) and warn once for each drafter
    kernel key: the drafter runs the target's kernel paths. FlagError for a kernel name no engine uses."""
    from ..engine.spec_config import SpeculativeConfig
    from ..kernels.dispatch import MODES

    try:
        spec = SpeculativeConfig.parse(config)
    except ValueError as e:
        raise FlagError(f"--speculative-config: {e}") from None
    if spec is None:
        return
    for family, key in (("moe", "moe_backend"), ("attention", "attention_backend")):
        name = getattr(spec, key)
        if name is None:
            continue
        if name.lower() not in (*MODES, *PEER_BACKENDS[family]):
            raise FlagError(f"--speculative-config: {key} {name!r} unknown; v41's paths are {', '.join(MODES)} "
                            f"(other engines' names {', '.join(PEER_BACKENDS[family])})")
        log.warning("--speculative-config %s %s: v41's drafter runs the target's %s kernel path (%s); ignored", key,
                    name, family, KERNEL_FLAGS[family][0])


def check_engram_config(config: dict | None) -> None:
    """Parse ``--engram-config`` (FlagError naming the flag and the key)."""
    from ..engine.engram_config import EngramConfig

    try:
        EngramConfig.parse(config)
    except ValueError as e:
        raise FlagError(f"--engram-config: {e}") from None


def check_attention_config(config: dict | None) -> None:
    """Check ``--attention-config`` (FlagError for an unknown key or a bad value) and say what it does."""
    if config is None:
        return
    unknown = [k for k in config if k not in ATTENTION_CONFIG_KEYS]
    if unknown:
        raise FlagError(f"--attention-config: unknown key {unknown[0]!r}; v41 knows {', '.join(ATTENTION_CONFIG_KEYS)}")
    rows = config.get("indexer_tp_shard_min_rows")
    if rows is not None:
        if type(rows) is not int or rows < 1:
            raise FlagError(f"--attention-config: indexer_tp_shard_min_rows must be a positive integer, got {rows!r}")
        log.warning("--attention-config indexer_tp_shard_min_rows=%d: v41 replicates the indexer on every "
                    "tensor-parallel rank (docs/architecture.md \"TP workers\"), so no step shards it; the value "
                    "has no effect", rows)
