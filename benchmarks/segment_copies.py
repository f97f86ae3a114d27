"""How shared-memory segments are filled, session by session: the 1 MB echo's slow sessions.

    python benchmarks/segment_copies.py [--sessions 8] [--calls 400] [--size-mb 1]
                                        [--policies adaptive,plain,streaming,torch]
                                        [--pin split]

Between two workers of one host, actorrpc copies a tensor of at least the shared-memory
threshold (1 MiB) once into a segment on each side (``transport/_segment_copy.py``): a
plain copy, or streaming stores, chosen per size class by their measured times
("adaptive", the default), or one of them always ("plain", "streaming": the switch
``_segment_copy.FORCED_METHOD`` on both workers). On some hosts a whole session of
plain copies runs up to ten times slower (each line the other core read must be taken
back from it first); which sessions do is the host's placement, so the policies are
compared over many sessions: each session is a fresh pair of spawned workers, the
policies (and torch, the same echo through TensorPipe) interleaved session by session.
Rank 0 echoes a ``--size-mb`` tensor ``--calls`` times after 50 warm-up calls; per
session and policy the median round trip is printed, and for "adaptive" the method each
side's filler uses at the end (caller/callee: p plain, s streaming). The summary gives, per
policy, the median and the worst of the session medians and the ratio of torch's to
each. Figures are in docs/performance.md.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from _common import ensure_repo_on_path, free_port, pin_process, run_worker_pair

ensure_repo_on_path()

from _metrics import Backend  # noqa: E402 - needs the repository on the path

POLICIES = ("adaptive", "plain", "streaming", "torch")
WARMUP = 50


def echo(value: Any) -> Any:
    return value


def chosen_methods() -> str:
    """The method this worker's filler uses for its largest size class ("p"/"s"; "-": none)."""
    from actorrpc.agent import current_agent

    described = current_agent().shared.pool.filler.describe()
    classes = [value for key, value in described.items() if key.startswith("<=")]
    return classes[-1]["chosen"][0] if classes else "-"


def _worker(rank: int, policy: str, port: int, calls: int, size_mb: float, pin: str,
            results: Any) -> None:
    pin_process(rank, pin)
    torch.set_num_threads(1)
    backend = Backend("torch" if policy == "torch" else "actorrpc", port)
    if policy in ("plain", "streaming"):
        from actorrpc.transport import _segment_copy

        _segment_copy.FORCED_METHOD = policy
    rpc = backend.rpc
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=backend.options)
    if rank == 0:
        tensor = torch.rand(int(size_mb * (1 << 18)))  # float32: 4 bytes each
        samples = []
        for i in range(WARMUP + calls):
            began = time.perf_counter()
            out = rpc.rpc_sync("worker1", echo, args=(tensor,))
            if i >= WARMUP:
                samples.append(time.perf_counter() - began)
            if out.shape != tensor.shape:
                raise AssertionError("echo returned a tensor of another shape")
        chosen = "" if policy != "adaptive" else (
            chosen_methods() + "/" + rpc.rpc_sync("worker1", chosen_methods))
        results.put({"median_us": statistics.median(samples) * 1e6, "chosen": chosen})
    rpc.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=8, help="worker pairs per policy")
    parser.add_argument("--calls", type=int, default=400, help="timed echoes per session")
    parser.add_argument("--size-mb", type=float, default=1.0)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--pin", choices=("none", "split"), default="split")
    args = parser.parse_args()
    policies = args.policies.split(",")
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or args.sessions < 1 or args.calls < 1 or args.size_mb <= 0:
        parser.error(f"unknown policies {unknown}: choose from {','.join(POLICIES)}"
                     if unknown else "--sessions, --calls and --size-mb must be positive")
    print(f"{args.size_mb:g} MB echo, median round trip per session (µs), pin={args.pin}; "
          "adaptive: the methods in use at the end, caller/callee (p plain, s streaming)")
    print("session " + "".join(f"{p:>18s}" for p in policies))
    medians: dict[str, list[float]] = {p: [] for p in policies}
    for session in range(1, args.sessions + 1):
        cells = []
        for policy in policies:
            r = run_worker_pair(_worker, (policy, free_port(), args.calls, args.size_mb,
                                          args.pin), policy, result_timeout=300)
            medians[policy].append(r["median_us"])
            cells.append(f"{r['median_us']:.0f} {r['chosen']}".rstrip())
        print(f"{session:7d} " + "".join(f"{c:>18s}" for c in cells), flush=True)
    print("summary: median / worst of the session medians (µs)"
          + (", torch's median / each's median" if "torch" in policies else ""))
    for policy in policies:
        values = medians[policy]
        line = f"  {policy:10s} {statistics.median(values):8.0f} / {max(values):8.0f}"
        if "torch" in policies and policy != "torch":
            line += f"   {statistics.median(medians['torch']) / statistics.median(values):5.2f}x"
        print(line)


if __name__ == "__main__":
    main()
