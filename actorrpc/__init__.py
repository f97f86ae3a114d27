"""actorrpc: PyTorch's distributed RPC framework on ZeroMQ.

``import actorrpc as rpc`` replaces ``import torch.distributed.rpc as rpc``.
Torch-specific names are accepted aliases: ``TensorPipeRpcBackendOptions`` is
:class:`ZmqRpcBackendOptions`, and ``BackendType.TENSORPIPE`` selects the
ZeroMQ backend.
"""

from . import autograd, functions
from ._api import (
    get_rpc_timeout,
    get_worker_info,
    get_worker_infos,
    init_rpc,
    is_initialized,
    remote,
    rpc_async,
    rpc_sync,
    shutdown,
)
from ._compiled import compiled_modules
from ._inspection import get_worker_stats, start_tracing, stop_tracing
from ._local import LocalWorkers, local_workers
from ._logging import install_worker_name_filter as _install_worker_name_filter
from .agent import BackendType, Future, WorkerInfo, ZmqRpcBackendOptions
from .errors import (
    ActorRpcError,
    AlreadyInitializedError,
    DeserializationError,
    DistAutogradError,
    InvalidArgumentError,
    InvalidNameError,
    NotInitializedError,
    PeerUnreachableError,
    ProtocolError,
    RemoteError,
    RendezvousError,
    RpcTimeoutError,
    RRefError,
    SerializationError,
    ShutdownError,
    UnknownWorkerError,
    WorkerLeftError,
)
from .rref import RRef
from .rref import debug_info as get_rref_debug_info

_install_worker_name_filter()

TensorPipeRpcBackendOptions = ZmqRpcBackendOptions
"""Accepted alias of :class:`ZmqRpcBackendOptions` for code written for torch."""
RpcBackendOptions = ZmqRpcBackendOptions
"""Accepted alias of :class:`ZmqRpcBackendOptions`."""


def is_available() -> bool:
    """Always ``True``: actorrpc needs nothing beyond its dependencies.

    Example::

        >>> import actorrpc as rpc
        >>> rpc.is_available()
        True
    """
    return True


__version__ = "0.1.0"

__all__ = [
    "ActorRpcError",
    "AlreadyInitializedError",
    "BackendType",
    "DeserializationError",
    "DistAutogradError",
    "Future",
    "InvalidArgumentError",
    "InvalidNameError",
    "LocalWorkers",
    "NotInitializedError",
    "PeerUnreachableError",
    "ProtocolError",
    "RRef",
    "RRefError",
    "RemoteError",
    "RendezvousError",
    "RpcBackendOptions",
    "RpcTimeoutError",
    "SerializationError",
    "ShutdownError",
    "TensorPipeRpcBackendOptions",
    "UnknownWorkerError",
    "WorkerInfo",
    "WorkerLeftError",
    "ZmqRpcBackendOptions",
    "autograd",
    "compiled_modules",
    "functions",
    "get_rpc_timeout",
    "get_rref_debug_info",
    "get_worker_info",
    "get_worker_infos",
    "get_worker_stats",
    "init_rpc",
    "is_available",
    "is_initialized",
    "local_workers",
    "remote",
    "rpc_async",
    "rpc_sync",
    "shutdown",
    "start_tracing",
    "stop_tracing",
]
