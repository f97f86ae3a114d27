"""This process's agent (one at a time: between ``init_rpc`` and ``shutdown``), and the
plugins (RRefs, distributed autograd) that every new agent installs."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ..errors import NotInitializedError

if TYPE_CHECKING:
    from ._agent import Agent

__all__ = [
    "current_agent",
    "current_agent_or_none",
    "installed_plugins",
    "register_agent_plugin",
    "set_current_agent",
]

_plugins: list[Callable[[Agent], None]] = []
_current: Agent | None = None


def current_agent() -> Agent:
    """The agent of this process; :class:`NotInitializedError` before init or after shutdown."""
    agent = _current
    if agent is None:
        raise NotInitializedError(
            "RPC has not been initialized. Call actorrpc.init_rpc(...) first "
            "(after shutdown() it must be called again)"
        )
    return agent


def current_agent_or_none() -> Agent | None:
    return _current


def set_current_agent(agent: Agent | None) -> None:
    global _current
    _current = agent


def register_agent_plugin(install: Callable[[Agent], None]) -> None:
    """Run ``install(agent)`` for every agent created from now on (handlers, hooks)."""
    if install not in _plugins:
        _plugins.append(install)


def installed_plugins() -> tuple[Callable[[Agent], None], ...]:
    """What every new agent installs, in registration order."""
    return tuple(_plugins)
