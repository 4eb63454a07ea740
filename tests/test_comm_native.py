"""v41._native.HostComm (crate v41-comm) across spawned processes: the all-reduce is the fixed-order float32
sum on every rank, byte for byte, whatever the chunking; all-gather and broadcast move any size; a killed or
lagging rank is an error naming it and the operation, within the deadline. Every wait here is bounded and
every spawned process is killed in a ``finally``."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import time

import numpy as np
import pytest

from v41._native import CommError, HostComm

pytestmark = pytest.mark.timeout(120)

CTX = mp.get_context("spawn")
COLLECTIVE_TIMEOUT_S = 30.0  # workers' default deadline: far above what any test needs
WAIT_S = 60.0  # how long the parent waits for all results


# ----------------------------------------------------------------------------------------- spawned ranks


def _job_all_reduce(comm: HostComm, arg):
    buf, dtype = arg
    comm.all_reduce(buf, dtype)
    return buf


def _job_all_gather(comm: HostComm, inp):
    out = np.zeros(comm.world_size * len(inp), dtype=np.uint8)
    comm.all_gather(inp, out)
    return out


def _job_broadcast(comm: HostComm, arg):
    root, data = arg
    return comm.broadcast(data if comm.rank == root else None, root=root)


def _job_sleep(comm: HostComm, seconds):
    time.sleep(seconds)  # joined, alive, but never calls the collective
    return None


def _job_all_reduce_timed(comm: HostComm, timeout_s):
    start = time.monotonic()
    try:
        comm.all_reduce(np.ones(1000, dtype=np.float32), "float32", timeout_s=timeout_s)
    except CommError as e:
        return ("CommError", str(e), time.monotonic() - start)
    return ("ok", "", time.monotonic() - start)


def _job_recv_forever(comm: HostComm, _):
    try:
        comm.broadcast(None, root=0, timeout_s=None)  # an idle worker waiting for the next step
    except CommError as e:
        return ("CommError", str(e), 0.0)
    return ("ok", "", 0.0)


JOBS = {
    "all_reduce": _job_all_reduce,
    "all_gather": _job_all_gather,
    "broadcast": _job_broadcast,
    "sleep": _job_sleep,
    "all_reduce_timed": _job_all_reduce_timed,
    "recv_forever": _job_recv_forever,
}


def _rank_main(path: str, rank: int, world: int, lane_bytes: int, job: str, arg, results) -> None:
    try:
        comm = HostComm(path, rank, world, lane_bytes=lane_bytes, timeout_s=COLLECTIVE_TIMEOUT_S)
        results.put((rank, "joined", os.getpid()))
        results.put((rank, "ok", JOBS[job](comm, arg)))
        comm.close()
    except BaseException as e:  # reported to the parent, which fails the test
        results.put((rank, "err", f"{type(e).__name__}: {e}"))


class Ranks:
    """``world`` spawned ranks, each running ``jobs[r]`` with ``args[r]``; killed on exit."""

    def __init__(self, path, world: int, jobs: list[str], args: list, lane_bytes: int = 1 << 20):
        self.results = CTX.Queue()
        self.procs = [
            CTX.Process(target=_rank_main, args=(str(path), r, world, lane_bytes, jobs[r], args[r], self.results),
                        daemon=True)
            for r in range(world)
        ]
        self.pids: dict[int, int] = {}
        self.out: dict[int, object] = {}

    def __enter__(self):
        for p in self.procs:
            p.start()
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(5)

    def wait(self, ranks, what: str = "ok", timeout_s: float = WAIT_S) -> None:
        """Collect ``what`` messages from ``ranks``; a rank's error fails the test."""
        deadline = time.monotonic() + timeout_s
        store = self.pids if what == "joined" else self.out
        while not all(r in store for r in ranks):
            try:
                rank, kind, value = self.results.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"ranks {sorted(set(ranks) - set(store))} gave no '{what}' in {timeout_s} s")
            if kind == "err":
                raise AssertionError(f"rank {rank} failed: {value}")
            (self.pids if kind == "joined" else self.out)[rank] = value


def run(path, world: int, job: str, args: list, lane_bytes: int = 1 << 20) -> list:
    with Ranks(path, world, [job] * world, args, lane_bytes) as ranks:
        ranks.wait(range(world))
        return [ranks.out[r] for r in range(world)]


# ----------------------------------------------------------------------------------------- references


