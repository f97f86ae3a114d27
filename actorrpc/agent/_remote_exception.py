"""Carrying exceptions across workers.

An exception raised by a remote function travels as
``(type, args, repr, traceback, worker)``. The caller rebuilds the same type
with a message naming the worker and holding the remote traceback (torch's
format: ``"On WorkerInfo(id=1, name=w1):\\nValueError('...')\\nTraceback ..."``);
when that type cannot be rebuilt it raises :class:`RemoteError`.

Tracebacks are formatted here without the column markers (``^^^^``) of Python
3.11+: CPython 3.11 finds them with ``ast.parse``, whose AST constructor keeps
its recursion depth in per-interpreter state, so a parse in an agent thread
while another thread parses (pytest rendering a failure, IPython compiling a
notebook cell) can fail that other parse with ``SystemError: AST constructor
recursion depth mismatch`` (python/cpython#106905). Agent threads never parse.
"""

from __future__ import annotations

import pickle
import traceback
from typing import Any

from ..errors import RemoteError

__all__ = ["format_traceback", "pack_exception", "rebuild_exception"]

ExceptionInfo = tuple[Any, str, str, str]


def format_traceback(exc: BaseException, frames_only: bool = False) -> str:
    """``traceback.format_exception(exc)`` (only the frames: ``format_tb``), minus the
    column markers, so that formatting never calls ``ast.parse`` (see the module docs)."""
    report = traceback.TracebackException(type(exc), exc, exc.__traceback__)
    unseen, seen = [report], set()
    while unseen:  # this error, its cause, its context and a group's members
        current = unseen.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        for frame in current.stack:
            if getattr(frame, "colno", None) is not None:
                frame.colno = None  # no column: no markers to place
        members = getattr(current, "exceptions", None) or ()
        linked = (current.__cause__, current.__context__, *members)
        unseen.extend(other for other in linked if other is not None)
    return "".join(report.stack.format() if frames_only else report.format())


def pack_exception(exc: BaseException, worker: str) -> ExceptionInfo:
    """Describe ``exc`` in a form that always pickles."""
    exc_type: Any = type(exc)
    try:
        pickle.dumps(exc_type)
    except Exception:
        exc_type = None
    formatted = format_traceback(exc)
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
