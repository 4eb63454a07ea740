"""Prompts as users give them (vLLM's text / token-id / dict prompts) → token ids and the prefix-cache salt, and
the one check of a request before it is queued (:func:`validate_request`).

Shared by ``v41.LLM`` (:mod:`.llm`), :class:`~.async_engine.AsyncEngine`, the CLI and the servers' engine client
(``serve/engine_client.py``), so every entry point tokenizes a prompt the same way.
"""

from __future__ import annotations

from .params import SamplingParams, check_request_options

PromptLike = str | list[int] | dict
PROMPT_KEYS = ("prompt", "prompt_token_ids", "cache_salt")  # vLLM's TextPrompt / TokensPrompt fields


def encode_prompt(core, prompt: PromptLike) -> tuple[str | None, list[int]]:
    """Text (BOS prepended, no chat template), token ids, or ``{"prompt": ...}`` / ``{"prompt_token_ids":
    ...}`` (optionally with ``"cache_salt"``, see :func:`prompt_cache_salt`) → (text or None, token ids).
    ``core``: anything with ``tokenizer`` (a ``tokenizers.Tokenizer``) and ``cfg.bos_token_id`` — the
    :class:`~.core.EngineCore` or the servers' engine client. Raises ValueError for anything else, naming unknown
    dict keys."""
    if isinstance(prompt, dict):
        unknown = sorted(str(k) for k in prompt if k not in PROMPT_KEYS)
        if unknown:
            raise ValueError(f"unknown prompt dict key(s) {unknown}; expected some of {list(PROMPT_KEYS)}")
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
        if "prompt" in prompt:
            prompt = prompt["prompt"]
        else:
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, str):
        ids = core.tokenizer.encode(prompt, add_special_tokens=False).ids if prompt else []
        return prompt, ([core.cfg.bos_token_id] + ids) if ids else []
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
        return None, list(prompt)
    raise ValueError(f"unsupported prompt type {type(prompt).__name__}")


def prompt_cache_salt(prompt: PromptLike, cache_salt: str | None) -> str | None:
    """The request's prefix-cache salt: the ``cache_salt`` argument or a prompt dict's ``"cache_salt"``
    (where vLLM takes it). Raises ValueError when both are given and differ."""
    inner = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if inner is None:
        return cache_salt
    if cache_salt is not None and cache_salt != inner:
        raise ValueError(f"cache_salt given twice: {cache_salt!r} as an argument, {inner!r} in the prompt dict")
    return inner


def validate_request(ids: list[int], params: SamplingParams, priority: object, cache_salt: object, vocab_size: int,
                     max_model_len: int, max_n: int) -> int:
    """Check one request as every entry point must before queueing it; returns its output budget in tokens
    (``params.max_tokens``, or all the room ``max_model_len`` leaves after the prompt when None).

    Raises ValueError naming the problem: bad ``priority`` / ``cache_salt`` (:func:`.params.check_request_options`),
    an empty prompt, ids outside ``[0, vocab_size)``, invalid sampling parameters (``n`` above ``max_n`` included),
    a prompt of ``max_model_len`` tokens or more, or prompt + max_tokens over ``max_model_len`` (counted in
    tokens)."""
    check_request_options(priority, cache_salt)
    if not ids:
        raise ValueError("the prompt is empty: give at least one token")
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise ValueError(f"prompt token ids must lie in [0, {vocab_size})")
    params.validate(vocab_size, max_n)
    if len(ids) >= max_model_len:
        raise ValueError(f"the prompt has {len(ids)} tokens; max_model_len is {max_model_len}")
    room = max_model_len - len(ids)
    max_tokens = room if params.max_tokens is None else params.max_tokens
    if max_tokens > room:
        raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds max_model_len "
                         f"({max_model_len})")
    return max_tokens
