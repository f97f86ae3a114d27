"""RPC benchmark metrics, written once against the ``torch.distributed.rpc`` API.

Every metric takes the backend's ``rpc`` module (``torch.distributed.rpc`` or
``actorrpc``) and, for the autograd metric, its distributed-autograd module, so both
backends run exactly the same code.  :func:`worker_main` is the entry point of the two
spawned processes: rank 0 drives the measurements, rank 1 only serves.
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from threading import BrokenBarrierError
from types import ModuleType
from typing import Any

from _common import ensure_repo_on_path, latency_stats, pin_process, rss_mb, time_calls

PEER = "worker1"
METRICS = ("rpc_sync", "rpc_async", "remote", "echo_1mb", "echo_64mb", "autograd", "train_step")
BACKENDS = ("torch", "actorrpc")
MB = 1 << 20


@dataclass(frozen=True)
class Config:
    """Iteration counts; :data:`QUICK` is the CI smoke-test setting."""

    sync_warmup: int = 500
    sync_n: int = 5000
    async_inflight: int = 500
    async_total: int = 50_000
    remote_warmup: int = 200
    remote_n: int = 2000
    echo_1mb_warmup: int = 20
    echo_1mb_n: int = 300
    echo_64mb_warmup: int = 3
    echo_64mb_n: int = 30
    # the warm-up (1,000 iterations and 1 s at least) spans the ~0.5 s after the 64 MB echo
    # in which any process on these VMs runs slower (local clones of 64 MB show it too,
    # without RPC); 500 iterations (166 a round) after 50 measured that transient more than
    # the iteration (docs/performance.md, "Thirty-first session")
    autograd_warmup: int = 1000
    autograd_warmup_s: float = 1.0
    autograd_n: int = 3000
    train_warmup: int = 20
    train_n: int = 300
    metric_timeout_s: float = 180.0
    init_timeout_s: float = 120.0
    backend_budget_s: float = 900.0
    floor_rounds: int = 3
    init_rounds: int = 3  # process pairs whose init_rpc time is sampled (median)
    pin: str = "none"  # "split": rank r pinned to CPU r (see _common.pin_process)


QUICK = Config(
    sync_warmup=300,
    sync_n=1000,
    async_inflight=200,
    async_total=2000,
    remote_warmup=20,
    remote_n=200,
    echo_1mb_warmup=3,
    echo_1mb_n=30,
    echo_64mb_warmup=0,
    echo_64mb_n=0,
    autograd_warmup=5,
    autograd_warmup_s=0.0,
    autograd_n=50,
    train_warmup=3,
    train_n=20,
    metric_timeout_s=10.0,
    init_timeout_s=25.0,
    backend_budget_s=25.0,
    floor_rounds=2,
    init_rounds=1,
)
FULL = Config()


# --- functions executed on the serving worker (pickled by reference) -------------------


def noop(x: Any) -> Any:
    return x


def echo(t: Any) -> Any:
    return t


# --- backend loading -------------------------------------------------------------------


class Backend:
    """The ``rpc`` and distributed-autograd modules of one implementation."""

    def __init__(self, name: str, port: int, threads: int = 16, timeout: float = 60.0) -> None:
        self.name = name
        self.autograd: ModuleType | None = None
        self.autograd_error = ""
        init_method = f"tcp://127.0.0.1:{port}"
        if name == "torch":
            import torch.distributed.autograd as dist_autograd
            import torch.distributed.rpc as torch_rpc

            self.rpc: ModuleType = torch_rpc
            self.autograd = dist_autograd
            self.options: Any = torch_rpc.TensorPipeRpcBackendOptions(
                num_worker_threads=threads, rpc_timeout=timeout, init_method=init_method
            )
        elif name == "actorrpc":
            ensure_repo_on_path()
            import actorrpc

            self.rpc = actorrpc
            try:
                import actorrpc.autograd as zmq_autograd

                self.autograd = zmq_autograd
            except Exception as exc:  # noqa: BLE001 - optional module, reported as n/a
                self.autograd_error = (
                    f"import actorrpc.autograd failed: {type(exc).__name__}: {exc}"
                )
            self.options = actorrpc.ZmqRpcBackendOptions(
                num_worker_threads=threads, rpc_timeout=timeout, init_method=init_method
            )
        else:
            raise ValueError(f"unknown backend {name!r}")


# --- metrics (rank 0) ------------------------------------------------------------------


def sync_call(rpc: ModuleType) -> Callable[[int], None]:
    def call(i: int) -> None:
        if rpc.rpc_sync(PEER, noop, args=(i,)) != i:
            raise AssertionError("rpc_sync(noop) returned a wrong value")

    return call


def _wait(futs: list[Any]) -> list[Any]:
    import torch

    if futs and isinstance(futs[0], torch.futures.Future):
        return list(torch.futures.wait_all(futs))
    return [f.wait() for f in futs]


def bench_rpc_async(rpc: ModuleType, cfg: Config) -> dict[str, Any]:
    inflight = cfg.async_inflight

    def batch(base: int) -> None:
        futs = [rpc.rpc_async(PEER, noop, args=(base + j,)) for j in range(inflight)]
        values = _wait(futs)
        if values[0] != base or values[-1] != base + inflight - 1:
            raise AssertionError("rpc_async(noop) returned wrong values")

    batch(0)  # warm-up
    done = 0
    t0 = time.perf_counter()
    while done < cfg.async_total:
        batch(done)
        done += inflight
    elapsed = time.perf_counter() - t0
    return {
        "calls_per_s": done / elapsed,
        "calls": done,
        "inflight": inflight,
        "elapsed_s": elapsed,
    }


def remote_call(rpc: ModuleType) -> Callable[[int], None]:
    def call(i: int) -> None:
        if rpc.remote(PEER, noop, args=(i,)).to_here() != i:
            raise AssertionError("remote(noop).to_here() returned a wrong value")

    return call


def echo_call(rpc: ModuleType, size_bytes: int) -> Callable[[int], None]:
    import torch

    tensor = torch.rand(size_bytes // 4, dtype=torch.float32)

    def call(_: int) -> None:
        out = rpc.rpc_sync(PEER, echo, args=(tensor,))
        if out.shape != tensor.shape or out.dtype != tensor.dtype:
            raise AssertionError("echo returned a tensor of the wrong shape/dtype")

    return call


def bench_echo(rpc: ModuleType, size_bytes: int, warmup: int, n: int) -> dict[str, Any]:
    stats = latency_stats(time_calls(echo_call(rpc, size_bytes), warmup, n))
    median_s = stats["median_us"] / 1e6
    # Bandwidth counts the bytes both ways (request + reply), 1 GB = 1e9 bytes.
    stats["gb_per_s"] = 2 * size_bytes / median_s / 1e9
    stats["bytes"] = float(size_bytes)
    return stats


def autograd_iteration(rpc: ModuleType, dist_autograd: ModuleType) -> Callable[[int], None]:
    import torch

    a = torch.rand(64, 64, requires_grad=True)
    b = torch.rand(64, 64, requires_grad=True)

    def iteration(_: int) -> None:
        with dist_autograd.context() as ctx:
            out = rpc.rpc_sync(PEER, torch.add, args=(a, b))
            loss = out.sum()
            dist_autograd.backward(ctx, [loss])
            grads = dist_autograd.get_gradients(ctx)
        if not torch.equal(grads[a], torch.ones_like(a)):
            raise AssertionError("wrong gradient for a")

    return iteration


LATENCY_METRICS = ("rpc_sync", "remote", "echo_1mb", "autograd")
"""The metrics timed call by call (median latency): those :func:`latency_call` makes."""


def latency_call(name: str, backend: Backend) -> Callable[[int], None]:
    """One call of latency metric ``name`` (of :data:`LATENCY_METRICS`) for ``backend``."""
    if name == "rpc_sync":
        return sync_call(backend.rpc)
    if name == "remote":
        return remote_call(backend.rpc)
    if name == "echo_1mb":
        return echo_call(backend.rpc, MB)
    if name == "autograd":
        if backend.autograd is None:
            raise RuntimeError(backend.autograd_error or "no distributed autograd module")
        return autograd_iteration(backend.rpc, backend.autograd)
    raise ValueError(f"{name!r} is not a latency metric (one of {', '.join(LATENCY_METRICS)})")


def latency_plan(name: str, cfg: Config) -> tuple[int, float, int]:
    """``(calls, seconds)`` of untimed warm-up and the timed calls of latency metric
    ``name`` in ``cfg``."""
    return {
        "rpc_sync": (cfg.sync_warmup, 0.0, cfg.sync_n),
        "remote": (cfg.remote_warmup, 0.0, cfg.remote_n),
        "echo_1mb": (cfg.echo_1mb_warmup, 0.0, cfg.echo_1mb_n),
        "autograd": (cfg.autograd_warmup, cfg.autograd_warmup_s, cfg.autograd_n),
    }[name]


def bench_latency(name: str, backend: Backend, cfg: Config) -> dict[str, Any]:
    """Latency stats of ``cfg``'s timed calls of latency metric ``name``, after its warm-up."""
    warm_n, warm_s, n = latency_plan(name, cfg)
    return latency_stats(time_calls(latency_call(name, backend), warm_n, n, warm_s))


