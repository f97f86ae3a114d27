"""Transport layer: ZeroMQ sockets, authentication, and nothing else."""

from ._zmq import SECURITY_MODES, PeerLink, Transport

__all__ = ["SECURITY_MODES", "PeerLink", "Transport"]
