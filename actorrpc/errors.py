"""The one exception tree of actorrpc.

Every error raised by actorrpc derives from :class:`ActorRpcError`, which is a
:class:`RuntimeError` (torch code catches ``RuntimeError``). Where a built-in
category exists the error also derives from it, so existing ``except`` clauses
keep working::

    ActorRpcError(RuntimeError)
    ├── NotInitializedError            calls before init_rpc / after shutdown
    ├── AlreadyInitializedError        init_rpc called twice
    ├── InvalidArgumentError(ValueError)
    │   ├── InvalidNameError           worker name breaks the naming rule
    │   └── UnknownWorkerError         no worker with that name / rank
    ├── RpcTimeoutError(TimeoutError)  "RPC ran for more than set timeout ..."
    ├── RendezvousError                init_rpc could not form the group
    ├── SerializationError(TypeError)  an argument or result cannot be pickled
    ├── DeserializationError           bytes from a peer cannot be unpickled
    ├── ProtocolError(ValueError)      a malformed frame or message
    ├── RemoteError                    remote exception that cannot be rebuilt
    ├── PeerUnreachableError(ConnectionError)  a peer is gone or cannot be reached
    │   └── WorkerLeftError            the worker left a dynamic group
    ├── ShutdownError                  graceful shutdown could not complete
    ├── RRefError                      misuse of an RRef (see the rref package)
    └── DistAutogradError              distributed autograd failures
"""

from __future__ import annotations

__all__ = [
    "ActorRpcError",
    "AlreadyInitializedError",
    "DeserializationError",
    "DistAutogradError",
    "InvalidArgumentError",
    "InvalidNameError",
    "NotInitializedError",
    "PeerUnreachableError",
    "ProtocolError",
    "RRefError",
    "RemoteError",
    "RendezvousError",
    "RpcTimeoutError",
    "SerializationError",
    "ShutdownError",
    "UnknownWorkerError",
    "WorkerLeftError",
]


class ActorRpcError(RuntimeError):
    """Base class of every error raised by actorrpc."""


class NotInitializedError(ActorRpcError):
    """An API call needs an initialized RPC agent (``init_rpc`` first)."""


class AlreadyInitializedError(ActorRpcError):
    """``init_rpc`` was called while RPC is already initialized."""


class InvalidArgumentError(ActorRpcError, ValueError):
    """An argument has a wrong value."""


class InvalidNameError(InvalidArgumentError):
    """A worker name breaks the naming rule."""


class UnknownWorkerError(InvalidArgumentError):
    """No worker with the given name, rank or ``WorkerInfo`` is in the group."""


class RpcTimeoutError(ActorRpcError, TimeoutError):
    """A call did not complete within its timeout.

    The message always contains ``"RPC ran for more than"``, the text torch
    code matches on.
    """


class RendezvousError(ActorRpcError):
    """The group could not be formed during ``init_rpc``."""


class SerializationError(ActorRpcError, TypeError):
    """An object could not be pickled; the message names the object."""


class DeserializationError(ActorRpcError):
    """Bytes received from a peer could not be unpickled."""

    taken_over: tuple[object, ...] = ()
    """What this side took over from the sender before the failure (RRef forks rebuilt),
    reported back so that the sender undoes only the rest."""


class ProtocolError(ActorRpcError, ValueError):
    """A malformed frame, header or message was received."""


class RemoteError(ActorRpcError):
    """An exception raised on a remote worker that could not be rebuilt locally.

    Attributes:
        worker: name of the worker the exception was raised on.
        remote_type: qualified name of the remote exception's type.
        remote_traceback: the formatted remote traceback.
    """

    def __init__(
        self, message: str, worker: str = "", remote_type: str = "", remote_traceback: str = ""
    ) -> None:
        super().__init__(message)
        self.worker = worker
        self.remote_type = remote_type
        self.remote_traceback = remote_traceback


class PeerUnreachableError(ActorRpcError, ConnectionError):
    """A peer worker is gone, has left, or cannot be reached."""


class WorkerLeftError(PeerUnreachableError):
    """The worker left the (dynamic) group: new calls to it fail, waiting ones too."""


class ShutdownError(ActorRpcError):
    """Graceful shutdown could not complete (a peer never arrived, or leaks in strict mode)."""


class RRefError(ActorRpcError):
    """An RRef was used in a way the Remote Reference Protocol does not allow."""


class DistAutogradError(ActorRpcError):
    """A distributed autograd operation failed."""