def _f32_inputs(world: int, n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    # Magnitudes from 1e-3 to 1e3, so the order of the additions shows in the bits.
    return [(rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4, n)).astype(np.float32) for _ in range(world)]


def _f32_reference(inputs: list[np.ndarray]) -> np.ndarray:
    acc = inputs[0].copy()
    for x in inputs[1:]:
        acc = acc + x  # float32, rank order
    return acc


def _bf16_inputs(world: int, n: int, seed: int) -> list[np.ndarray]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=g) * 3).to(torch.bfloat16).view(torch.int16).numpy().copy()
            for _ in range(world)]


def _bf16_reference(inputs: list[np.ndarray]) -> np.ndarray:
    import torch

    xs = [torch.from_numpy(x).view(torch.bfloat16).float() for x in inputs]
    acc = xs[0]
    for x in xs[1:]:
        acc = acc + x  # float32, rank order; one rounding at the end
    return acc.to(torch.bfloat16).view(torch.int16).numpy()


# ----------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("world", [2, 4])
def test_all_reduce_float32_is_the_fixed_order_sum_on_every_rank(tmp_path, world):
    inputs = _f32_inputs(world, 3001, seed=world)
    outs = run(tmp_path / "seg", world, "all_reduce", [(x, "float32") for x in inputs])
    expected = _f32_reference(inputs).tobytes()
    assert all(o.tobytes() == expected for o in outs)


@pytest.mark.parametrize("world", [2, 4])
def test_all_reduce_bfloat16_rounds_the_float32_sum_once_on_every_rank(tmp_path, world):
    inputs = _bf16_inputs(world, 2049, seed=world)
    outs = run(tmp_path / "seg", world, "all_reduce", [(x, "bfloat16") for x in inputs])
    expected = _bf16_reference(inputs).tobytes()
    assert all(o.dtype == np.int16 and o.tobytes() == expected for o in outs)


def test_all_reduce_bytes_do_not_depend_on_lane_size(tmp_path):
    inputs = _f32_inputs(3, 5000, seed=11)
    chunked = run(tmp_path / "a", 3, "all_reduce", [(x, "float32") for x in inputs], lane_bytes=64)
    whole = run(tmp_path / "b", 3, "all_reduce", [(x, "float32") for x in inputs], lane_bytes=1 << 16)
    assert chunked[0].tobytes() == whole[0].tobytes() == _f32_reference(inputs).tobytes()
    inputs = _bf16_inputs(2, 999, seed=12)
    chunked = run(tmp_path / "c", 2, "all_reduce", [(x, "bfloat16") for x in inputs], lane_bytes=64)
    assert chunked[1].tobytes() == _bf16_reference(inputs).tobytes()


def test_all_gather_and_broadcast_move_messages_larger_than_a_lane(tmp_path):
    world, n = 3, 1000
    inputs = [np.arange(n, dtype=np.uint8) * (r + 1) for r in range(world)]
    outs = run(tmp_path / "g", world, "all_gather", inputs, lane_bytes=256)
    expected = np.concatenate(inputs).tobytes()
    assert all(o.tobytes() == expected for o in outs)

    for i, message in enumerate([b"", b"step 7", os.urandom(70_000)]):
        outs = run(tmp_path / f"b{i}", world, "broadcast", [(1, message)] * world, lane_bytes=1024)
        assert outs == [message] * world


def test_a_killed_rank_is_named_instead_of_a_hang(tmp_path):
    # Rank 1 joins and sleeps; ranks 0 and 2 wait for it in all_reduce (deadline 30 s); it is SIGKILLed
    # (and left unreaped: a zombie) and both must report it dead well before the deadline.
    jobs = ["all_reduce_timed", "sleep", "all_reduce_timed"]
    with Ranks(tmp_path / "seg", 3, jobs, [COLLECTIVE_TIMEOUT_S, 60.0, COLLECTIVE_TIMEOUT_S]) as ranks:
        ranks.wait([0, 1, 2], "joined")
        time.sleep(0.3)  # let ranks 0 and 2 enter the all-reduce
        victim = ranks.pids[1]
        os.kill(victim, signal.SIGKILL)
        ranks.wait([0, 2])
        for r in (0, 2):
            kind, message, took = ranks.out[r]
            assert kind == "CommError"
            assert message == f"all_reduce #1: rank 1 (pid {victim}) died"
            assert took < 10.0