def run_metric(name: str, backend: Backend, cfg: Config) -> dict[str, Any]:
    rpc = backend.rpc
    if name in ("rpc_sync", "remote"):
        return bench_latency(name, backend, cfg)
    if name == "rpc_async":
        return bench_rpc_async(rpc, cfg)
    if name == "echo_1mb":
        return bench_echo(rpc, MB, cfg.echo_1mb_warmup, cfg.echo_1mb_n)
    if name == "echo_64mb":
        if cfg.echo_64mb_n <= 0:
            return {"skipped": "skipped (--quick)"}
        return bench_echo(rpc, 64 * MB, cfg.echo_64mb_warmup, cfg.echo_64mb_n)
    if name in ("autograd", "train_step") and backend.autograd is None:
        return {"na": backend.autograd_error or "no distributed autograd module"}
    if name == "autograd":
        try:
            return bench_latency(name, backend, cfg)
        except Exception as exc:
            if backend.name == "actorrpc":  # optional feature: n/a rather than error
                return {"na": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            raise
    if name == "train_step":
        from _training import stack_of, train_step_times  # (imports torch: not at the top)

        stack = stack_of(backend.name, rpc, backend.autograd)
        times = train_step_times(stack, PEER, cfg.train_warmup, cfg.train_n)
        return latency_stats(times)
    raise ValueError(f"unknown metric {name!r}")


# --- process entry point ---------------------------------------------------------------


def _error(exc: BaseException) -> dict[str, Any]:
    return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}


