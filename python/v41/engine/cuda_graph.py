"""CUDA graphs for decode-only steps (docs/architecture.md §3a; nano-vllm's ``capture_cudagraph`` and mini-sglang's graph
runner are the models): one graph per padded batch size, captured at start-up largest first into one shared
memory pool, replayed for every step whose requests each compute one token.

Each graph reads its own region of static inputs (token ids, positions, per-token request rows, cached lengths,
state rows, logits rows, block-table rows, a fixed-size block-table diff per kind, slot mappings, Engram rows,
one-token compressor segments). Each step packs its host plan padded to the graph's size into that region's pinned
twin and copies it with one non-blocking copy; the graph itself applies the diff to the persistent tables and
gathers its rows at full width (:mod:`.block_tables`) before the forward. Padding rows are request-less: the
tables' padding row (all −1) and slots −1, so their writes go to the cache's padding rows, and the padding state
row; unused diff entries write −1 into the padding row. A step whose diff exceeds the region (many admissions
into one-token steps) runs eager, as do prefill and mixed steps (:mod:`.model_runner`).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from ..models.protocol import StepBatch
from .block_tables import DeviceBlockTables
from .host_step import HostStep

log = logging.getLogger("v41.engine")
CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def capture_sizes(max_size: int) -> list[int]:
    """Padded batch sizes captured for ``--max-cudagraph-capture-size`` = ``max_size`` (itself included)."""
    sizes = [s for s in CAPTURE_SIZES if s < max_size]
    return sizes + [max_size]


class GraphInputs:
    """The static inputs of the graph of ``size`` rows: one device region and its pinned host twin.

    tables: the persistent block tables; block_tables: kind → [≥ size, width] static gather target shared by every
    size (graphs replay one at a time); engram_cols: layer → columns; ratios: the model's segment ratios."""

    def __init__(self, size: int, tables: DeviceBlockTables, block_tables: dict[str, torch.Tensor],
                 engram_cols: dict[int, int], ratios: list[int], max_model_len: int, dummy_state_row: int,
                 device: torch.device):
        self.size, self.max_model_len, self.dummy_state_row = size, max_model_len, dummy_state_row
        self.tables = tables
        self.block_tables = {k: t[:size] for k, t in block_tables.items()}
        self.diff_capacity = 2 * size + 16  # per kind: a new block and a released window block per request
        b = size
        self.fields: list[tuple[str, object, tuple[int, ...]]] = [
            ("token_ids", None, (b,)), ("positions", None, (b,)), ("req_index", None, (b,)), ("seq_lens", None, (b,)),
            ("state_rows", None, (b,)), ("logits_rows", None, (b,)), ("table_rows", None, (b,))]
        self.fields += [("table_diffs", k, (3, self.diff_capacity)) for k in tables.widths]
        self.fields += [("slot_mapping", k, (b,)) for k in tables.widths]
        self.fields += [("engram_rows", lid, (b, c)) for lid, c in engram_cols.items()]
        self.fields += [("segments", r, (b, 1)) for r in ratios]
        n = sum(int(np.prod(s)) for *_, s in self.fields)
        cuda = torch.device(device).type == "cuda"
        self.host = torch.zeros(n, dtype=torch.int64, pin_memory=cuda)
        self.dev = torch.zeros(n, dtype=torch.int64, device=device) if cuda else self.host
        self._done: torch.cuda.Event | None = None
        self.views: dict[str, object] = {"table_diffs": {}, "slot_mapping": {}, "engram_rows": {}, "segments": {}}
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
        self._padding_image = np.empty(n, dtype=np.int64)  # every field's padding, restored by one copy per step
        for name, key, off, shape in self.offsets:
            rows = self._padding_image[off:off + int(np.prod(shape))].reshape(shape)
            rows[...] = self._padding(name, key, rows)
        self.fill(None)  # padding everywhere: what capture runs on

    def fits(self, step: HostStep) -> bool:
        """Every kind's block-table diff fits the static region."""
        return all(d.shape[1] <= self.diff_capacity for d in step.table_diffs.values())

    def prologue(self) -> None:
        """Apply the static diff and gather the static rows (device work, captured with the forward)."""
        for k, diff in self.views["table_diffs"].items():
            self.tables.apply(k, diff)
            self.tables.gather_into(k, self.views["table_rows"], self.block_tables[k])

    def batch(self) -> StepBatch:
        """The static batch (what the graph captured)."""
        views = {k: v for k, v in self.views.items() if k not in ("table_rows", "table_diffs")}
        return StepBatch(max_seq_len=self.max_model_len, starts=None, block_tables=self.block_tables, **views)

    def fill(self, step: HostStep | None) -> None:
        """Pack ``step`` (R ≤ size requests, one token each; None = all padding) padded to ``size`` rows and copy
        it to the static inputs with one non-blocking copy."""
        r = 0 if step is None else step.num_requests
        for k, diff in ({} if step is None else step.table_diffs).items():
            self.tables.check(k, diff)
        if self._done is not None:
            self._done.synchronize()
        host = self.host.numpy()
        host[:] = self._padding_image
        if step is not None:
            for name, key, off, shape in self.offsets:
                self._copy_rows(host[off:off + int(np.prod(shape))].reshape(shape), name, key, step, r)
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
        if name == "table_rows":
            return self.tables.padding_row
        if name == "table_diffs":  # write −1 into the padding row's first column
            return np.array([[self.tables.padding_row], [0], [-1]])
        if name == "seq_lens":
            return 1
        if name == "slot_mapping":
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
        elif name == "table_diffs":
            src = step.table_diffs[key]
            rows[:, :src.shape[1]] = src
        else:
            rows[:r] = getattr(step, name)[key]


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
            prologue = self.inputs[size].prologue
            for _ in range(2):  # warm up: Triton compiles, the allocator settles
                prologue()
                model.forward(batch)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                prologue()
                self.outputs[size] = model.forward(batch)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()
        log.info("captured CUDA graphs for decode batch sizes %s", self.sizes)

    def fits(self, step: HostStep) -> bool:
        """A decode-only step of at most the largest captured size whose logits rows are its requests' rows."""
        r = step.num_requests
        return (step.is_decode_only and not step.return_aux and r <= self.sizes[-1]
                and np.array_equal(step.logits_rows, np.arange(r)) and self.inputs[self._size(r)].fits(step))

    def _size(self, r: int) -> int:
        return next(s for s in self.sizes if s >= r)

    def run(self, step: HostStep) -> torch.Tensor:
        """Logits [R, vocab] of a decode-only step (row r = request r)."""
        r = step.num_requests
        size = self._size(r)
        self.inputs[size].fill(step)
        self.graphs[size].replay()
        return self.outputs[size][:r]