def test_a_worker_waiting_without_deadline_sees_the_root_die(tmp_path):
    with Ranks(tmp_path / "seg", 2, ["sleep", "recv_forever"], [60.0, None]) as ranks:
        ranks.wait([0, 1], "joined")
        time.sleep(0.3)
        root = ranks.pids[0]
        os.kill(root, signal.SIGKILL)
        ranks.wait([1], timeout_s=10.0)
        assert ranks.out[1][:2] == ("CommError", f"broadcast #1: rank 0 (pid {root}) died")


def test_a_rank_that_never_calls_times_out_naming_it(tmp_path):
    jobs = ["all_reduce_timed", "all_reduce_timed", "sleep"]
    with Ranks(tmp_path / "seg", 3, jobs, [1.0, 1.0, 30.0]) as ranks:
        ranks.wait([0, 1])
        for r in (0, 1):
            kind, message, took = ranks.out[r]
            assert kind == "CommError"
            assert message.startswith("all_reduce #1: timed out after 1.0 s waiting for rank(s) [2] "
                                      "(alive but lagging)"), message
            assert 1.0 <= took < 3.0


def test_join_times_out_naming_the_missing_rank(tmp_path):
    start = time.monotonic()
    with pytest.raises(CommError, match=r"join #0: timed out after 0\.3 s waiting for rank\(s\) \[1\] \(not joined\)"):
        HostComm(str(tmp_path / "seg"), 0, 2, lane_bytes=64, timeout_s=0.3)
    assert time.monotonic() - start < 3.0


def test_single_rank_api_checks_arguments(tmp_path):
    with HostComm(str(tmp_path / "seg"), 0, 1, lane_bytes=128, timeout_s=5.0) as comm:
        assert (comm.rank, comm.world_size, comm.lane_bytes, comm.seq, comm.timeout_s) == (0, 1, 128, 0, 5.0)
        assert comm.path == str(tmp_path / "seg")
        x = np.arange(100, dtype=np.float32)
        comm.all_reduce(x, "float32")
        assert np.array_equal(x, np.arange(100, dtype=np.float32))
        bits = np.array([0x3F80, 0x4000], dtype=np.uint16)
        comm.all_reduce(bits, "bfloat16", timeout_s=None)
        assert bits.tolist() == [0x3F80, 0x4000]
        comm.barrier(timeout_s=None)
        assert comm.broadcast(b"abc") == b"abc"
        out = np.zeros(3, dtype=np.uint8)
        comm.all_gather(np.array([1, 2, 3], dtype=np.uint8), out)
        assert out.tolist() == [1, 2, 3]
        assert comm.seq == 5

        bad = [
            (lambda: comm.all_reduce(np.zeros(4), "float32"), "1-D float32 numpy array, got float64"),
            (lambda: comm.all_reduce(np.zeros((2, 2), np.float32), "float32"), "1-D float32"),
            (lambda: comm.all_reduce(np.zeros(8, np.float32)[::2], "float32"), "C-contiguous"),
            (lambda: comm.all_reduce(np.zeros(4, np.float32), "float16"), "'float32' or 'bfloat16'"),
            (lambda: comm.all_reduce(np.zeros(4, np.float32), "bfloat16"), "int16 or uint16"),
            (lambda: comm.all_reduce([1.0, 2.0], "float32"), "got list"),
            (lambda: comm.all_gather(np.zeros(2, np.uint8), np.zeros(3, np.uint8)), "output has 3 bytes"),
            (lambda: comm.broadcast(None), "is the root"),
            (lambda: comm.barrier(timeout_s=-1.0), "timeout_s must be >= 0"),
        ]
        ro = np.zeros(4, np.float32)
        ro.flags.writeable = False
        bad.append((lambda: comm.all_reduce(ro, "float32"), "not writable"))
        for call, message in bad:
            with pytest.raises(ValueError, match=message.replace("(", r"\(")):
                call()
        assert comm.seq == 5  # argument errors start no collective
    with pytest.raises(CommError, match="closed"):
        comm.barrier()
    with pytest.raises(ValueError, match="lane_bytes must be a positive multiple of 64"):
        HostComm(str(tmp_path / "x"), 0, 1, lane_bytes=100)
    assert HostComm.segment_bytes(2, 1 << 20) == 4096 + 6 * (1 << 20)
