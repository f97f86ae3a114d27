"""Transport layer: ZeroMQ sockets, authentication, same-host shared memory."""

from ._shared_memory import SharedMappings, SharedMemoryPool, shared_memory_available
from ._spin import SpinGate
from ._zmq import SECURITY_MODES, PeerLink, Transport

__all__ = [
    "SECURITY_MODES",
    "PeerLink",
    "SharedMappings",
    "SharedMemoryPool",
    "SpinGate",
    "Transport",
    "shared_memory_available",
]
