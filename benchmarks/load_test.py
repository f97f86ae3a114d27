"""Load test: many threads on several workers calling each other; nothing may be lost.

``python benchmarks/load_test.py`` starts 4 worker processes (``--workers``);
each runs 8 caller threads (``--threads``) that together make ``--calls``
calls (default 100,000; ``--quick``: 5,000) to every other worker, round
robin. Each call sends a payload of 100 B to 1 MB (bytes or a uint8 tensor,
log-uniform within weighted size classes) with a unique call id, through one
of ``rpc_sync``, ``rpc_async`` (up to 4 in flight per thread) or
``remote(...).to_here()``. The callee's ``echo`` records the call id and
returns ``(call id, crc32, payload)``; the caller checks all three.

Reported (stdout table and JSON, default ``benchmarks/results/load_test.json``):

* ``ok``: calls whose result checked out; ``wrong_result``: a reply that did
  not match; ``failed``: calls that raised;
* ``lost``: calls issued whose execution the callee never recorded (or which
  never completed at the caller); ``duplicated``: executions beyond the first
  of a call id;
* calls/s over the load phase (first call anywhere to last reply anywhere),
  latency percentiles per mode, bytes moved, and per worker the maximum RSS
  (``VmRSS`` from ``/proc/self/status``, sampled every 0.25 s).

The exit status is 0 only when every call is ok and none is lost or duplicated.
Run it as a script from anywhere: ``python benchmarks/load_test.py [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections import deque
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "load_test.json"

# (low, high, weight): sizes are log-uniform in [low, high]; the last class is exactly 1 MB.
SIZE_CLASSES = [
    (100, 1_000, 0.55),
    (1_000, 10_000, 0.25),
    (10_000, 100_000, 0.14),
    (100_000, 1_000_000, 0.055),
    (1_000_000, 1_000_000, 0.005),
]
MODES = ("rpc_sync", "rpc_async", "remote")
ASYNC_WINDOW = 4


# --- the served side -----------------------------------------------------------------------

_served_lock = threading.Lock()
_served_ids: set[tuple[int, int, int]] = set()
_served_from: dict[int, int] = {}
_duplicates = 0


def checksum(payload: Any) -> int:
    if isinstance(payload, (bytes, bytearray)):
        return zlib.crc32(payload)
    return zlib.crc32(payload.numpy().tobytes())


def echo(call_id: tuple[int, int, int], payload: Any) -> tuple[tuple[int, int, int], int, Any]:
    """Record ``call_id`` (a second execution is a duplicate) and echo the payload."""
    global _duplicates
    with _served_lock:
        if call_id in _served_ids:
            _duplicates += 1
        else:
            _served_ids.add(call_id)
            _served_from[call_id[0]] = _served_from.get(call_id[0], 0) + 1
    return call_id, checksum(payload), payload


# --- the calling side ------------------------------------------------------------------------


def rss_kib() -> int:
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


class RssSampler(threading.Thread):
    def __init__(self, interval: float = 0.25) -> None:
        super().__init__(daemon=True)
        self.interval = interval
        self.max_kib = rss_kib()
        self.samples = 0
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(self.interval):
            self.max_kib = max(self.max_kib, rss_kib())
            self.samples += 1

    def stop(self) -> None:
        self._halt.set()
        self.join()
        self.max_kib = max(self.max_kib, rss_kib())


class Tally:
    """One caller thread's counts (merged per worker at the end)."""

    def __init__(self) -> None:
        self.issued: dict[int, int] = {}
        self.ok: dict[int, int] = {}
        self.failed = 0
        self.wrong = 0
        self.errors: dict[str, int] = {}
        self.examples: list[str] = []
        self.latency: dict[str, list[float]] = {m: [] for m in MODES}
        self.bytes = 0
        self.first = float("inf")
        self.last = 0.0

    def fail(self, exc: BaseException) -> None:
        self.failed += 1
        key = type(exc).__name__
        self.errors[key] = self.errors.get(key, 0) + 1
        if len(self.examples) < 5:
            self.examples.append(f"{key}: {str(exc)[:300]}")


