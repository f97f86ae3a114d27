"""Distributed autograd: ``import actorrpc.autograd as dist_autograd``.

The API of ``torch.distributed.autograd``: :class:`context`, :func:`backward`,
:func:`get_gradients`, plus torch's private helpers used by its tests
(``_current_context``, ``_retrieve_context``, ``_get_max_id``,
``_get_debug_info``), :func:`debug_info` (contexts, send/recv functions, known
workers on this worker) and ``_wait_for_cleanup`` (wait until the releases of
contexts left here were acknowledged by every worker, transitively).

Distributed backward is a message-driven graph traversal keyed by the autograd
context id (see :mod:`actorrpc.autograd._engine`). Unlike torch's FAST mode it
only sends gradients along paths that actually reach the roots, so an RPC output
that does not contribute to the loss cannot make ``backward`` hang.

Importing this package registers the agent plugin, so every agent created
afterwards records the distributed graph. Importing it while an agent is already
running installs it on that agent too.
"""

from __future__ import annotations

from ..agent import current_agent, register_agent_plugin
from ..errors import NotInitializedError
from ._api import (
    _current_context,
    _get_debug_info,
    _get_max_id,
    _retrieve_context,
    _wait_for_cleanup,
    backward,
    context,
    debug_info,
    get_gradients,
    is_available,
)
from ._context import DistAutogradContext
from ._engine import install as _install

__all__ = [
    "DistAutogradContext",
    "backward",
    "context",
    "debug_info",
    "get_gradients",
    "is_available",
]

register_agent_plugin(_install)


def _install_on_running_agent() -> None:
    try:
        agent = current_agent()
    except NotInitializedError:
        return
    _install(agent)  # idempotent


_install_on_running_agent()

# Silence "imported but unused" for the private helpers re-exported above.
_PRIVATE = (_current_context, _get_debug_info, _get_max_id, _retrieve_context, _wait_for_cleanup)
