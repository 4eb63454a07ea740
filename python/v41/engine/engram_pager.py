"""Engram offload paging on one rank (docs/engram.md): each step's table rows → device slots, misses copied in.

For every Engram layer of the fast model whose table is in host memory (``FastEngram.host``) a
:class:`LayerPager` owns the device slots (``hot`` cached + ``staging`` per-step, one record each) and the crate's
slot cache (``v41._native.EngramSlotCache``: CLOCK, rows of an in-flight step pinned). :meth:`EngramPager.prepare`
runs when the step is scheduled, before the forward: it plans every layer (the rank's hash columns of the step's
rows → slot ids, plus the copy list of misses), copies the misses into their slots and hands the model a step whose
``engram_rows[layer]`` are slot ids ``[T, cols_local]``.

``transfer`` ``uva`` (CUDA): the copy list travels with the step (``engram_copies[layer]`` [2, M], packed into the
step's one input copy, a graph input under CUDA graphs) and the forward itself launches the fill
(:meth:`v41.models.fast.engram.FastEngram.start_fill`: one Triton launch reading the pinned records over UVA,
:func:`v41.kernels.engram_fill.fill_slots_uva`) on a side stream forked at the start of the forward, joined just
before the Engram layer: layer 1's rows arrive while the embedding and layer 0 run, and nothing of it is host work
inside the step. ``copy``: here, before the forward, the records are gathered on the host into a pinned staging
buffer, copied in one transfer and scattered into their slots on a side stream ordered after all earlier work of
the compute stream (so a slot an earlier step reads is never overwritten under it); the compute stream waits for
them before the forward. On a CPU device ``copy`` copies directly and ``uva`` (never the default there) runs the
same in-forward path with the PyTorch gather, so CI exercises it.

Counters (:meth:`EngramPager.stats`, summed over layers): ``lookups`` (distinct rows per step and layer), ``hits``,
``misses`` (= copies), ``evictions``, and ``copy_seconds``: host time spent planning and issuing the copies (the
time a step waits before its forward starts).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from torch import Tensor

from .. import _native
from ..kernels.dispatch import triton
from .engram_config import EngramConfig
from .host_step import HostStep

PARALLEL_PLAN_TOKENS = 256  # steps of at least this many tokens plan their layers on threads


class LayerPager:
    """Slots and slot cache of one Engram layer (``engram``: a FastEngram with ``host`` set)."""

    def __init__(self, engram, hot_rows: int, staging_rows: int, transfer: str, device: torch.device):
        self.engram, self.device = engram, device
        host = engram.host
        self.records: Tensor = host.records
        self.cache = _native.EngramSlotCache(hot_rows, staging_rows, host.row1 - host.row0)
        b = host.fmt.record_bytes
        engram.slots = torch.zeros(self.cache.hot_rows + staging_rows, b, dtype=torch.uint8, device=device)
        self.staging_host, self._copied = None, None
        if device.type == "cuda" and transfer == "copy":
            self.staging_host = torch.empty(staging_rows, b, dtype=torch.uint8, pin_memory=True)
        if device.type == "cuda" and transfer == "uva":
            if triton is None:
                raise ValueError("engram_config.transfer 'uva' needs Triton (its fill kernel); use 'copy'")
            if not self.records.is_pinned():
                raise RuntimeError("Engram offload transfer 'uva' needs the host table pinned")
            engram.fill_stream = torch.cuda.Stream(device)

    def plan(self, step_id: int, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """rows int64 [T, cols] (full table rows) → (slot ids [T, cols_local], copy rows [M] local, copy slots [M])."""
        eng = self.engram
        local = np.ascontiguousarray(rows[:, eng.col0:eng.col1]) - eng.row0
        slots, copy_rows, copy_slots = self.cache.plan(step_id, local.reshape(-1))
        return slots.reshape(local.shape), copy_rows, copy_slots

    def fill(self, copy_rows: np.ndarray, copy_slots: np.ndarray) -> None:
        """Copy records ``copy_rows`` into ``copy_slots`` now (``copy`` transfer, on the current stream)."""
        if copy_rows.size == 0:
            return
        slots = self.engram.slots
        if self.device.type != "cuda":
            slots[torch.from_numpy(copy_slots)] = self.records[torch.from_numpy(copy_rows)]
            return
        dst = torch.from_numpy(copy_slots).to(self.device, non_blocking=True)
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's transfer still reads the staging buffer
        staged = self.staging_host[: copy_rows.size]
        torch.index_select(self.records, 0, torch.from_numpy(copy_rows), out=staged)
        slots.index_copy_(0, dst, staged.to(self.device, non_blocking=True))
        self._copied = torch.cuda.Event()
        self._copied.record()


class EngramPager:
    """Every offloaded Engram layer of ``model`` on this rank. ``max_step_tokens``: the most tokens one step
    schedules (staging slots per layer = that × the rank's columns)."""

    def __init__(self, model, config: EngramConfig, max_step_tokens: int, device: str):
        self.device = torch.device(device)
        transfer = config.resolved_transfer()
        self.layers: dict[int, LayerPager] = {}
        for plan, layer in zip(model.cfg.plan, model.layers):
            eng = getattr(layer, "engram", None) if plan.engram else None
            if eng is None or eng.host is None:
                continue
            cols = eng.col1 - eng.col0
            staging = max_step_tokens * cols
            hot = config.resolved_hot_rows(eng.host.fmt.record_bytes, staging, eng.row1 - eng.row0)
            self.layers[plan.layer_id] = LayerPager(eng, hot, staging, transfer, self.device)
        self.transfer = transfer
        self.in_forward = transfer == "uva"  # the forward fills (module docstring)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" and not self.in_forward else None
        self._step = 0
        self._in_flight: int | None = None
        self.copy_seconds = 0.0
        self.steps = 0
        self._pool = ThreadPoolExecutor(len(self.layers), "v41-engram") if len(self.layers) > 1 else None

    def local_columns(self) -> dict[int, int]:
        """Engram layer → this rank's hash columns (the width of the slot ids the model reads)."""
        return {lid: p.engram.col1 - p.engram.col0 for lid, p in self.layers.items()}

    def prepare(self, step: HostStep) -> HostStep:
        """Plan and copy every layer's rows of ``step``; the step with slot ids as its Engram rows. Raises
        ValueError (from the slot cache) for a row outside this rank's table."""
        t0 = time.perf_counter()
        self.release()
        self._step += 1
        self._in_flight = self._step  # a layer whose plan fails holds nothing; those that planned are released next
        slot_ids, copies = {}, {}
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        plans = self._plan_all(step)
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            for lid, pager in self.layers.items():
                ids, copy_rows, copy_slots = plans[lid]
                if self.in_forward:
                    copies[lid] = np.stack([copy_rows, copy_slots])
                else:
                    pager.fill(copy_rows, copy_slots)
                slot_ids[lid] = ids
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        self.copy_seconds += time.perf_counter() - t0
        self.steps += 1
        return dataclasses.replace(step, engram_rows={**step.engram_rows, **slot_ids}, engram_copies=copies)

    def _plan_all(self, step: HostStep) -> dict:
        """Every layer's plan of ``step``; a large step plans the layers on threads at once (the crate releases the
        GIL: a 4,096-token chunk that misses is ~10 ms per layer)."""
        if self._pool is None or step.num_tokens < PARALLEL_PLAN_TOKENS:
            return {lid: p.plan(self._step, step.engram_rows[lid]) for lid, p in self.layers.items()}
        futures = {lid: self._pool.submit(p.plan, self._step, step.engram_rows[lid]) for lid, p in self.layers.items()}
        return {lid: f.result() for lid, f in futures.items()}

    def release(self) -> None:
        """The previous step's forward is enqueued: unpin its slots (later copies are ordered after it)."""
        if self._in_flight is not None:
            for pager in self.layers.values():
                with contextlib.suppress(ValueError):  # a layer whose plan failed has nothing in flight
                    pager.cache.release(self._in_flight)
            self._in_flight = None

    def stats(self) -> dict:
        """Counters summed over layers (module docstring)."""
        total = {"lookups": 0, "hits": 0, "misses": 0, "evictions": 0}
        for pager in self.layers.values():
            s = pager.cache.stats()
            for k in total:
                total[k] += s[k]
        return {**total, "copy_seconds": self.copy_seconds, "steps": self.steps, "transfer": self.transfer,
                "hot_rows": {lid: p.cache.hot_rows for lid, p in self.layers.items()}}

    def close(self) -> None:
        """Stop the planning threads; unregister and unmap the host tables (idempotent)."""
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        for pager in self.layers.values():
            pager.engram.host.close()