def pick_size(rng: random.Random) -> int:
    r = rng.random()
    for low, high, weight in SIZE_CLASSES:
        if r < weight or (low, high, weight) == SIZE_CLASSES[-1]:
            if low == high:
                return low
            lo, hi = low.bit_length(), high.bit_length()  # log-uniform via powers of two
            size = int(2 ** rng.uniform(lo - 1, hi - 1))
            return max(low, min(high, size))
        r -= weight
    raise AssertionError("unreachable")


def caller_thread(
    rpc: Any,
    torch: Any,
    rank: int,
    index: int,
    count: int,
    peers: list[str],
    noise: bytes,
    seed: int,
    tally: Tally,
) -> None:
    rng = random.Random(f"{seed}/{rank}/{index}")
    window: deque[tuple[Any, tuple[int, int, int], int, Any, float, int, list[float]]] = deque()

    def check(call_id, expected_sum, sent, result, started, dest, now=None):
        now = time.monotonic() if now is None else now
        got_id, got_sum, got_payload = result
        if isinstance(sent, (bytes, bytearray)):
            same = got_payload == sent
        else:
            same = bool(torch.equal(got_payload, sent))
        if (
            got_id == call_id
            and got_sum == expected_sum
            and same
            and checksum(got_payload) == expected_sum
        ):
            tally.ok[dest] = tally.ok.get(dest, 0) + 1
        else:
            tally.wrong += 1
            if len(tally.examples) < 5:
                tally.examples.append(f"wrong result for {call_id}: got id {got_id}")
        tally.last = max(tally.last, time.time())
        return now - started

    def drain(limit: int) -> None:
        while len(window) > limit:
            fut, call_id, expected, sent, started, dest, ended = window.popleft()
            try:
                result = fut.wait()
            except BaseException as exc:  # noqa: BLE001 - counted
                tally.fail(exc)
                continue
            tally.latency["rpc_async"].append(
                check(call_id, expected, sent, result, started, dest, ended[0] if ended else None)
            )

    tally.first = time.time()
    for i in range(count):
        dest_index = (index + i) % len(peers)
        dest = peers[dest_index]
        dest_rank = int(dest[len("worker") :])
        size = pick_size(rng)
        offset = rng.randrange(0, len(noise) - size + 1)
        raw = noise[offset : offset + size]
        payload: Any = (
            raw if rng.random() < 0.5 else torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        )
        expected = zlib.crc32(raw)
        call_id = (rank, index, i)
        mode = MODES[rng.randrange(3)]
        tally.issued[dest_rank] = tally.issued.get(dest_rank, 0) + 1
        tally.bytes += 2 * size
        started = time.monotonic()
        try:
            if mode == "rpc_sync":
                result = rpc.rpc_sync(dest, echo, args=(call_id, payload))
            elif mode == "remote":
                result = rpc.remote(dest, echo, args=(call_id, payload)).to_here()
            else:
                future = rpc.rpc_async(dest, echo, args=(call_id, payload))
                ended: list[float] = []  # completion time, for the latency
                future.add_done_callback(lambda _, ended=ended: ended.append(time.monotonic()))
                window.append((future, call_id, expected, payload, started, dest_rank, ended))
                drain(ASYNC_WINDOW - 1)
                continue
        except BaseException as exc:  # noqa: BLE001 - counted
            tally.fail(exc)
            continue
        tally.latency[mode].append(check(call_id, expected, payload, result, started, dest_rank))
    drain(0)


