"""``v41.LLM``: offline batched generation (vLLM's ``LLM`` API)."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

from tqdm import tqdm

from .args import EngineArgs
from .core import EngineCore
from .output import OutputAccumulator
from .params import RequestOutput, SamplingParams
from .prompts import PromptLike, encode_prompt, prompt_cache_salt


def model_or_embedded(model: str | None) -> str:
    """``model`` as a string, or the embedded tiny V4.1 model's directory (shipped with the package,
    :mod:`v41.testing.embedded`) for None."""
    if model is not None:
        return str(model)
    from ..testing.embedded import embedded_model_dir

    return str(embedded_model_dir())


class LLM:
    """Offline engine. ``model``: checkpoint directory (None = the embedded tiny V4.1 model, trained for
    an hour on Python code: :mod:`v41.testing.embedded`). Other keyword arguments are :class:`EngineArgs` fields (max_model_len, max_num_seqs,
    max_num_batched_tokens, enable_prefix_caching, dtype, device, kv_cache_bytes, ...)."""

    def __init__(self, model: str | None = None, **kwargs: Any):
        self.engine = EngineCore(EngineArgs(model=model_or_embedded(model), **kwargs))

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes (TP > 1); also done at interpreter exit."""
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def get_tokenizer(self):
        """The ``tokenizers.Tokenizer`` of the model."""
        return self.engine.tokenizer

    def generate(self, prompts: PromptLike | Seq[PromptLike],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True, *, priority: int | Seq[int] = 0,
                 cache_salt: str | None = None) -> list[RequestOutput]:
        """Generate for every prompt; returns one finished RequestOutput per prompt, in input order.

        sampling_params: one for all prompts or one per prompt (default: ``SamplingParams()``). priority: one
        for all prompts or one per prompt, lower runs first (vLLM's convention; matters when the batch is
        full). cache_salt: prefix-cache namespace of these requests (:meth:`EngineCore.add_request`); a prompt
        dict may carry its own ``"cache_salt"`` instead (vLLM's form). Raises
        ValueError (nothing is generated) if any prompt, parameter set or priority is invalid.
        """
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                 and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) \
            else list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling parameter sets for {len(prompts)} prompts")
        priorities = list(priority) if isinstance(priority, (list, tuple)) else [priority] * len(prompts)
        if len(priorities) != len(prompts):
            raise ValueError(f"{len(priorities)} priorities for {len(prompts)} prompts")
        core = self.engine
        base = f"gen{id(self)}-{len(core.requests)}-"
        ids = [f"{base}{i}" for i in range(len(prompts))]
        added = []
        try:
            for rid, prompt, p, prio in zip(ids, prompts, params, priorities):
                text, tokens = encode_prompt(core, prompt)
                core.add_request(rid, tokens, p, prompt=text, priority=prio,
                                 cache_salt=prompt_cache_salt(prompt, cache_salt))
                added.append(rid)
        except ValueError:
            for rid in added:
                core.abort_request(rid)
            raise
        results: dict[str, RequestOutput] = {}
        acc = OutputAccumulator()
        wanted = set(ids)
        with tqdm(total=len(ids), disable=not use_tqdm, desc="Generating", unit="req") as bar:
            while len(results) < len(ids):
                for out in core.step():
                    if out.request_id not in wanted:
                        continue
                    acc.add(out)
                    if out.finished:
                        results[out.request_id] = acc.pop(out.request_id)
                        bar.update(1)
        return [results[rid] for rid in ids]
