"""Transport layer: ZeroMQ sockets, authentication, same-host shared memory."""

from ._shared_memory import SharedMemoryPool, map_shared_buffer, shared_memory_available
from ._zmq import SECURITY_MODES, PeerLink, Transport

__all__ = [
    "SECURITY_MODES",
    "PeerLink",
    "SharedMemoryPool",
    "Transport",
    "map_shared_buffer",
    "shared_memory_available",
]
