"""The reference (oracle) forward of DeepSeek-V4 / V4.1: dense, unbatched, obvious (docs/numerics.md §4).

``load(path, dtype=torch.float32, device="cpu", numerics="exact")`` returns a :class:`Transformer` whose call
on input ids [B, T] gives logits [B, T, vocab]; :meth:`Transformer.forward_chunk` is the incremental path
and :meth:`Transformer.draft` runs one DSpark draft block. ``load(..., tp=group)`` builds one tensor-parallel
rank's shard (:mod:`.sharding`; the group is a :class:`v41.distributed.group.TPGroup`).
"""

from .loader import load
from .model import Transformer
from .state import RequestCache

__all__ = ["load", "Transformer", "RequestCache"]
