"""RRef layer: the Remote Reference Protocol, ``remote()`` and the actor proxies."""

from ._context import GloballyUniqueId, RRefContext
from ._proxy import RRefProxy
from ._remote import debug_info, remote
from ._rref import RRef, rref_context

__all__ = [
    "GloballyUniqueId",
    "RRef",
    "RRefContext",
    "RRefProxy",
    "debug_info",
    "remote",
    "rref_context",
]
