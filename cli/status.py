"""``actorrpc status``: print the statistics a running group publishes to its rendezvous store."""

from __future__ import annotations

import json
import time
from datetime import timedelta
from typing import Any

import click

__all__ = ["read_status", "status"]


def read_status(master_addr: str, master_port: int, timeout: float) -> list[dict[str, Any]]:
    """Every worker's latest published statistics, ordered by rank."""
    from torch.distributed import TCPStore

    store = TCPStore(
        master_addr, master_port, None, False, timedelta(seconds=timeout), wait_for_workers=False
    )
    if not store.check(["actorrpc/status/world"]):
        return []
    world = int(store.get("actorrpc/status/world"))
    workers = []
    for rank in range(world):
        key = f"actorrpc/status/{rank}"
        if store.check([key]):
            workers.append(json.loads(store.get(key)))
    return workers


def _table(workers: list[dict[str, Any]]) -> str:
    columns = ["rank", "worker", "sent", "served", "in flight", "bytes out", "bytes in",
               "owner rrefs", "forks", "contexts", "threads", "queued", "age s", "dead peers"]
    rows = [columns]
    now = time.time()
    for w in workers:
        in_flight = sum(p["calls_in_flight"] for p in w["peers"].values())
        rref = w.get("rref", {})
        autograd = w.get("autograd", {}) or w.get("dist_autograd", {})
        rows.append([
            str(w["rank"]), w["worker"], str(w["calls_sent"]), str(w["requests_served"]),
            str(in_flight), str(w["bytes_out"]), str(w["bytes_in"]),
            str(rref.get("num_owner_rrefs", "-")), str(rref.get("num_forks", "-")),
            str(autograd.get("num_autograd_contexts", "-")),
            str(w["pool_threads"]), str(w["pool_queued"]),
            f"{now - w.get('published_at', now):.1f}", ",".join(w["dead_peers"]) or "-",
        ])
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    return "\n".join("  ".join(c.rjust(wd) for c, wd in zip(row, widths)) for row in rows)


@click.command()
@click.option("--master-addr", default="127.0.0.1", show_default=True,
              help="Address of the group's rendezvous store (MASTER_ADDR).")
@click.option("--master-port", type=click.IntRange(1, 65535), required=True,
              help="Port of the group's rendezvous store (MASTER_PORT).")
@click.option("--timeout", type=float, default=5.0, show_default=True,
              help="Seconds to wait for the store.")
@click.option("--json", "as_json", is_flag=True, help="Print the raw statistics as JSON.")
def status(master_addr: str, master_port: int, timeout: float, as_json: bool) -> None:
    """Print a table of every worker's statistics (calls, bytes, RRefs, contexts, queues).

    Workers publish their statistics to the rendezvous store every 2 seconds while they
    change, and at least every 30 seconds ("age s": seconds since a worker's last).
    """
    try:
        workers = read_status(master_addr, master_port, timeout)
    except Exception as exc:  # noqa: BLE001 - shown to the user, exit 1
        raise click.ClickException(
            f"cannot read the status from {master_addr}:{master_port}: {exc}"
        ) from exc
    if not workers:
        raise click.ClickException(f"no actorrpc group publishes at {master_addr}:{master_port}")
    click.echo(json.dumps(workers, indent=2) if as_json else _table(workers))
