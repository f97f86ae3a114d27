"""Turn raw benchmark results into the ratio table, the JSON report and the PNG chart."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BANDWIDTH_NOTE = (
    "echo bandwidth = 2 x tensor bytes / median round trip (bytes counted both ways, "
    "request + reply; 1 GB = 1e9 bytes), same definition for every column"
)
FLOOR_TARGET = 2.0  # actorrpc rpc_sync median must be within 2x of the pyzmq floor


@dataclass(frozen=True)
class Row:
    """One line of the ratio table: where the figure is and which way is better."""

    label: str
    metric: str
    field: str
    higher_better: bool
    target: float | None  # on the oriented ratio (>1 means actorrpc better)
    target_text: str
    scale: float = 1.0


ROWS = (
    Row("rpc_sync latency, median (µs)", "rpc_sync", "median_us", False, 2.5, "≥2.5×"),
    Row("rpc_sync latency, p99 (µs)", "rpc_sync", "p99_us", False, None, "–"),
    Row("rpc_async pipelined (calls/s)", "rpc_async", "calls_per_s", True, 4.0, "≥4×"),
    Row("remote()+to_here(), median (µs)", "remote", "median_us", False, 2.5, "≥2.5×"),
    Row("tensor echo 1 MB (GB/s)", "echo_1mb", "gb_per_s", True, 1.5, "≥1.5×"),
    Row("tensor echo 64 MB (GB/s)", "echo_64mb", "gb_per_s", True, 2.0, "≥2×"),
    Row("dist-autograd iteration, median (ms)", "autograd", "median_us", False, 2.0, "≥2×", 1e-3),
    Row("RNN tutorial training step, median (ms)", "train_step", "median_us", False, None, "–",
        1e-3),
    Row("init_rpc, max of 2 workers (s)", "init", "init_s_max", False, 2.0, "≤0.5× time"),
    Row("idle worker RSS (MiB)", "init", "rss_mb", False, 1.0, "≤ torch"),
)


def _entry(results: dict[str, Any], backend: str, metric: str) -> dict[str, Any] | None:
    return _metric_entry(results.get(backend), metric)


def _metric_entry(backend_res: dict[str, Any] | None, metric: str) -> dict[str, Any] | None:
    """One metric's figures in one backend's results (a whole run's or one round's)."""
    if backend_res is None:
        return None
    entry = backend_res.get("metrics", {}).get(metric)
    return entry if isinstance(entry, dict) else None


def _value(entry: dict[str, Any] | None, field: str, scale: float = 1.0) -> float | None:
    if entry is None:
        return None
    value = entry.get(field)
    if isinstance(value, (int, float)) and math.isfinite(value):
        return float(value) * scale
    return None


def _status(entry: dict[str, Any] | None) -> str:
    if entry is None:
        return "–"
    if "na" in entry:
        return "n/a"  # the reason is printed under the table
    for key, prefix in (("error", "error: "), ("skipped", "")):
        if key in entry:
            text = str(entry[key]).splitlines()[0] if entry[key] else key
            return prefix + (text if len(text) <= 48 else text[:45] + "...")
    return "–"


def _fmt(value: float) -> str:
    if value >= 1000:
        return f"{value:,.0f}"
    if value >= 100:
        return f"{value:.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def _oriented_ratio(row: Row, t_val: float | None, a_val: float | None) -> float | None:
    """actorrpc against torch, > 1 when actorrpc is better (None without both figures)."""
    if not (t_val and a_val):
        return None
    return a_val / t_val if row.higher_better else t_val / a_val


def round_ratios(results: dict[str, Any]) -> dict[str, list[float | None]]:
    """Per table row, the ratio within each interleaved round (``bench_rpc.py --rounds``).

    A round measures torch and actorrpc one right after the other, so its ratio is
    taken in one phase of a host whose speed changes; empty without rounds.
    """
    torch_rounds = (results.get("torch") or {}).get("rounds") or []
    actor_rounds = (results.get("actorrpc") or {}).get("rounds") or []
    ratios: dict[str, list[float | None]] = {}
    for row in ROWS:
        ratios[row.label] = [
            _oriented_ratio(
                row,
                _value(_metric_entry(t, row.metric), row.field),
                _value(_metric_entry(a, row.metric), row.field),
            )
            for t, a in zip(torch_rounds, actor_rounds)
        ]
    return ratios if torch_rounds and actor_rounds else {}


def build_table(results: dict[str, Any], floor: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows of the ratio table as dicts (numbers plus display strings)."""
    table: list[dict[str, Any]] = []
    for row in ROWS:
        t_entry = _entry(results, "torch", row.metric)
        a_entry = _entry(results, "actorrpc", row.metric)
        t_val = _value(t_entry, row.field, row.scale)
        a_val = _value(a_entry, row.field, row.scale)
        ratio = _oriented_ratio(row, t_val, a_val)
        met = None if ratio is None or row.target is None else ratio >= row.target
        table.append(
            {
                "metric": row.label,
                "torch": t_val,
                "actorrpc": a_val,
                "ratio": ratio,
                "target": row.target_text,
                "met": met,
                "torch_text": _fmt(t_val) if t_val is not None else _status(t_entry),
                "actorrpc_text": _fmt(a_val) if a_val is not None else _status(a_entry),
            }
        )
        if row.metric == "rpc_sync" and row.field == "median_us":
            table.append(_floor_row(results, floor))
    return table


