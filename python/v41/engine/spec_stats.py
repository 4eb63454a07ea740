"""Speculative-decoding counters (docs/speculative-decoding.md "Metrics"; vLLM's ``SpecDecodingStats`` names).

One :class:`SpecDecodeStats` per sequence: the engine sets ``seq.spec_decode = SpecDecodeStats.empty(K)`` when it
admits a sequence while speculating and calls :meth:`SpecDecodeStats.add_block` once per verify step of that
sequence. The outputs carry a copy (``CompletionOutput.spec_decode``, cumulative: every delta holds the counts so
far, so the last one holds the request's), and the engine core adds finished and running sequences up into the
server-wide figures of ``EngineCore.stats()["spec_decode"]`` (gRPC ``GetLoads``, Prometheus ``v41_spec_decode_*``).

Definitions: a *draft* is a verify step with at least one draft token; *draft tokens* are the verified ones
(k per step, k ≤ K; a shorter k under adaptive verification counts k); *accepted* tokens are the ones the verifier
accepted (τ), counted before the stop checker cuts the step's tokens, prefill excluded. Position i (0-based) is
the i-th draft token of a block: ``verified_per_position[i]`` steps verified it, ``accepted_per_position[i]``
accepted it. Acceptance rate is pooled over draft tokens (accepted / draft tokens), not a mean of per-request
rates; mean acceptance length is 1 + accepted / drafts (tokens committed per verify step, the target's own
token included). Cost: O(K) per call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


@dataclass(slots=True)
class SpecDecodeStats:
    """Counts of one sequence, or of many added up (module doc). ``accepted_per_position`` /
    ``verified_per_position``: [K] ints, position 0 first."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    verified_per_position: list[int] = field(default_factory=list)

    @classmethod
    def empty(cls, num_speculative_tokens: int) -> SpecDecodeStats:
        """Zero counts for K = ``num_speculative_tokens`` positions. Raises ValueError for K < 1."""
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        return cls(accepted_per_position=[0] * num_speculative_tokens,
                   verified_per_position=[0] * num_speculative_tokens)

    @property
    def num_speculative_tokens(self) -> int:
        """K: the positions counted."""
        return len(self.verified_per_position)

    def add_block(self, verified: int, accepted: int) -> None:
        """Count one verify step of one sequence: ``verified`` draft tokens k (0 ≤ k ≤ K; 0 = a plain step,
        counted nowhere) of which the first ``accepted`` a (0 ≤ a ≤ k) were accepted. Raises ValueError for
        values outside those ranges (an engine bug)."""
        if not 0 <= accepted <= verified <= len(self.verified_per_position):
            raise ValueError(f"add_block: need 0 <= accepted ({accepted}) <= verified ({verified}) <= K "
                             f"({len(self.verified_per_position)})")
        if verified:
            self.num_drafts += 1
        self.num_draft_tokens += verified
        self.num_accepted_tokens += accepted
        for i in range(verified):
            self.verified_per_position[i] += 1
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    def merge(self, other: SpecDecodeStats) -> None:
        """Add ``other``'s counts to these (another sequence's, or a server's total). Per-position lists of
        different lengths are added position by position, the shorter one padded with zeros."""
        for name in COUNTERS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.accepted_per_position = _add(self.accepted_per_position, other.accepted_per_position)
        self.verified_per_position = _add(self.verified_per_position, other.verified_per_position)

    def since(self, earlier: SpecDecodeStats) -> SpecDecodeStats:
        """The counts added after ``earlier``, an older snapshot of these counters (each counter only grows)."""
        return SpecDecodeStats(*(getattr(self, n) - getattr(earlier, n) for n in COUNTERS),
                               accepted_per_position=_add(self.accepted_per_position, earlier.accepted_per_position,
                                                          -1),
                               verified_per_position=_add(self.verified_per_position, earlier.verified_per_position,
                                                          -1))

    def copy(self) -> SpecDecodeStats:
        """An independent snapshot (the lists copied)."""
        return SpecDecodeStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                               list(self.accepted_per_position), list(self.verified_per_position))

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / draft tokens, pooled; None before any draft token."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """1 + accepted / drafts: tokens committed per verify step; None before any draft."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    def to_dict(self) -> dict:
        """The counters and both derived figures as a JSON object (HTTP ``usage.spec_decode``, engine stats)."""
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "accepted_per_position": list(self.accepted_per_position),
                "verified_per_position": list(self.verified_per_position),
                "acceptance_rate": self.acceptance_rate, "mean_acceptance_length": self.mean_acceptance_length}

    @classmethod
    def from_dict(cls, d: dict) -> SpecDecodeStats:
        """Inverse of :meth:`to_dict` (the derived figures are recomputed, not read). Raises KeyError for a
        missing counter."""
        return cls(*(int(d[n]) for n in COUNTERS), accepted_per_position=[int(x) for x in d["accepted_per_position"]],
                   verified_per_position=[int(x) for x in d["verified_per_position"]])


def _add(a: list[int], b: list[int], sign: int = 1) -> list[int]:
    """``a + sign * b`` position by position, the shorter list padded with zeros."""
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) + sign * (b[i] if i < len(b) else 0) for i in range(n)]