def _start_backend(
    rank: int, world_size: int, port: int, queue: Any, barrier: Any, backend_name: str,
    cfg: Config,
) -> Backend | None:
    """Pin, init the backend together with the other rank, report ``("init", ...)`` with
    the init time and the idle RSS; None (after reporting ``"fatal"``) when that failed."""
    try:
        if pin_process(rank, cfg.pin):
            import torch

            # one intra-op thread on one CPU (two wait for each other there: the
            # training step's LSTM ran 20-40 % slower), the same for both backends
            torch.set_num_threads(1)
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        backend = Backend(backend_name, port)
        barrier.wait(cfg.init_timeout_s)  # start init_rpc together: imports are not timed
        t0 = time.perf_counter()
        backend.rpc.init_rpc(
            f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=backend.options
        )
        init_s = time.perf_counter() - t0
        time.sleep(0.5)  # let background threads settle before sampling the idle RSS
        queue.put(("init", rank, "", {"init_s": init_s, "rss_mb": rss_mb()}))
        barrier.wait(cfg.init_timeout_s)  # rank 1 is sampled idle, before any traffic
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        queue.put(("fatal", rank, "init", _error(exc)))
        return None
    return backend


def _shut_down(backend: Backend, rank: int, queue: Any) -> None:
    """``rpc.shutdown()`` (rank 1 waits there, serving, until rank 0 is done), timed."""
    t0 = time.perf_counter()
    try:
        backend.rpc.shutdown()
        queue.put(("shutdown", rank, "", {"shutdown_s": time.perf_counter() - t0}))
    except BaseException as exc:  # noqa: BLE001
        err = _error(exc)
        err["shutdown_s"] = time.perf_counter() - t0
        queue.put(("fatal", rank, "shutdown", err))


