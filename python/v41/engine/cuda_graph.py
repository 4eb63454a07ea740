"""CUDA graphs for decode-only steps (DESIGN.md §3a; nano-vllm's ``capture_cudagraph`` and mini-sglang's graph
runner are the models): one graph per padded batch size, captured at start-up largest first into one shared
memory pool, replayed for every step whose requests each compute one token.

Each graph reads its own region of static inputs (token ids, positions, per-token request rows, cached lengths,
state rows, logits rows, block tables at full width, slot mappings, Engram rows, one-token compressor segments).
Each step packs its host plan padded to the graph's size into that region's pinned twin and copies it with one
non-blocking copy; padding rows are request-less: no block (tables and slots −1, so their writes go to the
cache's padding rows) and the padding state row. Prefill and mixed steps run eager (:mod:`.model_runner`).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from ..models.protocol import StepBatch
from .host_step import HostStep

log = logging.getLogger("v41.engine")
CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def capture_sizes(max_size: int) -> list[int]:
    """Padded batch sizes captured for ``--max-cudagraph-capture-size`` = ``max_size`` (itself included)."""
    sizes = [s for s in CAPTURE_SIZES if s < max_size]
    return sizes + [max_size]


class GraphInputs:
    """The static inputs of the graph of ``size`` rows: one device region and its pinned host twin.

    kinds: kind → table width; engram_cols: layer → columns; ratios: the model's segment ratios."""

    def __init__(self, size: int, kinds: dict[str, int], engram_cols: dict[int, int], ratios: list[int],
                 max_model_len: int, dummy_state_row: int, device: torch.device):
        self.size, self.max_model_len, self.dummy_state_row = size, max_model_len, dummy_state_row
        b = size
        self.fields: list[tuple[str, object, tuple[int, ...]]] = [
            ("token_ids", None, (b,)), ("positions", None, (b,)), ("req_index", None, (b,)), ("seq_lens", None, (b,)),
            ("state_rows", None, (b,)), ("logits_rows", None, (b,))]
        self.fields += [("block_tables", k, (b, w)) for k, w in kinds.items()]
        self.fields += [("slot_mapping", k, (b,)) for k in kinds]
        self.fields += [("engram_rows", lid, (b, c)) for lid, c in engram_cols.items()]
        self.fields += [("segments", r, (b, 1)) for r in ratios]
        n = sum(int(np.prod(s)) for *_, s in self.fields)
        cuda = torch.device(device).type == "cuda"
        self.host = torch.zeros(n, dtype=torch.int64, pin_memory=cuda)
        self.dev = torch.zeros(n, dtype=torch.int64, device=device) if cuda else self.host
        self._done: torch.cuda.Event | None = None
        self.views: dict[str, object] = {"block_tables": {}, "slot_mapping": {}, "engram_rows": {}, "segments": {}}
        self.offsets = []
        off = 0
        for name, key, shape in self.fields:
            size = int(np.prod(shape))
            t = self.dev[off:off + size].view(*shape)
            self.offsets.append((name, key, off, shape))
            if key is None:
                self.views[name] = t
            else:
                self.views[name][key] = t
            off += size
        self.fill(None)  # padding everywhere: what capture runs on

    def batch(self) -> StepBatch:
        """The static batch (what the graph captured)."""
        return StepBatch(max_seq_len=self.max_model_len, starts=None, **self.views)

    def fill(self, step: HostStep | None) -> None:
        """Pack ``step`` (R ≤ size requests, one token each; None = all padding) padded to ``size`` rows and copy
        it to the static inputs with one non-blocking copy."""
        r = 0 if step is None else step.num_requests
        if self._done is not None:
            self._done.synchronize()
        host = self.host.numpy()
        for name, key, off, shape in self.offsets:
            rows = host[off:off + int(np.prod(shape))].reshape(shape)
            rows[...] = self._padding(name, key, rows)
            if step is not None:
                self._copy_rows(rows, name, key, step, r)
        if self.dev is not self.host:
            self.dev.copy_(self.host, non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record()

    def _padding(self, name: str, key, rows: np.ndarray):
        if name in ("req_index", "logits_rows"):
            return np.arange(rows.shape[0])
        if name == "segments":
            return np.arange(rows.shape[0])[:, None]
        if name == "state_rows":
            return self.dummy_state_row
        if name == "seq_lens":
            return 1
        if name in ("block_tables", "slot_mapping"):
            return -1
        return 0

    @staticmethod
    def _copy_rows(rows: np.ndarray, name: str, key, step: HostStep, r: int) -> None:
        if name in ("req_index", "logits_rows", "segments"):
            return
        if name == "seq_lens":
            rows[:r] = step.start_pos + step.num_scheduled
        elif key is None:
            rows[:r] = getattr(step, name)
        else:
            src = getattr(step, name)[key]
            if src.ndim == 2:
                rows[:r, :src.shape[1]] = src
            else:
                rows[:r] = src


class CudaGraphRunner:
    """Captures ``model.forward`` on static inputs (``make_inputs(size)`` → :class:`GraphInputs`) for every size in
    ``sizes`` (largest first, one memory pool) and replays the smallest graph that fits a decode-only step."""

    def __init__(self, model, sizes: list[int], make_inputs):
        self.model = model
        self.sizes = sorted(sizes)
        self.inputs = {size: make_inputs(size) for size in self.sizes}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        pool = None
        for size in sorted(sizes, reverse=True):
            batch = self.inputs[size].batch()
            for _ in range(2):  # warm up: Triton compiles, the allocator settles
                model.forward(batch)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = model.forward(batch)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()
        log.info("captured CUDA graphs for decode batch sizes %s", self.sizes)

    def fits(self, step: HostStep) -> bool:
        """A decode-only step of at most the largest captured size whose logits rows are its requests' rows."""
        r = step.num_requests
        return (step.is_decode_only and not step.return_aux and r <= self.sizes[-1]
                and np.array_equal(step.logits_rows, np.arange(r)))

    def run(self, step: HostStep) -> torch.Tensor:
        """Logits [R, vocab] of a decode-only step (row r = request r)."""
        r = step.num_requests
        size = next(s for s in self.sizes if s >= r)
        self.inputs[size].fill(step)
        self.graphs[size].replay()
        return self.outputs[size][:r]
