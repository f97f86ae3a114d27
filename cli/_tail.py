"""Whole-line tee of a worker's output file, for torch's elastic launcher.

Workers run with ``python -u``, so ``print(text)`` reaches the file as two
writes: ``text``, then ``"\\n"``. torch's ``tail_logfile`` passes on whatever
``readline`` returns, so a line read between the two writes came out as a
prefixed fragment with the other ranks' lines spliced into it. Here a line is
passed on only once it is whole (or, at the end, once the worker has exited).
As in text mode, ``\r`` and ``\r\n`` end a line too (a progress bar's refreshes
come out as they happen), and a line that grows past :data:`LONGEST_LINE`
characters is passed on in pieces of that size.
"""

from __future__ import annotations

import codecs
import contextlib
import io
import os
import threading
import time
from collections.abc import Callable, Iterator
from threading import Event
from typing import TextIO

from torch.distributed.elastic.multiprocessing import tail_log

__all__ = ["LONGEST_LINE", "LineAssembler", "tail_whole_lines", "whole_line_tails"]

LONGEST_LINE = 65536
"""Characters of a line without an end that are held back at most."""


class LineAssembler:
    """Turns text read in arbitrary pieces into whole lines."""

    def __init__(self) -> None:
        self._partial = ""

    def feed(self, text: str) -> list[str]:
        """The lines that ``text`` completes, each ending in ``"\\n"`` (a line longer
        than :data:`LONGEST_LINE` in pieces)."""
        pieces = (self._partial + text).split("\n")
        partial = pieces.pop()
        lines = [piece + "\n" for piece in pieces]
        while len(partial) > LONGEST_LINE:
            lines.append(partial[:LONGEST_LINE] + "\n")
            partial = partial[LONGEST_LINE:]
        self._partial = partial
        return lines

    def finish(self) -> list[str]:
        """What is left once the writer is done: a last line without its newline."""
        rest, self._partial = self._partial, ""
        return [rest + "\n"] if rest else []


def tail_whole_lines(
    header: str,
    file: str,
    dst: TextIO,
    finished: Event,
    interval_sec: float,
    log_line_filter: Callable[[str], bool] | None = None,
) -> None:
    """Drop-in for torch's ``tail_logfile`` that writes ``header + line`` per whole line."""
    while not os.path.exists(file):
        if finished.is_set():
            return
        time.sleep(interval_sec)  # the file appears when the worker starts: poll as torch does
    assembler = LineAssembler()

    def emit(lines: list[str]) -> None:
        for line in lines:
            if log_line_filter is None or log_line_filter(line):
                dst.write(f"{header}{line}")

    # A character may be split between writes as a line may; "\r" and "\r\n" end
    # lines as in text mode (a "\r" at the end of a read waits for what follows it).
    decoder = io.IncrementalNewlineDecoder(
        codecs.getincrementaldecoder("utf-8")(errors="replace"), translate=True
    )
    with open(file, "rb") as fp:
        while True:
            done = finished.is_set()  # read before the last drain: nothing written after is lost
            text = decoder.decode(fp.read(), final=done)
            if text:
                emit(assembler.feed(text))
            elif done:
                emit(assembler.finish())
                return
            else:
                time.sleep(interval_sec)


_swap_lock = threading.Lock()
_swap_users = 0
_torch_tail = tail_log.tail_logfile


@contextlib.contextmanager
def whole_line_tails() -> Iterator[None]:
    """Within the block, torch's launcher tees workers' output with ``tail_whole_lines``
    (blocks may overlap in threads: torch's function is back once the last one ends)."""
    global _swap_users
    with _swap_lock:
        _swap_users += 1
        tail_log.tail_logfile = tail_whole_lines  # type: ignore[assignment]
    try:
        yield
    finally:
        with _swap_lock:
            _swap_users -= 1
            if not _swap_users:
                tail_log.tail_logfile = _torch_tail