def worker_main(
    rank: int,
    world_size: int,
    port: int,
    queue: Any,
    barrier: Any,
    backend_name: str,
    metrics: list[str],
    cfg: Config,
) -> None:
    """Spawned process: init the backend, measure (rank 0) or serve (rank 1), shut down."""
    backend = _start_backend(rank, world_size, port, queue, barrier, backend_name, cfg)
    if backend is None:
        return
    if rank == 0:
        for name in metrics:
            queue.put(("start", rank, name, None))
            try:
                result = run_metric(name, backend, cfg)
            except BaseException as exc:  # noqa: BLE001
                result = _error(exc)
            queue.put(("result", rank, name, result))
        queue.put(("done", rank, "", {"rss_mb": rss_mb()}))
    _shut_down(backend, rank, queue)


PAIRED_SERVE_S = 3600.0
"""How long rank 1 of a :func:`block_worker_main` pair serves at most."""


def block_worker_main(
    rank: int,
    world_size: int,
    port: int,
    queue: Any,
    barrier: Any,
    backend_name: str,
    cfg: Config,
    commands: Any,
) -> None:
    """Spawned process of ``paired_blocks.py``: rank 0 times blocks of a latency metric's
    calls on command, rank 1 serves.

    ``commands`` carries ``("block", metric, warm, n)``: warm up ``metric`` (before its
    first block, as :func:`latency_plan` says), make ``warm`` calls untimed, time ``n`` calls,
    report ``("block", 0, metric, latency stats)``; ``("stop", "", 0, 0)``: report
    ``"done"`` and shut down. No command within ``cfg.metric_timeout_s``: report
    ``"fatal"`` and shut down. Rank 1 serves from its backend's threads while its main
    thread waits at ``barrier`` for rank 0 to be done (not in ``shutdown()``, whose wait
    for the other ranks is bounded: ours 60 s), then both shut down.
    """
    import queue as queue_mod

    backend = _start_backend(rank, world_size, port, queue, barrier, backend_name, cfg)
    if backend is None:
        return
    if rank == 1:
        try:
            barrier.wait(PAIRED_SERVE_S)
        except BrokenBarrierError:
            pass  # rank 0 failed or ran past PAIRED_SERVE_S: shut down (which says so)
    if rank == 0:
        calls: dict[str, Callable[[int], None]] = {}
        while True:
            try:
                kind, metric, warm, n = commands.get(timeout=cfg.metric_timeout_s)
            except queue_mod.Empty:
                queue.put(("fatal", rank, "commands", {
                    "error": f"no command within {cfg.metric_timeout_s:g} s"}))
                break
            if kind == "stop":
                queue.put(("done", rank, "", {"rss_mb": rss_mb()}))
                break
            try:
                if metric not in calls:
                    calls[metric] = latency_call(metric, backend)
                    warm_n, warm_s, _ = latency_plan(metric, cfg)
                    time_calls(calls[metric], warm_n, 0, warm_s)
                result = latency_stats(time_calls(calls[metric], warm, n))
            except BaseException as exc:  # noqa: BLE001
                result = _error(exc)
            queue.put(("block", rank, metric, result))
        try:
            barrier.wait(cfg.init_timeout_s)
        except BrokenBarrierError:
            pass
    _shut_down(backend, rank, queue)
