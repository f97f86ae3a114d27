"""The public RPC API: ``init_rpc``, ``rpc_sync``, ``rpc_async``, ``remote``, ``shutdown``."""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Callable
from typing import Any

from . import autograd as _autograd  # noqa: F401 - registers its agent plugin
from ._environment import LaunchEnvironment, launch_environment
from .agent import (
    Agent,
    Future,
    WorkerInfo,
    coerce_options,
    current_agent,
    set_current_agent,
    validate_worker_name,
)
from .agent._current import current_agent_or_none
from .errors import AlreadyInitializedError, InvalidArgumentError
from .rref import remote as remote
from .serialization import check_extension_codes

__all__ = [
    "get_rpc_timeout",
    "get_worker_info",
    "get_worker_infos",
    "init_rpc",
    "is_initialized",
    "remote",
    "rpc_async",
    "rpc_sync",
    "shutdown",
]

_init_lock = threading.Lock()
_ACCEPTED_BACKENDS = {"ZMQ", "TENSORPIPE", "PROCESS_GROUP"}
_froze_gc = False  # init_rpc froze the collector's objects, and shutdown unfreezes them


def _freeze_gc() -> None:
    """See ``ZmqRpcBackendOptions.freeze_gc``; objects frozen before (by the user) stay so."""
    global _froze_gc
    _froze_gc = gc.get_freeze_count() == 0
    gc.freeze()


def _unfreeze_gc() -> None:
    global _froze_gc
    if _froze_gc:
        gc.unfreeze()
        _froze_gc = False


def _from_environment(value: int | None, variable: str, what: str) -> int:
    if value is None:
        raise InvalidArgumentError(
            f"{what} was not given and the environment does not say it: set {variable} "
            "(torchrun and `actorrpc launch` do), or run under SLURM (SLURM_PROCID/SLURM_NTASKS)"
        )
    return value


def _export_master(environment: LaunchEnvironment) -> None:
    """Make ``env://`` work under SLURM: publish the master address it implies."""
    if environment.source == "SLURM":
        if environment.master_addr and not os.environ.get("MASTER_ADDR"):
            os.environ["MASTER_ADDR"] = environment.master_addr
        if environment.master_port and not os.environ.get("MASTER_PORT"):
            os.environ["MASTER_PORT"] = str(environment.master_port)


def init_rpc(
    name: str | None,
    backend: Any = None,
    rank: int = -1,
    world_size: int | None = None,
    rpc_backend_options: Any = None,
) -> None:
    """Join (with the others, form) the RPC group; returns when every worker is known.

    Args:
        name: this worker's unique name: letters, digits, ``_``, ``-``, ``:``,
            shorter than 128 characters. ``None`` takes ``ACTORRPC_WORKER_NAME``
            (set by ``actorrpc launch --names``), else ``worker<rank>``.
        backend: ``None`` or a :class:`BackendType` (``TENSORPIPE`` and
            ``PROCESS_GROUP`` are accepted aliases of the ZeroMQ backend).
        rank: this worker's unique rank; ``-1`` reads ``RANK`` (or ``SLURM_PROCID``);
            in a dynamic group ``-1`` without ``RANK`` takes the next free rank.
        world_size: the number of workers; ``None`` reads ``WORLD_SIZE`` (or
            ``SLURM_NTASKS``). Under SLURM the first host of
            ``SLURM_JOB_NODELIST`` becomes ``MASTER_ADDR``. When neither gives
            a world size the group is *dynamic*: this worker joins the group
            running at ``init_method`` (or starts it), ``shutdown`` leaves it
            while the others go on, and :func:`get_worker_infos` shows who is
            there now.
        rpc_backend_options: :class:`ZmqRpcBackendOptions` or torch's
            ``TensorPipeRpcBackendOptions`` (its init_method, rpc_timeout and
            num_worker_threads are honoured).

    Raises:
        InvalidNameError: the name breaks the rule.
        AlreadyInitializedError: RPC is already initialized in this process.
        RendezvousError: duplicate names or ranks, a group that never fills or
            an unreachable master, within ``init_timeout``; or this process's
            ``copyreg`` registry holds the pickle extension codes actorrpc sends
            tensors with (``serialization._extension_codes``).

    Example::

        >>> # on worker1 (another process):
        >>> rpc.init_rpc("worker1", rank=1, world_size=2)
        >>> rpc.shutdown()
        >>> # on worker0:
        >>> rpc.init_rpc("worker0", rank=0, world_size=2)
        >>> rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1))
        tensor([2., 2.])
        >>> rpc.shutdown()

    A dynamic group (no world size anywhere)::

        >>> # a driver, e.g. a notebook
        >>> rpc.init_rpc("driver")
        >>> # later, in another process
        >>> rpc.init_rpc("helper")
        >>> # on the driver
        >>> [w.name for w in rpc.get_worker_infos()]
        ['driver', 'helper']
    """
    if name is not None:
        validate_worker_name(name)
    environment = launch_environment()
    dynamic = world_size is None and environment.world_size is None
    if rank is None or rank < 0:
        rank = environment.rank if dynamic and environment.rank is not None else (
            -1 if dynamic else _from_environment(environment.rank, "RANK", "rank")
        )
    if name is None:
        name = os.environ.get("ACTORRPC_WORKER_NAME") or (f"worker{rank}" if rank >= 0 else None)
        if name is None:
            raise InvalidArgumentError(
                "a worker joining a dynamic group without a rank needs a name"
            )
        validate_worker_name(name)
    if backend is not None and getattr(backend, "name", backend) not in _ACCEPTED_BACKENDS:
        raise TypeError(f"backend must be an actorrpc.BackendType, got {backend!r}")
    options = coerce_options(rpc_backend_options)
    if world_size is None and not dynamic:
        world_size = _from_environment(environment.world_size, "WORLD_SIZE", "world_size")
    _export_master(environment)
    if world_size is not None and (world_size < 1 or not 0 <= rank < world_size):
        raise InvalidArgumentError(f"rank {rank} is not in range for world_size {world_size}")
    with _init_lock:
        if current_agent_or_none() is not None:
            raise AlreadyInitializedError("RPC is already initialized in this process")
        # (before the rendezvous: peers would send codes this process decodes otherwise)
        check_extension_codes()
        if options.freeze_gc:  # first: a full collection may otherwise land in the rendezvous
            _freeze_gc()
        try:
            agent = Agent(name, rank, world_size, options)
            # current once the group is known, before serving starts: served functions use it
            agent.start(on_joined=lambda: set_current_agent(agent))
        except BaseException:
            set_current_agent(None)
            _unfreeze_gc()
            raise