def _floor_row(results: dict[str, Any], floor: dict[str, Any]) -> dict[str, Any]:
    floor_us = _value(floor.get("rpc_sync"), "median_us")
    cells: dict[str, float | None] = {}
    for backend in ("torch", "actorrpc"):
        val = _value(_entry(results, backend, "rpc_sync"), "median_us")
        cells[backend] = val / floor_us if val and floor_us else None
    a_val = cells["actorrpc"]
    return {
        "metric": "rpc_sync median ÷ pyzmq floor RTT (×)",
        "torch": cells["torch"],
        "actorrpc": a_val,
        "ratio": None,
        "target": f"actorrpc ≤{FLOOR_TARGET:g}× floor",
        "met": None if a_val is None else a_val <= FLOOR_TARGET,
        "torch_text": _fmt(cells["torch"]) if cells["torch"] else "–",
        "actorrpc_text": _fmt(a_val) if a_val else _status(_entry(results, "actorrpc", "rpc_sync")),
    }


def markdown_table(table: list[dict[str, Any]]) -> str:
    lines = [
        "| metric | torch | actorrpc | ratio (>1 = actorrpc better) | target | met |",
        "|---|---:|---:|---:|---|:-:|",
    ]
    for r in table:
        ratio = f"{r['ratio']:.2f}×" if r["ratio"] is not None else "–"
        met = {True: "yes", False: "**no**", None: "–"}[r["met"]]
        lines.append(
            f"| {r['metric']} | {r['torch_text']} | {r['actorrpc_text']} | {ratio} "
            f"| {r['target']} | {met} |"
        )
    return "\n".join(lines)


def floor_table(results: dict[str, Any], floor: dict[str, Any]) -> str:
    """The bare-pyzmq floor and how far each backend is from it."""
    specs = (
        ("sync round trip, median (µs)", "rpc_sync", "median_us", "median_us", False),
        ("pipelined (msgs/s vs calls/s)", "rpc_async", "msgs_per_s", "calls_per_s", True),
        ("echo 1 MB (GB/s)", "echo_1mb", "gb_per_s", "gb_per_s", True),
        ("echo 64 MB (GB/s)", "echo_64mb", "gb_per_s", "gb_per_s", True),
    )
    lines = [
        "| pyzmq floor metric | floor | torch vs floor | actorrpc vs floor |",
        "|---|---:|---:|---:|",
    ]
    for label, metric, f_field, b_field, higher in specs:
        f_val = _value(floor.get(metric), f_field)
        cells = []
        for backend in ("torch", "actorrpc"):
            b_val = _value(_entry(results, backend, metric), b_field)
            if f_val and b_val:
                rel = b_val / f_val
                cells.append(f"{rel:.0%} of floor" if higher else f"{rel:.2f}× floor")
            else:
                cells.append("–")
        f_text = _fmt(f_val) if f_val else _status(floor.get(metric) or {"error": "not run"})
        lines.append(f"| {label} | {f_text} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def error_lines(results: dict[str, Any], floor: dict[str, Any]) -> list[str]:
    """Full text of every error / n/a, for printing under the table."""
    out: list[str] = []
    sources = [(f"{b}.{m}", e) for b, r in results.items() for m, e in r.get("metrics", {}).items()]
    sources += [(f"pyzmq-floor.{m}", e) for m, e in floor.items() if m != "rounds"]
    for backend, res in results.items():
        sources += [(f"{backend}.{k}", e) for k, e in res.get("problems", {}).items()]
    seen: set[str] = set()
    for where, entry in sources:
        if isinstance(entry, dict):
            for key in ("error", "na"):
                if key in entry:
                    if entry[key] in seen:  # the same failure already printed
                        out.append(f"{where}: (same as above)")
                        continue
                    seen.add(entry[key])
                    out.append(f"{where}: {entry[key]}")
                    if entry.get("traceback"):
                        out.append("    " + entry["traceback"].rstrip().replace("\n", "\n    "))
    return out


def write_json(path: Path, report: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, sort_keys=False, default=str) + "\n")


