"""Messages between the front end (:class:`~v41.serve.engine_client.EngineClient`) and the engine-core
process (:mod:`v41.serve.engine_proc`), and their one msgpack codec (docs/style.md §7).

Wire format: ``msgpack([tag, field1, field2, ...])`` with the fields in dataclass order; ``tag`` is the
message type's index in :data:`MESSAGE_TYPES` (both ends run the same package, so no versioning).
Maps may have integer keys (``logit_bias``, logprob maps), hence ``strict_map_key=False`` on decode.

Direction and meaning:

* front end → engine: :class:`AddRequest`, :class:`Abort`, :class:`StatsRequest`, :class:`Shutdown`.
* engine → front end: :class:`Ready` / :class:`StartupFailed` (once, at start-up), :class:`Outputs` (one per
  engine step: the step's per-request *deltas*), :class:`Error` (a request was refused; nothing else is sent
  for it), :class:`Heartbeat` (every ``HEARTBEAT_INTERVAL_S`` from a thread of its own while the engine loop is
  not wedged), :class:`StatsReply`.

:class:`~v41.engine.params.SamplingParams` and :class:`~v41.engine.params.RequestOutput` travel as plain dicts
(:func:`params_to_dict` / :func:`params_from_dict`, :func:`output_to_dict` / :func:`output_from_dict`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import msgpack
import zmq

from ..engine.params import CompletionOutput, Logprob, RequestMetrics, RequestOutput, SamplingParams
from ..engine.spec_stats import SpecDecodeStats

HEARTBEAT_INTERVAL_S = 0.5


# -- front end → engine --------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class AddRequest:
    """Enqueue a request. ``prompt_token_ids`` are already tokenized by the front end; ``prompt`` is the text
    (None for token input); ``params`` is :func:`params_to_dict` output; ``priority`` (lower runs first) and
    ``cache_salt`` as in ``EngineCore.add_request``."""

    request_id: str
    prompt_token_ids: list[int]
    params: dict
    prompt: str | None = None
    priority: int = 0
    cache_salt: str | None = None


@dataclass(frozen=True, slots=True)
class Abort:
    """End a request now; the engine answers with its terminal delta (finish reason ``abort``) if it knew
    the request."""

    request_id: str


@dataclass(frozen=True, slots=True)
class StatsRequest:
    """Ask for scheduler stats + engine info; answered by a :class:`StatsReply` with the same ``token``."""

    token: int


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Abort every request (terminal deltas are sent), stop the loop and exit with status 0."""


# -- engine → front end --------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Ready:
    """The engine core loaded the model and runs its loop. ``info``: what front ends need besides the model
    config (read from ``model_dir``), :func:`v41.engine.info.engine_info` of the core: arch, vocab_size,
    bos/eos/pad ids, block_tokens, kinds, num_blocks, max_num_seqs, max_num_batched_tokens,
    enable_prefix_caching, dtype, device, numerics, tensor_parallel_size, engine_args, ..."""

    pid: int
    model_dir: str
    tokenizer_path: str
    max_model_len: int
    info: dict


@dataclass(frozen=True, slots=True)
class StartupFailed:
    """The engine core could not start (bad model directory, bad options, out of memory...)."""

    error_type: str
    message: str


@dataclass(frozen=True, slots=True)
class Outputs:
    """The deltas of one engine step: a list of :func:`output_to_dict` dicts without prompt fields (the
    front end has them), each completion holding only its new text / token ids / logprobs and
    ``prompt_logprobs`` holding only new entries; ``metrics``: the request's ``RequestMetrics`` fields so far
    (``time.time()`` seconds: arrival at the engine, first scheduled, first/last token, finished)."""

    outputs: list[dict]


