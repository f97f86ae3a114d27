"""Carrying exceptions across workers.

An exception raised by a remote function travels as
``(type, args, repr, traceback, worker)``. The caller rebuilds the same type
with a message naming the worker and holding the remote traceback (torch's
format: ``"On WorkerInfo(id=1, name=w1):\\nValueError('...')\\nTraceback ..."``);
when that type cannot be rebuilt it raises :class:`RemoteError`.
"""

from __future__ import annotations

import pickle
import traceback
from typing import Any

from ..errors import RemoteError

__all__ = ["pack_exception", "rebuild_exception"]

ExceptionInfo = tuple[Any, str, str, str]


def pack_exception(exc: BaseException, worker: str) -> ExceptionInfo:
    """Describe ``exc`` in a form that always pickles."""
    exc_type: Any = type(exc)
    try:
        pickle.dumps(exc_type)
    except Exception:
        exc_type = None
    formatted = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return exc_type, repr(exc), formatted, worker


def rebuild_exception(info: ExceptionInfo) -> BaseException:
    exc_type, exc_repr, formatted, worker = info
    message = f"On {worker}:\n{exc_repr}\n{formatted}"
    if isinstance(exc_type, type) and issubclass(exc_type, BaseException):
        try:
            exc = exc_type(message)
            if isinstance(exc, exc_type):
                return exc
        except Exception:  # noqa: BLE001 - fall back to RemoteError below
            pass
    type_name = exc_repr.split("(", 1)[0]
    return RemoteError(message, worker=worker, remote_type=type_name, remote_traceback=formatted)