def write_chart(
    path: Path, results: dict[str, Any], floor: dict[str, Any], subtitle: str = ""
) -> str:
    """Grouped bars (torch vs actorrpc vs pyzmq floor); returns a status line."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "chart skipped: matplotlib is not installed (pip install matplotlib)"
    latency = (
        ("rpc_sync p50\n(µs)", "rpc_sync", "median_us", 1.0),
        ("rpc_sync p99\n(µs)", "rpc_sync", "p99_us", 1.0),
        ("remote+to_here\np50 (µs)", "remote", "median_us", 1.0),
        ("autograd iter\np50 (µs)", "autograd", "median_us", 1.0),
        ("init_rpc\n(ms)", "init", "init_s_max", 1e3),
    )
    throughput = (
        ("rpc_async\n(calls/s)", "rpc_async", "calls_per_s", "msgs_per_s"),
        ("echo 1 MB\n(GB/s)", "echo_1mb", "gb_per_s", "gb_per_s"),
        ("echo 64 MB\n(GB/s)", "echo_64mb", "gb_per_s", "gb_per_s"),
    )
    series = [("torch", "tab:blue"), ("actorrpc", "tab:orange"), ("pyzmq floor", "tab:gray")]
    fig, axes = plt.subplots(1, 2, figsize=(14, 5.5))
    panels: list[tuple[Any, str, list[str], list[list[float]]]] = []
    lat_vals = [
        [_value(_entry(results, b, m), f, s) or math.nan for (_, m, f, s) in latency]
        for b in ("torch", "actorrpc")
    ]
    lat_vals.append(
        [
            _value(floor.get(m), f) or math.nan if m == "rpc_sync" else math.nan
            for (_, m, f, _s) in latency
        ]
    )
    panels.append(
        (axes[0], "latency (lower is better, log scale)", [x[0] for x in latency], lat_vals)
    )
    thr_vals = [
        [_value(_entry(results, b, m), f) or math.nan for (_, m, f, _ff) in throughput]
        for b in ("torch", "actorrpc")
    ]
    thr_vals.append([_value(floor.get(m), ff) or math.nan for (_, m, _f, ff) in throughput])
    panels.append(
        (axes[1], "throughput (higher is better, log scale)", [x[0] for x in throughput], thr_vals)
    )
    width = 0.27
    for ax, title, labels, values in panels:
        for i, (name, color) in enumerate(series):
            xs = [j + (i - 1) * width for j in range(len(labels))]
            bars = ax.bar(xs, values[i], width, label=name, color=color)
            for bar, val in zip(bars, values[i]):
                if val > 0:
                    ax.annotate(
                        _fmt(val),
                        (bar.get_x() + bar.get_width() / 2, val),
                        ha="center",
                        va="bottom",
                        fontsize=7,
                    )
        ax.set_xticks(range(len(labels)), labels, fontsize=8)
        ax.set_yscale("log")
        ax.set_title(title)
        ax.legend(fontsize=8)
    title = "actorrpc vs torch.distributed.rpc (TensorPipe), 2 processes, TCP loopback"
    fig.suptitle(f"{title}\n{subtitle}" if subtitle else title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"chart written to {path}"
