"""Run pytest with kernel switches set (device calls that bisect a failure by switch):

    python3 benches/gpu/switch_pytest.py "v41.kernels.mhc.ONE_LAUNCH=False;v41.kernels.pdl.ENABLED=False" -- PYTEST_ARGS

Each ``MODULE.ATTR=VALUE`` (VALUE a Python literal) is set before the tests run in this process; the engine of
``v41.LLM`` runs in-process, so its kernels see them. Exits with pytest's status."""

from __future__ import annotations

import ast
import importlib
import sys

import pytest


def main() -> int:
    settings, args = sys.argv[1], sys.argv[sys.argv.index("--") + 1:]
    for item in filter(None, settings.split(";")):
        key, value = item.split("=", 1)
        module, attr = key.rsplit(".", 1)
        setattr(importlib.import_module(module), attr, ast.literal_eval(value))
        print(f"set {key} = {value}", flush=True)
    return pytest.main(args)


if __name__ == "__main__":
    raise SystemExit(main())
