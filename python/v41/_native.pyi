"""Type stubs for ``v41._native``, the Rust extension module (crate ``v41-py``)."""

__version__: str
"""Version of the Rust crate; equals ``v41.__version__``."""

def build_info() -> dict[str, str]:
    """Return how this extension was built.

    Keys: ``version``, ``profile`` (``debug``/``release``), ``target`` (target triple),
    ``rustc`` (``rustc --version`` or ``unknown``), ``git_commit`` (hash or ``unknown``).
    """
