"""Helpers of the tests that run ``v41-serve`` as a process: start it in a session of its own with its log in a
file, wait until it listens (HTTP or gRPC), and always kill it and its engine core at the end."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Served:
    """A running ``v41-serve``: its process, port, log file and engine-core pid."""

    proc: subprocess.Popen
    port: int
    log_path: Path
    engine_pid: int

    @property
    def base(self) -> str:
        """The HTTP base URL."""
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        """The server's log (stdout and stderr) so far."""
        return self.log_path.read_text(errors="replace")


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


@contextmanager
def serve(ckpt: Path, log_path: Path, *flags: str, timeout_s: float = 90.0,
          positional: bool = False) -> Iterator[Served]:
    """Run ``v41-serve --model ckpt --device cpu --port <free> *flags`` (``v41-serve ckpt ...`` with
    ``positional``) until the block ends; yields once it listens (it printed its ``try:`` line). Fails the test
    with the log when it exits or does not listen within ``timeout_s``. The server and its engine core are
    SIGKILLed at the end if still alive, and its IPC socket folder removed."""
    import pytest

    port = free_port()
    model = [str(ckpt)] if positional else ["--model", str(ckpt)]
    cmd = [sys.executable, "-m", "v41.serve.cli", *model, "--device", "cpu", "--port", str(port), *flags]
    # The server's IPC socket folder (serve/engine_client.py) goes under a folder of this test's, removed at the end:
    # a SIGKILLed server cannot remove its own. Short, for the 107-byte limit of a Unix socket path.
    tmp = tempfile.mkdtemp(prefix="v41t-")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": tmp}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    engine_pid = None
    try:
        deadline = time.monotonic() + timeout_s
        while "v41-serve: try:" not in (text := log_path.read_text(errors="replace")):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"v41-serve did not start (status {proc.poll()}):\n{text[-4000:]}")
            time.sleep(0.2)
        engine_pid = int(re.search(r"engine core ready \(pid (\d+)\)", text).group(1))
        yield Served(proc, port, log_path, engine_pid)
    finally:
        _kill_group(proc.pid)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        if engine_pid is not None:
            _kill_group(engine_pid)
        shutil.rmtree(tmp, ignore_errors=True)
