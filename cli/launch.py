"""``actorrpc launch``: start the local workers of an actorrpc job.

Built on torch's elastic launcher (``torch.distributed.launcher.api``): the
agent starts, watches and stops the workers, tees their output with a rank
prefix (whole lines only, see ``_tail``) and forwards SIGINT/SIGTERM to them.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import sys
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import click

from actorrpc._ports import free_ports

from ._tail import whole_line_tails
from ._worker import MASTER_PORT_ENV, NAMES_ENV, worker_name

__all__ = ["launch", "run_launch", "exit_code_of"]

SECRET_ENV = "ACTORRPC_SECRET"
DEFAULT_NAMES = "worker{rank}"
LOG_LINE_PREFIX = "[${rank}]: "
_WORKER_SHIM = Path(__file__).with_name("_worker.py")
# Exit codes that mean "stopped by the launcher", less telling than the cause.
_STOP_CODES = {-signal.SIGTERM, -signal.SIGKILL, 128 + signal.SIGTERM, 128 + signal.SIGKILL}


def check_names(pattern: str, world_size: int) -> list[str]:
    """Names of ranks ``0..world_size-1``; raises ValueError unless all are distinct."""
    names = [worker_name(pattern, rank) for rank in range(world_size)]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(
            f"--names {pattern!r} gives several workers the same name ({', '.join(duplicates)});"
            " put {rank} in the last item"
        )
    return names


def exit_code_of(exitcode: int) -> int:
    """Shell exit status for a worker's exit code (negative = killed by that signal)."""
    if exitcode < 0:
        return 128 - exitcode
    return exitcode if 0 < exitcode < 256 else 1


@contextlib.contextmanager
def _environ(values: Mapping[str, str]) -> Iterator[None]:
    """Set environment variables (which the workers inherit), restoring them afterwards."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


def run_launch(
    script: str,
    script_args: tuple[str, ...],
    *,
    nproc_per_node: int,
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    max_restarts: int = 0,
    names: str = DEFAULT_NAMES,
) -> int:
    """Run the workers of this node until they all end; return the exit status."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if nnodes == 1:
        ports = free_ports(master_addr, 2)
        agent_port = ports[1]
        if master_port is None or master_port == agent_port:
            master_port = ports[0]
    else:
        if master_port is None or master_port >= 65535:
            raise click.UsageError("--nnodes > 1 needs --master-port (below 65535)")
        agent_port = master_port + 1

    env = {
        SECRET_ENV: os.environ.get(SECRET_ENV) or secrets.token_hex(32),
        NAMES_ENV: names,
        MASTER_PORT_ENV: str(master_port),
    }
    if nproc_per_node > 1 and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = "1"  # as torchrun: keep N workers from oversubscribing

    log_dir_context = tempfile.TemporaryDirectory(prefix="actorrpc-launch-")
    with log_dir_context as log_dir, _environ(env), whole_line_tails():
        config = LaunchConfig(
            min_nodes=nnodes,
            max_nodes=nnodes,
            nproc_per_node=nproc_per_node,
            run_id="actorrpc",
            role="actorrpc",
            rdzv_backend="static",
            rdzv_endpoint=f"{master_addr}:{agent_port}",
            rdzv_configs={"rank": node_rank},
            max_restarts=max_restarts,
            monitor_interval=0.1,
            log_line_prefix_template=LOG_LINE_PREFIX,
            logs_specs=DefaultLogsSpecs(log_dir=log_dir, tee=Std.ALL),
        )
        try:
            elastic_launch(config, sys.executable)("-u", str(_WORKER_SHIM), script, *script_args)
        except ChildFailedError as err:
            rank, failure = min(
                err.failures.items(),
                key=lambda item: (item[1].timestamp, item[1].exitcode in _STOP_CODES, item[0]),
            )
            click.echo(
                f"actorrpc launch: worker {rank} failed with exit code {failure.exitcode};"
                " stopped the other workers",
                err=True,
            )
            return exit_code_of(failure.exitcode)
        except SignalException as err:
            click.echo(f"actorrpc launch: got {err.sigval.name}, stopped the workers", err=True)
            return 128 + int(err.sigval)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
    return 0


@click.command(
    context_settings={
        "ignore_unknown_options": True,
        "allow_interspersed_args": False,
        "help_option_names": ["-h", "--help"],
    }
)
@click.option(
    "--nproc-per-node",
    type=click.IntRange(min=1),
    required=True,
    help="Number of workers to start on this node.",
)
@click.option(
    "--nnodes",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Number of nodes in the job. Each node runs its own `actorrpc launch` with the same"
    " options but its own --node-rank; WORLD_SIZE = nnodes * nproc-per-node.",
)
@click.option(
    "--node-rank",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Rank of this node, 0 to nnodes-1. A worker's RANK is"
    " node-rank * nproc-per-node + LOCAL_RANK.",
)
@click.option(
    "--master-addr",
    default="127.0.0.1",
    show_default=True,
    help="Address of node 0, given to the workers as MASTER_ADDR.",
)
@click.option(
    "--master-port",
    type=click.IntRange(1, 65535),
    default=None,
    help="Port given to the workers as MASTER_PORT, left free for the job's own rendezvous."
    "  [default: a free port; required with --nnodes > 1]. The launcher's own store"
    " listens elsewhere: on a free port for one node, on MASTER_PORT+1 for several.",
)
@click.option(
    "--max-restarts",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="How many times to restart all workers of this node after one fails, before giving up.",
)
@click.option(
    "--names",
    "names",
    default=DEFAULT_NAMES,
    show_default=True,
    metavar="PATTERN",
    help="Worker names, given to each worker as ACTORRPC_WORKER_NAME: a comma-separated"
    " list whose item i names rank i and whose last item names every further rank, with"
    " {rank} (and {local_rank}) replaced, e.g. 'ps,trainer{rank}' gives ps, trainer1,"
    " trainer2, ...",
)
@click.argument("script", type=click.Path(exists=True, dir_okay=False))
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
def launch(
    script: str,
    script_args: tuple[str, ...],
    nproc_per_node: int,
    nnodes: int,
    node_rank: int,
    master_addr: str,
    master_port: int | None,
    max_restarts: int,
    names: str,
) -> None:
    """Start --nproc-per-node workers running `python SCRIPT [SCRIPT_ARGS]...`.

    \b
    Each worker gets in its environment:
      RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
      ACTORRPC_WORKER_NAME (from --names) and ACTORRPC_SECRET (the launcher's own
      ACTORRPC_SECRET if set, else a fresh random one shared by the local workers;
      with several nodes, export the same ACTORRPC_SECRET on every node).

    Every line a worker prints is prefixed with its rank, as in "[0]: ...".
    Ctrl-C (SIGINT) or SIGTERM is forwarded to the workers. When a worker fails,
    the others are stopped and the launcher exits with the failed worker's exit
    code (128+N for a worker killed by signal N).
    """
    if node_rank >= nnodes:
        raise click.BadParameter(f"must be below --nnodes ({nnodes})", param_hint="--node-rank")
    try:
        check_names(names, nnodes * nproc_per_node)
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--names") from err
    code = run_launch(
        script,
        script_args,
        nproc_per_node=nproc_per_node,
        nnodes=nnodes,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
        max_restarts=max_restarts,
        names=names,
    )
    if code:
        raise SystemExit(code)
