"""KF-17 against a real ``v41-serve`` process: 200 requests cancelled mid-generation (streaming and not)
leave no running request and zero used cache blocks (prefix caching off, so every block must come back)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from v41.testing.tiny import make_tiny

pytestmark = pytest.mark.timeout(180)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric(text: str, name: str, label: str = "") -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and label in line and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ckpt = make_tiny(tmp_path_factory.mktemp("m"), "deepseek_v41")
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "v41.serve.cli", "--model", str(ckpt), "--port", str(port), "--max-num-seqs", "16",
         "--no-enable-prefix-caching", "--block-size", "16", "--kv-cache-bytes", str(16 << 20)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        else:
            pytest.fail("v41-serve did not become healthy")
        yield base
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def test_kf17_two_hundred_cancelled_requests_leave_zero_used_blocks(server):
    model = httpx.get(f"{server}/v1/models").json()["data"][0]["id"]
    body = {"model": model, "prompt": "Hello there", "max_tokens": 4000, "ignore_eos": True}
    for i in range(200):
        if i % 2 == 0:  # streaming: read one event, then drop the connection
            with httpx.stream("POST", f"{server}/v1/completions", json={**body, "stream": True}, timeout=30) as r:
                assert r.status_code == 200
                next(r.iter_lines())
        else:  # non-streaming: the client gives up while the request runs
            with pytest.raises(httpx.TimeoutException):
                httpx.post(f"{server}/v1/completions", json=body, timeout=0.05)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        text = httpx.get(f"{server}/metrics").text
        busy = metric(text, "v41_num_requests_running") + metric(text, "v41_num_requests_waiting")
        used = metric(text, "v41_kv_cache_usage_ratio")
        if busy == 0 and used == 0:
            break
        time.sleep(0.2)
    assert busy == 0, "requests still running after their clients left"
    assert used == 0, f"cache blocks still used: {used}"
    finished = httpx.post(f"{server}/v1/completions", json={**body, "max_tokens": 4}, timeout=30)
    assert finished.status_code == 200 and finished.json()["choices"][0]["finish_reason"] == "length"
    assert re.search(r"v41_requests_total\{.*abort", httpx.get(f"{server}/metrics").text)
