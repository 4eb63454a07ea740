"""``POST /v1/completions``: legacy text completions of one or several prompts (text or token ids), with
echo and logprobs, answered as one JSON body or an SSE stream."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from ..engine.params import CompletionOutput, RequestOutput, SamplingParams
from . import http_schema as hs
from .errors import RequestError
from .generation import EventStream, Generation, prime_stream
from .openai_server import OpenAIServer


class TextCompletions:
    """The legacy completions endpoint of ``server``."""

    def __init__(self, server: OpenAIServer):
        self.server = server

    def completion_prompts(self, prompt: Any) -> list[tuple[str | None, list[int]]]:
        """(text or None, ids) per prompt; raises RequestError naming an empty prompt (KF-16)."""
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("prompt is empty: give at least one token", "prompt")
            return [(prompt, self.server.encode_text(prompt))]
        if not prompt:
            raise RequestError("prompt is empty: an empty list holds no tokens", "prompt")
        if all(isinstance(t, int) for t in prompt):
            return [(None, list(prompt))]
        out = []
        for i, p in enumerate(prompt):
            if not p:
                raise RequestError(f"prompt[{i}] is empty: give at least one token", "prompt")
            out.append((p, self.server.encode_text(p)) if isinstance(p, str) else (None, list(p)))
        return out

    async def create(self, req: hs.CompletionRequest, request: Request) -> Response:
        """Answer one completions request (JSON, or SSE when ``stream``)."""
        server = self.server
        arrival_s = time.monotonic()
        server.check_model(req.model)
        if req.suffix:
            raise RequestError("suffix is not supported", "suffix")
        if req.response_format is not None and req.response_format.get("type", "text") != "text":
            raise RequestError("response_format is supported by /v1/chat/completions only", "response_format")
        echo_lp = req.logprobs if req.echo and req.logprobs is not None else None
        sp = server.sampling_params(req, req.max_tokens, req.logprobs, prompt_logprobs=echo_lp)  # before tokenizing
        prompts = self.completion_prompts(req.prompt)
        for i, (_, ids) in enumerate(prompts):
            server.check_prompt(ids, sp, "prompt" if len(prompts) == 1 else f"prompt[{i}]")
        rid = f"cmpl-{uuid.uuid4().hex}"
        gen = server.start(rid, prompts, sp, arrival_s, req)
        choices: dict[int, CompletionChoice] = {}

        def choice(p: int, out: RequestOutput, c: CompletionOutput) -> CompletionChoice:
            key = p * sp.n + c.index
            if key not in choices:
                choices[key] = CompletionChoice(key, self.echo(prompts[p], out, sp) if req.echo else None)
            return choices[key]

        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            await prime_stream(gen, request)
            return EventStream(self._events(gen, rid, sp, choices, choice, include_usage), gen,
                               server.error_event)

        await gen.drain(request, choice)
        out = []
        for k, st in sorted(choices.items()):
            lp = None
            if sp.logprobs is not None:
                lp = _join_logprobs(st.echo_logprobs(sp.logprobs, server.decode_token),
                                    st.new_logprobs(st.ids, st.lps, sp.logprobs, server.decode_token))
            out.append(hs.CompletionChoice(index=k, text=st.echo_text + st.text, logprobs=lp,
                                           finish_reason=st.finish_reason, stop_reason=st.stop_reason))
        resp = hs.CompletionResponse(id=rid, model=server.served_model_name, choices=out,
                                     usage=gen.usage(choices.values()))
        return Response(resp.model_dump_json(), media_type="application/json")

    def echo(self, prompt: tuple[str | None, list[int]], out: RequestOutput,
             sp: SamplingParams) -> tuple[str, list[int], list | None]:
        """(echo text, echo token ids, echo logprob entries or None) of one prompt; the BOS this server added
        to a text prompt is not echoed."""
        text, ids = prompt
        skip = 1 if text is not None else 0
        if text is None:
            text = self.server.tokenizer.decode(ids, skip_special_tokens=sp.skip_special_tokens)
        entries = None if out.prompt_logprobs is None else list(out.prompt_logprobs)[skip:]
        return text, ids[skip:], entries

    async def _events(self, gen: Generation, rid: str, sp: SamplingParams, choices: dict[int, CompletionChoice],
                      choice, include_usage: bool) -> AsyncIterator[str]:
        server = self.server
        created, model = int(time.time()), server.served_model_name

        def event(c: hs.CompletionChoice | None, usage: hs.Usage | None = None) -> str:
            chunk = hs.CompletionResponse(id=rid, created=created, model=model, choices=[] if c is None else [c],
                                          usage=usage)
            return f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"

        while (item := await gen.next()) is not None:
            p, out = item
            for c in out.outputs:
                st = choice(p, out, c)
                if st.done:
                    continue
                first = not st.started
                text = st.feed(c)
                lp = None
                if sp.logprobs is not None:
                    lp = st.new_logprobs(list(c.token_ids), c.logprobs or [], sp.logprobs, server.decode_token)
                    if first:
                        lp = _join_logprobs(st.echo_logprobs(sp.logprobs, server.decode_token), lp)
                if first:
                    text = st.echo_text + text
                if text or (lp is not None and lp.tokens) or st.done:
                    yield event(hs.CompletionChoice(index=st.index, text=text, logprobs=lp,
                                                    finish_reason=st.finish_reason, stop_reason=st.stop_reason))
        if include_usage:
            yield event(None, gen.usage(choices.values()))


class CompletionChoice:
    """One legacy completion: its text, ids, logprobs, and the echoed prompt (text, ids, logprob entries)."""

    def __init__(self, index: int, echo: tuple[str, list[int], list | None] | None):
        self.index = index
        self.echo_text, self.echo_ids, self.echo_entries = echo or ("", [], None)
        self.text = ""
        self.ids: list[int] = []
        self.lps: list = []
        self.started = False
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self._offset = len(self.echo_text)

    @property
    def done(self) -> bool:
        """The completion has finished (its last delta was fed)."""
        return self.finish_reason is not None

    def feed(self, c: CompletionOutput) -> str:
        """Account one delta; returns its new text."""
        self.started = True
        self.text += c.text
        self.ids += c.token_ids
        if c.logprobs:
            self.lps += c.logprobs
        if c.finish_reason is not None:
            self.finish_reason, self.stop_reason = c.finish_reason, c.stop_reason
        return c.text

    def echo_logprobs(self, n: int, decode) -> hs.CompletionLogprobs | None:
        """Logprobs of the echoed prompt (top ``n``), None without echo or prompt logprobs."""
        if not self.echo_ids or self.echo_entries is None:
            return None
        return hs.completion_logprobs(self.echo_ids, self.echo_entries, n, decode)

    def new_logprobs(self, ids: list[int], entries: list, n: int, decode) -> hs.CompletionLogprobs:
        """Logprobs of newly generated ``ids`` (top ``n``), text offsets continuing after what was sent."""
        lp = hs.completion_logprobs(ids, entries, n, decode, text_offset_0=self._offset)
        self._offset += sum(len(t) for t in lp.tokens)
        return lp


def _join_logprobs(a: hs.CompletionLogprobs | None, b: hs.CompletionLogprobs) -> hs.CompletionLogprobs:
    if a is None:
        return b
    return hs.CompletionLogprobs(text_offset=a.text_offset + b.text_offset,
                                 token_logprobs=a.token_logprobs + b.token_logprobs,
                                 tokens=a.tokens + b.tokens, top_logprobs=a.top_logprobs + b.top_logprobs)
