"""Record a trace of a small group's RPCs and draw who called whom, and when.

Run::

    python examples/tracing.py trace.json trace.png

``trace.json`` opens in Perfetto (ui.perfetto.dev) or ``chrome://tracing``; the PNG
is a quick picture of the same events (one row per worker, arrows for calls).
"""

from __future__ import annotations

import json
import sys

import torch

import actorrpc as rpc


def leaf(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def middle(x: torch.Tensor) -> torch.Tensor:
    return rpc.rpc_sync("worker2", leaf, args=(x,)) + 1


def draw(trace: dict, path: str) -> None:  # type: ignore[type-arg]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    start = min(e["ts"] for e in events)
    fig, ax = plt.subplots(figsize=(10, 3.2))
    colors = {"rpc": "tab:blue", "serve": "tab:orange"}
    for event in events:
        row = event["pid"] + (0.2 if event["cat"] == "serve" else -0.2)
        left = (event["ts"] - start) / 1000
        ax.barh(row, max(event["dur"] / 1000, 0.02), left=left, height=0.35,
                color=colors[event["cat"]], alpha=0.8)
        if event["dur"] > 300:
            ax.text(left, row, " " + event["name"].rsplit(".", 1)[-1], va="center", fontsize=7)
    serve_start = {e["args"]["message_id"] + 1000000 * e["args"]["caller_rank"]: e
                   for e in events if e["cat"] == "serve"}
    for event in events:
        if event["cat"] != "rpc":
            continue
        served = serve_start.get(event["args"]["message_id"] + 1000000 * event["pid"])
        if served is not None:
            ax.annotate("", xy=((served["ts"] - start) / 1000, served["pid"] + 0.2),
                        xytext=((event["ts"] - start) / 1000, event["pid"] - 0.2),
                        arrowprops={"arrowstyle": "->", "color": "gray", "lw": 0.6})
    ax.set_yticks(sorted(names), [names[p] for p in sorted(names)])
    ax.invert_yaxis()
    ax.set_xlabel("ms (blue: waiting for a call made; orange: serving a call)")
    ax.set_title("actorrpc trace: who called whom, and when")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    json_path = sys.argv[1] if len(sys.argv) > 1 else "trace.json"
    png_path = sys.argv[2] if len(sys.argv) > 2 else None
    group = rpc.local_workers(2)
    rpc.rpc_sync("worker1", middle, args=(torch.ones(4),))  # warm-up, not traced
    rpc.start_tracing()
    futures = [rpc.rpc_async("worker1", middle, args=(torch.ones(256),)) for _ in range(3)]
    torch.futures.wait_all(futures)
    rpc.rpc_sync("worker2", torch.add, args=(torch.ones(100_000), 1))
    trace = rpc.stop_tracing(json_path)
    group.shutdown()
    print(f"wrote {json_path}: {sum(1 for e in trace['traceEvents'] if e['ph'] == 'X')} spans")
    if png_path:
        draw(json.loads(open(json_path).read()), png_path)
        print(f"wrote {png_path}")


if __name__ == "__main__":
    main()
