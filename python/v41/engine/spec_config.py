"""Speculative decoding options (issue 15): ``--speculative-config`` of ``v41-serve`` and ``speculative_config=``
of :class:`v41.LLM` / :class:`v41.AsyncEngine` (an :class:`~v41.engine.args.EngineArgs` field), spelt as vLLM and
the seed spell them::

    {"method": "dspark", "num_speculative_tokens": 5, "draft_tensor_parallel_size": 1,
     "draft_sample_method": "probabilistic", "rejection_sample_method": "block",
     "enable_adaptive_verification": false}

Two checks, both raising ``ValueError`` whose message names the key (``speculative_config.<key>``) and what is
allowed: :meth:`SpeculativeConfig.parse` (shape, types and values; unknown keys are errors, never dropped) when the
options are given, and :meth:`SpeculativeConfig.check` against the checkpoint's :class:`~v41.config.ModelConfig`
and the target's tensor-parallel size before any weight is loaded (``EngineCore.__init__``, and ``v41-serve``
before it starts the engine). The engine reads K from :attr:`SpeculativeConfig.num_speculative_tokens` and the
drafter's TP size from :meth:`SpeculativeConfig.draft_tp`. The math behind the option values:
docs/speculative-decoding.md "Verification".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..config import ModelConfig
from .json_options import parse_options

METHODS = ("dspark",)
DRAFT_SAMPLE_METHODS = ("probabilistic", "greedy")
REJECTION_SAMPLE_METHODS = ("block", "token", "greedy")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Validated speculative-decoding options; constructing one with a bad value raises ``ValueError``.

    method: ``"dspark"``, the checkpoint's DSpark drafter (``mtp.0..S-1``, docs/model.md §3.9), the only method
    (default). num_speculative_tokens: K, draft tokens verified per step, an int ≥ 1 and at most the checkpoint's
    ``dspark_block_size`` (:meth:`check`); a K below the block size verifies a prefix of the drafted block, which
    is lossless. **Required**, as in vLLM: it sets the verify cost of every step, so no model-dependent default
    is guessed. draft_tensor_parallel_size: ranks the drafter's stages are split over, 1 or the target's TP size;
    None (default) = the target's (:meth:`draft_tp`). With 1 under TP > 1 every rank holds and runs the whole
    stages (no all-reduce inside them, more memory); the embedding and LM head they share with the target stay
    vocab-parallel (one all-reduce and one all-gather per draft pass). draft_sample_method: how drafts are drawn, ``"probabilistic"`` (default:
    keyed draws from the drafter's processed distribution Q) or ``"greedy"`` (argmax).
    rejection_sample_method: how the target verifies them: ``"block"`` (default, the seed's: Sun et al.'s
    block verification, lossless and never accepting fewer tokens on average than token-wise), ``"token"``
    (Leviathan / Chen token-wise) or ``"greedy"`` (a draft is accepted iff it is the target's argmax; exact for
    greedy requests only). enable_adaptive_verification: verify a per-request prefix of the block chosen from
    the drafter's confidences and a start-up profile of verify costs (``engine/adaptive_verify.py``); default
    False. moe_backend / attention_backend:
    the drafter's kernel paths as the seed's command spells them (``"b12x"``, ``"B12X_DSV41"``, ...); v41's
    drafter runs the target's kernel paths (``--moe-backend`` / ``--attention-backend``), so the engine does not
    read them; ``v41-serve`` checks the names and warns (``serve/compat.py``).
    """

    num_speculative_tokens: int
    method: str = "dspark"
    draft_tensor_parallel_size: int | None = None
    draft_sample_method: str = "probabilistic"
    rejection_sample_method: str = "block"
    enable_adaptive_verification: bool = False
    moe_backend: str | None = None
    attention_backend: str | None = None

    def __post_init__(self) -> None:
        _require(_is_int(self.num_speculative_tokens) and self.num_speculative_tokens >= 1,
                 "num_speculative_tokens", "an integer >= 1", self.num_speculative_tokens)
        _one_of("method", self.method, METHODS)
        dtp = self.draft_tensor_parallel_size
        _require(dtp is None or (_is_int(dtp) and dtp >= 1), "draft_tensor_parallel_size",
                 "an integer >= 1 (1 or the target's tensor_parallel_size) or null", dtp)
        _one_of("draft_sample_method", self.draft_sample_method, DRAFT_SAMPLE_METHODS)
        _one_of("rejection_sample_method", self.rejection_sample_method, REJECTION_SAMPLE_METHODS)
        _require(isinstance(self.enable_adaptive_verification, bool), "enable_adaptive_verification",
                 "true or false", self.enable_adaptive_verification)
        for key in ("moe_backend", "attention_backend"):
            value = getattr(self, key)
            _require(value is None or (isinstance(value, str) and value != ""), key, "a kernel path name or null",
                     value)

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """The options from a JSON object string (``--speculative-config``), a dict, or an instance (returned as
        is); None stays None (no speculation). Raises ValueError for text that is not a JSON object, an unknown
        key (naming it and the known ones), a missing ``num_speculative_tokens``, a value of the wrong type
        (``5.0`` and ``"5"`` are not integers, ``1`` is not a boolean) or outside the allowed values."""
        return parse_options(cls, "speculative_config", value, required={
            "num_speculative_tokens": "the number K of draft tokens verified per step (at most the checkpoint's "
                                      "dspark_block_size)"})

    def check(self, cfg: ModelConfig, tensor_parallel_size: int) -> None:
        """Check the options against the checkpoint ``cfg`` served at ``tensor_parallel_size`` ranks. Raises
        ValueError when the checkpoint has no DSpark draft stages, when K exceeds its ``dspark_block_size``
        (naming both numbers), and when ``draft_tensor_parallel_size`` is neither 1 nor ``tensor_parallel_size``."""
        if not cfg.has_dspark:
            raise ValueError(
                f"speculative_config.method 'dspark' needs a checkpoint with DSpark draft stages, and this one has "
                f"none (model_type {cfg.arch}, num_nextn_predict_layers {cfg.num_nextn_predict_layers}, "
                f"dspark_block_size {cfg.dspark_block_size}); drop speculative_config or serve a DeepSeek-V4.1 "
                f"checkpoint with its drafter")
        k, block = self.num_speculative_tokens, cfg.dspark_block_size
        if k > block:
            raise ValueError(f"speculative_config.num_speculative_tokens {k} exceeds the checkpoint's DSpark block "
                             f"size (dspark_block_size {block}); use 1..{block} (a shorter K verifies a prefix of "
                             f"the drafted block, which is lossless)")
        dtp = self.draft_tensor_parallel_size
        if dtp is not None and dtp not in (1, tensor_parallel_size):
            raise ValueError(f"speculative_config.draft_tensor_parallel_size {dtp} must be 1 or the target's "
                             f"tensor_parallel_size ({tensor_parallel_size})")

    def draft_tp(self, tensor_parallel_size: int) -> int:
        """Ranks the drafter runs on when the target runs on ``tensor_parallel_size`` (None resolved)."""
        return tensor_parallel_size if self.draft_tensor_parallel_size is None else self.draft_tensor_parallel_size


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _require(ok: bool, key: str, allowed: str, value: Any) -> None:
    if not ok:
        raise ValueError(f"speculative_config.{key} must be {allowed}, got {value!r}")


def _one_of(key: str, value: Any, allowed: tuple[str, ...]) -> None:
    _require(isinstance(value, str) and value in allowed, key, "one of " + ", ".join(repr(a) for a in allowed),
             value)