def worker_main(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(REPO_ROOT))
    import torch

    import actorrpc as rpc

    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    rank, world = args.worker_rank, args.workers
    options = rpc.ZmqRpcBackendOptions(
        init_method=args.init_method,
        rpc_timeout=args.call_timeout,
        num_worker_threads=args.server_threads,
        init_timeout=120,
        shutdown_timeout=300,
    )
    t0 = time.monotonic()
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world, rpc_backend_options=options)
    init_s = time.monotonic() - t0
    sampler = RssSampler()
    sampler.start()
    rss_after_init = rss_kib()
    peers = [f"worker{r}" for r in range(world) if r != rank]
    noise = random.Random(f"{args.seed}/noise/{rank}").randbytes((1 << 20) + 4096)
    slots = world * args.threads
    tallies = [Tally() for _ in range(args.threads)]
    threads = []
    for index in range(args.threads):
        slot = rank * args.threads + index
        count = args.calls // slots + (1 if slot < args.calls % slots else 0)
        threads.append(
            threading.Thread(
                target=caller_thread,
                args=(rpc, torch, rank, index, count, peers, noise, args.seed, tallies[index]),
                name=f"caller-{index}",
            )
        )
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    calls_done = time.time()
    # the I/O threads' scheduling policy after the load (and how often its guard fell back)
    stats = rpc.get_worker_stats()
    scheduling = {"libzmq": stats["batch_scheduling"], "io": stats["io_thread_scheduling"]}
    shutdown_error = None
    t1 = time.monotonic()
    try:
        rpc.shutdown(timeout=300)  # graceful: every worker's calls are done after this
    except Exception as exc:  # noqa: BLE001 - reported
        shutdown_error = f"{type(exc).__name__}: {exc}"
    shutdown_s = time.monotonic() - t1
    sampler.stop()
    merged: dict[str, Any] = {
        "issued": {},
        "ok": {},
        "failed": 0,
        "wrong": 0,
        "errors": {},
        "examples": [],
        "latency": {m: [] for m in MODES},
        "bytes": 0,
    }
    for tally in tallies:
        for key in ("issued", "ok"):
            for dest, n in getattr(tally, key).items():
                merged[key][str(dest)] = merged[key].get(str(dest), 0) + n
        merged["failed"] += tally.failed
        merged["wrong"] += tally.wrong
        for key, n in tally.errors.items():
            merged["errors"][key] = merged["errors"].get(key, 0) + n
        merged["examples"] += tally.examples[: 5 - len(merged["examples"])]
        for mode in MODES:
            merged["latency"][mode] += tally.latency[mode]
        merged["bytes"] += tally.bytes
    with _served_lock:
        served_from = {str(k): v for k, v in _served_from.items()}
        duplicates = _duplicates
    result = {
        "rank": rank,
        "pid": os.getpid(),
        "init_s": init_s,
        "first_call": min(t.first for t in tallies),
        "last_reply": max([t.last for t in tallies] + [0.0]),
        "calls_done": calls_done,
        "shutdown_s": shutdown_s,
        "shutdown_error": shutdown_error,
        "rss_after_init_mib": rss_after_init / 1024,
        "rss_max_mib": sampler.max_kib / 1024,
        "rss_samples": sampler.samples,
        "served_from": served_from,
        "duplicates": duplicates,
        "batch_scheduling": scheduling,
        **merged,
    }
    print("RESULT " + json.dumps(result), flush=True)


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(3)


# --- the parent --------------------------------------------------------------------------------


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"n": 0}
    values = sorted(values)

    def pick(q: float) -> float:
        return values[min(len(values) - 1, int(q / 100 * len(values)))] * 1000

    return {
        "n": len(values),
        "p50_ms": pick(50),
        "p90_ms": pick(90),
        "p99_ms": pick(99),
        "max_ms": values[-1] * 1000,
    }


def _versions() -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "nproc": os.cpu_count(),
    }
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        import torch
        import zmq

        info.update(torch=torch.__version__, pyzmq=zmq.pyzmq_version(), libzmq=zmq.zmq_version())
    except ImportError:
        pass
    return info


