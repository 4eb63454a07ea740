"""The core of the OpenAI HTTP front end shared by its routes: engine access, health, the metrics scrape,
error mapping, prompt checks, sampling parameters, and starting a :class:`Generation`."""

from __future__ import annotations

import inspect
import json
import logging
import time
from typing import Any

from fastapi.responses import JSONResponse, Response

from ..engine.params import SamplingParams, check_request_options
from . import http_schema as hs
from .errors import ClientDisconnected, ModelNotFoundError, RequestError, error_status, openai_error_body
from .generation import Generation
from .metrics import ServerMetrics
from .validation import engine_max_n

log = logging.getLogger("v41.serve")

_SAMPLING_FIELDS = {f for f in SamplingParams.__dataclass_fields__}


class OpenAIServer:
    """The state behind the routes: the engine, the served name, the metrics."""

    def __init__(self, engine: Any, served_model_name: str, heartbeat_timeout_s: float):
        self.engine = engine
        self.served_model_name = served_model_name
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.metrics = ServerMetrics()

    # -- engine accessors ----------------------------------------------------------------------------------
    @property
    def tokenizer(self):
        """The engine's ``tokenizers.Tokenizer``."""
        return self.engine.tokenizer

    @property
    def cfg(self):
        """The engine's ``v41.config.ModelConfig``."""
        return self.engine.cfg

    @property
    def max_model_len(self) -> int:
        """Longest prompt + output, in tokens."""
        return int(self.engine.max_model_len)

    def engine_alive(self) -> tuple[bool, str]:
        """(alive, why not): running, and the last heartbeat (when the engine reports one) is fresh."""
        running = getattr(self.engine, "is_running", True)
        if callable(running):
            running = running()
        if not running:
            return False, "the engine is not running"
        beat = getattr(self.engine, "last_heartbeat_s", None)
        if callable(beat):
            beat = beat()
        if beat is not None and time.monotonic() - beat > self.heartbeat_timeout_s:
            return False, f"no engine heartbeat for {time.monotonic() - beat:.1f} s"
        return True, ""

    async def stats(self) -> dict | None:
        """The engine's ``stats()`` (sync or async); None if it has none."""
        fn = getattr(self.engine, "stats", None)
        if fn is None:
            return None
        res = fn()
        return await res if inspect.isawaitable(res) else res

    async def scrape(self) -> tuple[bytes, str]:
        """The ``/metrics`` page (Prometheus text, content type), with the engine's figures when it is alive."""
        alive, _ = self.engine_alive()
        stats = None
        if alive:
            try:
                stats = await self.stats()
            except Exception:  # noqa: BLE001 - a scrape must answer even if the engine just died
                log.warning("engine stats failed during a metrics scrape", exc_info=True)
                alive = False
        self.metrics.update_engine(stats, alive)
        return self.metrics.render()

    # -- errors -------------------------------------------------------------------------------------------
    def error_response(self, exc: BaseException) -> JSONResponse:
        """``exc`` as an OpenAI error body with its mapped HTTP status (``errors.error_status``); counted."""
        status = error_status(exc)
        self.metrics.record_error(status.http_status)
        if status.http_status >= 500:
            log.error("request failed: %s", exc, exc_info=status.http_status == 500)
        return JSONResponse(openai_error_body(exc, status), status_code=status.http_status)

    def error_event(self, exc: BaseException) -> str:
        """``exc`` as the SSE ``{"error": ...}`` event that ends a stream already under way; counted."""
        status = error_status(exc)
        self.metrics.record_error(status.http_status)
        log.log(logging.ERROR if status.http_status >= 500 else logging.INFO, "stream failed: %s", exc,
                exc_info=status.http_status == 500)
        return f"data: {json.dumps(openai_error_body(exc, status))}\n\n"

    async def guard(self, coro) -> Response:
        """Await a route body; any error becomes its one mapped response, a gone client a 499."""
        try:
            return await coro
        except ClientDisconnected:
            self.metrics.record_error(499)
            return Response(status_code=499)
        except Exception as e:  # noqa: BLE001 - every error becomes one mapped response
            return self.error_response(e)

    def check_model(self, model: str | None) -> None:
        """ModelNotFoundError (404) unless ``model`` is None or the served model's name."""
        if model is not None and model != self.served_model_name:
            raise ModelNotFoundError(model, self.served_model_name)

    # -- prompts and parameters ------------------------------------------------------------------------
    def encode_text(self, text: str) -> list[int]:
        """BOS + the text's tokens ([] for ""), as ``v41.engine.prompts.encode_prompt``."""
        if not text:
            return []
        return [self.cfg.bos_token_id] + self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode_token(self, tok: int) -> str:
        """The text of one token id, special tokens included (for logprob entries)."""
        return self.tokenizer.decode([tok], skip_special_tokens=False)

    def check_prompt(self, ids: list[int], params: SamplingParams, what: str) -> None:
        """RequestError naming field ``what`` for an empty prompt, or one that (with max_tokens) does not fit
        max_model_len."""
        mml = self.max_model_len
        if not ids:
            raise RequestError(f"{what} is empty: give at least one token", what)
        if len(ids) >= mml:
            raise RequestError(f"{what} has {len(ids)} tokens; max_model_len is {mml}", what)
        if params.max_tokens is not None and len(ids) + params.max_tokens > mml:
            raise RequestError(f"{what} ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                               f"max_model_len ({mml})", "max_tokens")

    def sampling_params(self, req: hs.SamplingFields, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """SamplingParams of a request, validated (RequestError naming the field → 400; ``n`` is bounded by the
        engine's ``max_n``)."""
        bias = None
        if req.logit_bias:
            try:
                bias = {int(k): float(v) for k, v in req.logit_bias.items()}
            except ValueError:
                raise RequestError("logit_bias keys must be token ids", "logit_bias") from None
        sp = SamplingParams(
            n=req.n, temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=-1 if req.top_k is None else req.top_k,
            min_p=req.min_p or 0.0, presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            seed=req.seed, stop=req.stop, stop_token_ids=req.stop_token_ids,
            include_stop_str_in_output=req.include_stop_str_in_output, ignore_eos=req.ignore_eos,
            max_tokens=max_tokens, min_tokens=req.min_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            skip_special_tokens=req.skip_special_tokens, logit_bias=bias)
        try:
            sp.validate(self.cfg.vocab_size, engine_max_n(self.engine))
        except ValueError as e:
            field = str(e).split(" ", 1)[0]
            raise RequestError(str(e), field if field in _SAMPLING_FIELDS else None) from None
        return sp

    def start(self, request_id: str, prompts: list[tuple[str | None, list[int]]], params: SamplingParams,
              arrival_s: float, req: hs.SamplingFields) -> Generation:
        """Submit one engine request per prompt (ids ``request_id``, or ``request_id-i`` for several), with the
        request's ``priority`` and ``cache_salt`` (RequestError naming a bad one → 400)."""
        try:
            check_request_options(req.priority, req.cache_salt)
        except ValueError as e:
            raise RequestError(str(e), str(e).split(" ", 1)[0]) from None
        subs = [(request_id if len(prompts) == 1 else f"{request_id}-{i}", {"prompt": text,
                 "prompt_token_ids": ids}) for i, (text, ids) in enumerate(prompts)]
        return Generation(self.engine, self.metrics, subs, params, arrival_s,
                          {"priority": req.priority, "cache_salt": req.cache_salt})