@dataclass(frozen=True, slots=True)
class Error:
    """A request was refused. ``kind``: ``invalid`` (bad input: the front end raises ValueError) or
    ``internal`` (an engine bug: RuntimeError)."""

    request_id: str
    kind: str
    message: str


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Sign of life, every ``HEARTBEAT_INTERVAL_S`` while the loop is not wedged (engine_proc module doc).

    num_steps: steps run so far. busy_s: seconds the current loop iteration (drain + step) has run, 0 when
    idle. stats: scheduler stats + engine info as of the last step (the fallback of a stats request that a
    long step delays).
    """

    num_steps: int
    busy_s: float
    stats: dict = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class StatsReply:
    token: int
    stats: dict


MESSAGE_TYPES: tuple[type, ...] = (AddRequest, Abort, StatsRequest, Shutdown, Ready, StartupFailed, Outputs,
                                   Error, Heartbeat, StatsReply)
Message = (AddRequest | Abort | StatsRequest | Shutdown | Ready | StartupFailed | Outputs | Error | Heartbeat
           | StatsReply)
_TAG = {cls: i for i, cls in enumerate(MESSAGE_TYPES)}
_FIELDS = {cls: tuple(f.name for f in fields(cls)) for cls in MESSAGE_TYPES}


class ProtocolError(ValueError):
    """Bytes that are not a message of :data:`MESSAGE_TYPES` (a bug or a foreign peer)."""


def encode(msg: Message) -> bytes:
    """One message → bytes. Raises TypeError for a field msgpack cannot represent."""
    cls = type(msg)
    return msgpack.packb([_TAG[cls], *(getattr(msg, f) for f in _FIELDS[cls])], use_bin_type=True)


def decode(data: bytes) -> Message:
    """Bytes → one message. Raises ProtocolError for anything else."""
    try:
        tag, *values = msgpack.unpackb(data, raw=False, strict_map_key=False)
        return MESSAGE_TYPES[tag](*values)
    except (ValueError, TypeError, IndexError, msgpack.UnpackException) as e:
        raise ProtocolError(f"undecodable engine message: {e}") from e


def drain(sock: zmq.Socket, log: logging.Logger, source: str,
          on_receive: Callable[[], object] | None = None) -> Iterator[Message]:
    """The messages waiting on ``sock`` now, in order, without blocking (stops when none is left).
    ``on_receive`` runs for every message received, decodable or not; an undecodable one is logged on
    ``log`` (naming ``source``) and skipped. Errors: ``zmq.ZMQError`` from the socket."""
    while True:
        try:
            data = sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return
        if on_receive is not None:
            on_receive()
        try:
            msg = decode(data)
        except ProtocolError:
            log.exception("dropping an undecodable message from %s", source)
            continue
        yield msg


# -- plain-dict forms of the request types ---------------------------------------------------------------------
_PARAM_FIELDS = tuple(f.name for f in fields(SamplingParams))


def params_to_dict(p: SamplingParams) -> dict:
    """SamplingParams → a dict of its fields (lists for tuples)."""
    d = {name: getattr(p, name) for name in _PARAM_FIELDS}
    for name in ("stop", "stop_token_ids"):
        if isinstance(d[name], tuple):
            d[name] = list(d[name])
    return d


def params_from_dict(d: dict) -> SamplingParams:
    """Inverse of :func:`params_to_dict`; unknown keys raise ValueError."""
    unknown = set(d) - set(_PARAM_FIELDS)
    if unknown:
        raise ValueError(f"unknown sampling parameters: {sorted(unknown)}")
    return SamplingParams(**d)


def _lp_to_wire(entry: dict[int, Logprob] | None) -> dict | None:
    if entry is None:
        return None
    return {int(t): [lp.logprob, lp.rank, lp.decoded_token] for t, lp in entry.items()}


def _lp_from_wire(entry: dict | None) -> dict[int, Logprob] | None:
    if entry is None:
        return None
    return {int(t): Logprob(v[0], v[1], v[2]) for t, v in entry.items()}


def completion_to_dict(c: CompletionOutput) -> dict:
    return {"index": c.index, "text": c.text, "token_ids": list(c.token_ids),
            "cumulative_logprob": c.cumulative_logprob,
            "logprobs": None if c.logprobs is None else [_lp_to_wire(e) for e in c.logprobs],
            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
            "spec_decode": None if c.spec_decode is None else c.spec_decode.to_dict()}


def completion_from_dict(d: dict) -> CompletionOutput:
    return CompletionOutput(index=d["index"], text=d["text"], token_ids=d["token_ids"],
                            cumulative_logprob=d["cumulative_logprob"],
                            logprobs=None if d["logprobs"] is None else [_lp_from_wire(e) for e in d["logprobs"]],
                            finish_reason=d["finish_reason"], stop_reason=d["stop_reason"],
                            spec_decode=None if d.get("spec_decode") is None
                            else SpecDecodeStats.from_dict(d["spec_decode"]))


def output_to_dict(out: RequestOutput, with_prompt: bool = True) -> dict:
    """RequestOutput → dict. ``with_prompt=False`` leaves out ``prompt`` and
    ``prompt_token_ids`` (the receiver knows them: :func:`output_from_dict` takes them as arguments)."""
    d = {"request_id": out.request_id,
         "prompt_logprobs": None if out.prompt_logprobs is None else [_lp_to_wire(e) for e in out.prompt_logprobs],
         "outputs": [completion_to_dict(c) for c in out.outputs], "finished": out.finished,
         "num_cached_tokens": out.num_cached_tokens,
         "metrics": None if out.metrics is None else asdict(out.metrics)}
    if with_prompt:
        d["prompt"] = out.prompt
        d["prompt_token_ids"] = list(out.prompt_token_ids)
    return d


def output_from_dict(d: dict, prompt: str | None = None, prompt_token_ids: list[int] | None = None,
                     prompt_logprobs: list[Any] | None = None) -> RequestOutput:
    """Inverse of :func:`output_to_dict`. ``prompt`` / ``prompt_token_ids`` fill in what the dict lacks;
    ``prompt_logprobs``, when given, replaces the dict's (the receiver's accumulated list)."""
    if prompt_logprobs is None and d.get("prompt_logprobs") is not None:
        prompt_logprobs = [_lp_from_wire(e) for e in d["prompt_logprobs"]]
    return RequestOutput(request_id=d["request_id"], prompt=d.get("prompt", prompt),
                         prompt_token_ids=d.get("prompt_token_ids", prompt_token_ids or []),
                         prompt_logprobs=prompt_logprobs,
                         outputs=[completion_from_dict(c) for c in d["outputs"]], finished=d["finished"],
                         num_cached_tokens=d["num_cached_tokens"],
                         metrics=None if d.get("metrics") is None else RequestMetrics(**d["metrics"]))


def prompt_logprobs_from_wire(entries: list | None) -> list[dict[int, Logprob] | None]:
    """Wire prompt-logprob entries → Logprob maps (None stays None)."""
    return [_lp_from_wire(e) for e in entries or []]


def env_seconds(name: str, default: float) -> float:
    """A positive number of seconds from the environment variable ``name`` (``default`` when unset).
    Raises ValueError naming the variable for anything else."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {raw!r}")
    return value