def is_initialized() -> bool:
    """Whether this process is in an RPC group.

    Example::

        >>> # on worker0
        >>> rpc.is_initialized()
        False
        >>> rpc.init_rpc("worker0", rank=0, world_size=2)
        >>> rpc.is_initialized()
        True
    """
    return current_agent_or_none() is not None


def shutdown(graceful: bool = True, timeout: float | None = None) -> None:
    """Leave the group and free sockets and threads.

    With ``graceful=True`` it first waits until every worker has called
    ``shutdown`` and all outstanding work, incoming and outgoing, is done; a peer
    that never arrives makes it raise :class:`ShutdownError` naming that peer
    after ``timeout`` seconds (default: the options' ``shutdown_timeout``),
    never block forever. ``graceful=False`` closes this worker at once.

    Example::

        >>> # on every worker, after the work
        >>> rpc.shutdown()
    """
    with _init_lock:
        agent = current_agent()
        try:
            agent.shutdown(graceful, timeout)
        finally:
            set_current_agent(None)
            _unfreeze_gc()


def get_worker_info(worker_name: str | None = None) -> WorkerInfo:
    """The :class:`WorkerInfo` of ``worker_name``, or of this worker when ``None``.

    Raises :class:`UnknownWorkerError` (a ``ValueError``) listing the known names.

    Example::

        >>> rpc.get_worker_info("worker1")
        WorkerInfo(id=1, name=worker1)
    """
    agent = current_agent()
    if worker_name is None:
        return agent.info
    return agent.resolve(worker_name)


def get_worker_infos() -> list[WorkerInfo]:
    """Every worker of the group, ordered by id.

    Example::

        >>> # on worker0 (or worker1: same list)
        >>> rpc.get_worker_infos()
        [WorkerInfo(id=0, name=worker0), WorkerInfo(id=1, name=worker1)]
    """
    return current_agent().worker_infos()


def get_rpc_timeout() -> float:
    """The default timeout of calls, in seconds (the options' ``rpc_timeout``).

    Example::

        >>> # on worker0, started without rpc_backend_options
        >>> rpc.get_rpc_timeout()
        60.0
    """
    return current_agent().options.rpc_timeout


def rpc_async(
    to: Any,
    func: Callable[..., Any],
    args: tuple[Any, ...] | None = None,
    kwargs: dict[str, Any] | None = None,
    timeout: float = -1.0,
) -> Future[Any]:
    """Run ``func(*args, **kwargs)`` on ``to`` and return a Future of its result.

    The Future is a ``torch.futures.Future`` (``wait``, ``then``, ``done``,
    ``value``, ``torch.futures.wait_all``) and is also awaitable in asyncio.
    Unpicklable arguments raise :class:`SerializationError` here, before
    anything is sent.

    Args:
        to: destination name, rank or :class:`WorkerInfo` (this worker works too).
        timeout: seconds; ``-1`` uses the default, ``0`` waits forever.

    Example::

        >>> # on worker0
        >>> fut = rpc.rpc_async("worker1", torch.add, args=(torch.ones(2), 3))
        >>> fut.wait()
        tensor([4., 4.])
    """
    agent = current_agent()
    return agent.call(agent.members.resolve(to), func, tuple(args or ()), dict(kwargs or {}),
                      timeout)


def rpc_sync(
    to: Any,
    func: Callable[..., Any],
    args: tuple[Any, ...] | None = None,
    kwargs: dict[str, Any] | None = None,
    timeout: float = -1.0,
) -> Any:
    """Run ``func(*args, **kwargs)`` on ``to`` and wait for the result.

    A remote exception is re-raised here as the same type with the remote
    worker and traceback in its message. A timeout raises
    :class:`RpcTimeoutError` ("RPC ran for more than set timeout ...").

    Example::

        >>> # on worker0
        >>> rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 3))
        tensor([4., 4.])
    """
    agent = current_agent()
    return agent.call_and_wait(agent.members.resolve(to), func, tuple(args or ()),
                               dict(kwargs or {}),
                               timeout)
