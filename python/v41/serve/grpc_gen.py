"""Python stubs of ``proto/v41/v1/engine.proto``, generated with grpcio-tools; never edited, never committed.

The stubs live in ``python/v41/v1/`` (git-ignored): ``engine_pb2.py``, ``engine_pb2.pyi`` and
``engine_pb2_grpc.py``, importable as ``v41.v1.engine_pb2`` — the module path protoc derives from the proto
package ``v41.v1``, so the generated ``from v41.v1 import engine_pb2`` works unchanged. A marker file
``.engine.proto.sha256`` records the proto and grpcio-tools versions they came from.

Build step: ``make proto`` runs this file as a script (``python python/v41/serve/grpc_gen.py``; it imports
nothing from v41). At import, :func:`load` regenerates when it runs from a source tree whose proto changed or
was never compiled, so a fresh clone works with or without make; an installed wheel has no proto and uses
the stubs it shipped. Files are written to a temporary name and renamed, so concurrent processes
(pytest-xdist) never see a half-written module.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import sys
import tempfile
from pathlib import Path
from types import ModuleType

PYTHON_ROOT = Path(__file__).resolve().parents[2]  # python/ of a checkout, site-packages/ of a wheel
PROTO_ROOT = PYTHON_ROOT.parent / "proto"  # exists only in a source tree
PROTO_FILE = "v41/v1/engine.proto"
STUB_DIR = PYTHON_ROOT / "v41" / "v1"
MARKER = ".engine.proto.sha256"
STUB_FILES = ("engine_pb2.py", "engine_pb2.pyi", "engine_pb2_grpc.py")


def _source_key(proto: Path) -> str:
    """sha256 of the proto text and the generator version: stubs are current iff the marker holds it."""
    from importlib.metadata import version

    h = hashlib.sha256(proto.read_bytes())
    h.update(f"\0grpcio-tools={version('grpcio-tools')}".encode())
    return h.hexdigest()


def generate(out_root: Path = PYTHON_ROOT, proto_root: Path = PROTO_ROOT) -> Path:
    """Compile ``proto_root/v41/v1/engine.proto`` into ``out_root/v41/v1/`` (atomic per file); returns
    the stub directory. Raises RuntimeError when protoc fails, FileNotFoundError without the proto."""
    from grpc_tools import protoc

    proto = proto_root / PROTO_FILE
    if not proto.is_file():
        raise FileNotFoundError(f"{proto} not found: the gRPC stubs are generated from a source checkout")
    key = _source_key(proto)
    stub_dir = out_root / "v41" / "v1"
    stub_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".v41-proto-", dir=out_root) as tmp:
        include = Path(protoc.__file__).resolve().parent / "_proto"  # google/protobuf/*.proto
        argv = ["grpc_tools.protoc", f"-I{proto_root}", f"-I{include}", f"--python_out={tmp}",
                f"--pyi_out={tmp}", f"--grpc_python_out={tmp}", str(proto)]
        if protoc.main(argv) != 0:
            raise RuntimeError(f"protoc failed on {proto} (see the messages above)")
        for name in STUB_FILES:
            os.replace(Path(tmp) / "v41" / "v1" / name, stub_dir / name)
        marker = Path(tmp) / MARKER
        marker.write_text(key + "\n")
        os.replace(marker, stub_dir / MARKER)  # last: a marker means every stub file is in place
    return stub_dir


def stubs_current(out_root: Path = PYTHON_ROOT, proto_root: Path = PROTO_ROOT) -> bool:
    """True when the stubs exist and, in a source tree, were generated from the current proto."""
    stub_dir = out_root / "v41" / "v1"
    if not all((stub_dir / n).is_file() for n in STUB_FILES):
        return False
    proto = proto_root / PROTO_FILE
    if not proto.is_file():  # installed wheel: trust what shipped
        return True
    marker = stub_dir / MARKER
    return marker.is_file() and marker.read_text().strip() == _source_key(proto)


def load() -> tuple[ModuleType, ModuleType]:
    """``(engine_pb2, engine_pb2_grpc)``, generating them first when missing or stale.

    Raises ImportError (with the reason) when the stubs are missing and cannot be generated.
    """
    if not stubs_current():
        try:
            generate()
        except (OSError, RuntimeError, ImportError) as e:
            raise ImportError(f"v41 gRPC stubs are missing and could not be generated: {e}; "
                              "run `make proto` in a source checkout") from e
        for name in ("v41.v1.engine_pb2_grpc", "v41.v1.engine_pb2"):
            sys.modules.pop(name, None)
        importlib.invalidate_caches()
    pb2 = importlib.import_module("v41.v1.engine_pb2")
    pb2_grpc = importlib.import_module("v41.v1.engine_pb2_grpc")
    return pb2, pb2_grpc


def main() -> int:
    """``make proto``: regenerate when stale; prints the stub directory."""
    if stubs_current():
        (STUB_DIR / MARKER).touch()  # newer than the proto again, so make sees the target as made
        print(f"gRPC stubs up to date in {STUB_DIR}")
    else:
        print(f"generated gRPC stubs in {generate()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
