"""Every log record of actorrpc names the worker it comes from.

A filter on the ``actorrpc`` loggers sets ``record.worker`` (the worker's name,
or ``-`` outside a group) and prefixes the message with ``[worker]`` unless the
message already starts with it, so plain ``logging.basicConfig()`` output shows
where each record was made; formats can also use ``%(worker)s``.
"""

from __future__ import annotations

import logging

from .agent._current import current_agent_or_none

__all__ = ["WorkerNameFilter", "install_worker_name_filter"]


class WorkerNameFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        agent = current_agent_or_none()
        worker = agent.name if agent is not None else "-"
        record.worker = worker
        if not getattr(record, "_actorrpc_prefixed", False):
            record.msg = f"[{worker}] {record.msg}"
            record._actorrpc_prefixed = True
        return True


def install_worker_name_filter() -> None:
    """Add the filter to the ``actorrpc`` logger and each of its existing children.

    (A logger's filters see only the records made on that logger, not those
    propagated from its children.)
    """
    names = ["actorrpc"] + [
        name for name in logging.root.manager.loggerDict if name.startswith("actorrpc.")
    ]
    for name in names:
        logger = logging.getLogger(name)
        if not any(isinstance(f, WorkerNameFilter) for f in logger.filters):
            logger.addFilter(WorkerNameFilter())