def parent_main(args: argparse.Namespace) -> int:
    calls = 5000 if args.quick and args.calls is None else (args.calls or 100_000)
    args.calls = calls
    from _common import free_port

    init_method = f"tcp://127.0.0.1:{free_port()}"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    load_before = os.getloadavg()
    started = time.time()
    processes = []
    with tempfile.TemporaryDirectory(prefix="actorrpc-load-") as tmp:
        for rank in range(args.workers):
            out = open(os.path.join(tmp, f"{rank}.out"), "w+")  # noqa: SIM115 - closed below
            err = open(os.path.join(tmp, f"{rank}.err"), "w+")  # noqa: SIM115
            command = [
                sys.executable,
                os.path.abspath(__file__),
                "--worker-rank",
                str(rank),
                "--workers",
                str(args.workers),
                "--threads",
                str(args.threads),
                "--calls",
                str(calls),
                "--seed",
                str(args.seed),
                "--init-method",
                init_method,
                "--call-timeout",
                str(args.call_timeout),
                "--server-threads",
                str(args.server_threads),
            ]
            processes.append(
                (
                    rank,
                    out,
                    err,
                    subprocess.Popen(
                        command, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env
                    ),
                )
            )
        deadline = time.monotonic() + args.timeout
        results, problems = [], []
        for rank, out, err, process in processes:
            try:
                code = process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                code = process.wait()
                problems.append(f"worker{rank} killed after the --timeout of {args.timeout}s")
            out.seek(0)
            err.seek(0)
            stdout, stderr = out.read(), err.read()
            out.close()
            err.close()
            lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
            if lines:
                results.append(json.loads(lines[-1][len("RESULT ") :]))
            else:
                problems.append(f"worker{rank} exited {code} without a result: {stderr[-2000:]}")
            if code != 0:
                problems.append(f"worker{rank} exited with {code}")
    report = summarize(args, calls, results, problems, started, load_before)
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print_report(report, path)
    totals = report["totals"]
    clean = (
        not problems
        and totals["ok"] == calls
        and totals["failed"] == 0
        and totals["lost"] == 0
        and totals["duplicated"] == 0
        and totals["wrong_result"] == 0
    )
    return 0 if clean else 1


