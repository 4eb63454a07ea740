"""Conversions between ``v41.v1`` messages (``proto/v41/v1/engine.proto``) and the engine's Python types, for the
gRPC front end (``grpc_server.py``): sampling parameters in; logprobs and speculative-decoding counts out; request
bytes that are no valid message turned into a value the method answers with INVALID_ARGUMENT.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import DecodeError

from ..engine.params import SamplingParams
from ..engine.spec_stats import SpecDecodeStats
from .grpc_gen import load as _load_stubs

pb2, _ = _load_stubs()
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty")
_OPTIONAL_FIELDS = (*_FLOAT_FIELDS, "top_k", "seed", "max_tokens", "n", "logprobs", "prompt_logprobs",
                    "skip_special_tokens")


@dataclass(frozen=True)
class Undecodable:
    """Request bytes that are no valid message of the method's request type. The deserializer hands this to
    the method instead of raising, since grpc.aio answers a raising deserializer with UNKNOWN; the method
    ends the call with INVALID_ARGUMENT (issue 13 item 12)."""

    message: str


def lenient_parser(cls):
    """``cls.FromString``, except that undecodable bytes (bad wire format, bad UTF-8 in a string field) give an
    :class:`Undecodable` naming the type instead of raising ``DecodeError``."""
    def parse(data: bytes):
        try:
            return cls.FromString(data)
        except DecodeError as e:
            return Undecodable(f"the request is not a valid {cls.DESCRIPTOR.full_name} message: {e}")
    return parse


def sampling_params_from_proto(p) -> SamplingParams:
    """``v41.v1.SamplingParams`` → :class:`SamplingParams` (unset optional fields keep the defaults).

    float32 fields are rounded to 7 significant digits, so 0.7 on the wire is 0.7 again, not 0.69999999.
    """
    kw: dict[str, Any] = {}
    for name in _OPTIONAL_FIELDS:
        if p.HasField(name):
            v = getattr(p, name)
            kw[name] = float(f"{v:.7g}") if name in _FLOAT_FIELDS else v
    return SamplingParams(
        **kw, min_tokens=p.min_tokens, stop=list(p.stop) or None, stop_token_ids=list(p.stop_token_ids) or None,
        include_stop_str_in_output=p.include_stop_str_in_output, ignore_eos=p.ignore_eos,
        logit_bias={int(k): float(v) for k, v in p.logit_bias.items()} or None)


def json_list(text: str, name: str) -> list | None:
    if not text:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"chat.{name} is not valid JSON: {e}") from None
    if not isinstance(value, list):
        raise ValueError(f"chat.{name} must be a JSON array")
    return value


def logprobs_to_proto(entries, token_ids: list[int], top_n: int) -> list:
    """Per token ``{id: Logprob}`` (the token itself + the top-n) → ``TokenLogprob``; ``None`` entries
    (prompt position 0) are skipped."""
    out = []
    for entry, tok in zip(entries, token_ids):
        if entry is None:
            continue
        lp = entry.get(tok)
        tops = sorted((r for r in entry.items() if r[1].rank is not None and r[1].rank <= top_n),
                      key=lambda r: r[1].rank)
        out.append(pb2.TokenLogprob(
            token_id=tok, logprob=lp.logprob if lp else float("nan"), rank=(lp.rank or 0) if lp else 0,
            top_logprobs=[pb2.TopLogprob(token_id=t, logprob=x.logprob, rank=x.rank) for t, x in tops]))
    return out


def spec_decode_to_proto(stats: SpecDecodeStats):
    """``v41.v1.SpecDecodeStats`` of ``stats`` (the derived figures 0 where they are undefined)."""
    return pb2.SpecDecodeStats(
        drafted_tokens=stats.num_draft_tokens, accepted_tokens=stats.num_accepted_tokens,
        mean_acceptance_length=stats.mean_acceptance_length or 0.0, num_drafts=stats.num_drafts,
        accepted_per_position=stats.accepted_per_position, verified_per_position=stats.verified_per_position,
        acceptance_rate=stats.acceptance_rate or 0.0)