def summarize(
    args: argparse.Namespace,
    calls: int,
    results: list[dict[str, Any]],
    problems: list[str],
    started: float,
    load_before: tuple[float, ...],
) -> dict[str, Any]:
    issued = ok = failed = wrong = served = duplicated = lost = moved = 0
    errors: dict[str, int] = {}
    examples: list[str] = []
    latency: dict[str, list[float]] = {m: [] for m in MODES}
    by_rank = {r["rank"]: r for r in results}
    for r in results:
        issued += sum(r["issued"].values())
        ok += sum(r["ok"].values())
        failed += r["failed"]
        wrong += r["wrong"]
        served += sum(r["served_from"].values())
        duplicated += r["duplicates"]
        moved += r["bytes"]
        for key, n in r["errors"].items():
            errors[key] = errors.get(key, 0) + n
        examples += r["examples"]
        for mode in MODES:
            latency[mode] += r["latency"][mode]
    # a call is lost if its callee never ran it (issued a->b but not served at b from a)
    for caller in results:
        for dest, n in caller["issued"].items():
            callee = by_rank.get(int(dest))
            got = callee["served_from"].get(str(caller["rank"]), 0) if callee else 0
            lost += max(0, n - got)
            duplicated += max(0, got - n)
    lost += max(0, calls - issued)  # calls that were never issued (a caller died)
    first = min((r["first_call"] for r in results), default=started)
    last = max((r["last_reply"] for r in results), default=started)
    duration = max(last - first, 1e-9)
    return {
        "config": {
            "calls": calls,
            "workers": args.workers,
            "threads": args.threads,
            "seed": args.seed,
            "call_timeout_s": args.call_timeout,
            "server_threads": args.server_threads,
            "async_window": ASYNC_WINDOW,
            "size_classes": SIZE_CLASSES,
            "modes": list(MODES),
        },
        "workers": args.workers,
        "threads_per_worker": args.threads,
        "machine": _versions(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "totals": {
            "calls": calls,
            "issued": issued,
            "ok": ok,
            "failed": failed,
            "wrong_result": wrong,
            "lost": lost,
            "duplicated": duplicated,
            "served": served,
            "errors": errors,
            "examples": examples[:10],
        },
        "load_phase_s": duration,
        "calls_per_s": ok / duration,
        "payload_mb_per_s": moved / duration / 1e6,
        "bytes_moved": moved,
        "latency": {m: _percentiles(v) for m, v in latency.items()},
        "per_worker": [
            {
                "rank": r["rank"],
                "init_s": r["init_s"],
                "shutdown_s": r["shutdown_s"],
                "shutdown_error": r["shutdown_error"],
                "rss_after_init_mib": r["rss_after_init_mib"],
                "rss_max_mib": r["rss_max_mib"],
                "rss_samples": r["rss_samples"],
                "calls_ok": sum(r["ok"].values()),
                "served": sum(r["served_from"].values()),
                "batch_scheduling": r["batch_scheduling"],
            }
            for r in sorted(results, key=lambda r: r["rank"])
        ],
        "wall_s": time.time() - started,
        "problems": problems,
    }


def print_report(report: dict[str, Any], path: Path) -> None:
    t = report["totals"]
    print(
        f"load test: {t['calls']} calls, {report['workers']} workers x "
        f"{report['threads_per_worker']} threads, load phase {report['load_phase_s']:.1f}s"
    )
    print(
        f"  ok {t['ok']}  failed {t['failed']}  wrong {t['wrong_result']}  lost {t['lost']}  "
        f"duplicated {t['duplicated']}  served {t['served']}"
    )
    print(
        f"  {report['calls_per_s']:.0f} calls/s, {report['payload_mb_per_s']:.1f} MB/s of "
        f"payload (both ways)"
    )
    for mode, p in report["latency"].items():
        if p.get("n"):
            print(
                f"  {mode:9s} n={p['n']:6d}  p50 {p['p50_ms']:7.2f} ms  p99 "
                f"{p['p99_ms']:8.2f} ms  max {p['max_ms']:8.1f} ms"
            )
    for w in report["per_worker"]:
        error = f" ERROR {w['shutdown_error']}" if w["shutdown_error"] else ""
        print(
            f"  worker{w['rank']}: max RSS {w['rss_max_mib']:.0f} MiB (after init "
            f"{w['rss_after_init_mib']:.0f} MiB), served {w['served']}, shutdown "
            f"{w['shutdown_s']:.2f}s, I/O threads (libzmq's, the agent's) "
            + ", ".join(f"{s['policy']} ({s['fallbacks']} fallbacks)"
                        for s in w["batch_scheduling"].values())
            + error
        )
    for problem in report["problems"]:
        print(f"  PROBLEM: {problem}")
    for example in t["examples"]:
        print(f"  error: {example}")
    print(f"  wrote {path}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=None, help="total calls (default 100000)")
    parser.add_argument("--quick", action="store_true", help="5,000 calls")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=8, help="caller threads per worker")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--call-timeout", type=float, default=120.0)
    parser.add_argument("--server-threads", type=int, default=16)
    parser.add_argument(
        "--timeout", type=float, default=1800.0, help="seconds before the parent kills the workers"
    )
    parser.add_argument("--json", default=str(DEFAULT_JSON))
    parser.add_argument("--worker-rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--init-method", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.workers < 2:
        parser.error("--workers must be at least 2")
    if args.worker_rank is not None:
        if __name__ == "__main__":
            # Run as the importable module ``load_test`` so that ``echo`` travels by
            # reference (a ``__main__`` function would be shipped by value with each call).
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            import load_test

            load_test.worker_main(args)
        else:
            worker_main(args)
        return 0
    return parent_main(args)


if __name__ == "__main__":
    sys.exit(main())
