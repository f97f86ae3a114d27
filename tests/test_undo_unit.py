"""Unit tests of the pieces that undo a message's side effects (no sockets).

The integration tests (``test_rref.py``: ``test_undecodable_request_undoes_the_forks_not_rebuilt``
and ``test_undecodable_reply_undoes_the_callees_forks_not_rebuilt``) cover the protocol;
these pin down the bookkeeping: what ``PickleTarget.abort`` runs, and what
``RecentEntries`` keeps.
"""

from __future__ import annotations

import threading

import pytest

from actorrpc.agent._calls import RecentEntries
from actorrpc.serialization import PickleTarget

pytestmark = pytest.mark.timeout(30)


def test_abort_undoes_in_reverse_order_but_what_was_taken_over() -> None:
    done: list[str] = []
    target = PickleTarget(1)
    assert not target.has_undo
    for key in ("a", "b", "c"):
        target.add_undo(key, lambda key=key: done.append(key))
    assert target.has_undo
    target.abort(taken_over=frozenset({"b"}))
    assert done == ["c", "a"]
    target.abort()  # nothing is undone twice
    assert done == ["c", "a"] and not target.has_undo


def test_abort_goes_on_after_a_failing_undo() -> None:
    done: list[str] = []
    target = PickleTarget(1)
    target.add_undo("a", lambda: done.append("a"))
    target.add_undo("b", lambda: 1 / 0)
    target.abort()
    assert done == ["a"]


def test_recent_entries_forget_the_oldest_beyond_the_limit() -> None:
    recent: RecentEntries[int, str] = RecentEntries(3)
    for key in range(5):
        recent.remember(key, f"v{key}")
    assert len(recent) == 3
    assert recent.take(0) is None and recent.take(1) is None
    assert recent.take(2) == "v2"
    assert recent.take(2) is None  # taken once
    assert recent.take(4) == "v4" and len(recent) == 1


def test_recent_entries_from_many_threads() -> None:
    recent: RecentEntries[tuple[int, int], int] = RecentEntries(100)

    def fill(thread: int) -> None:
        for i in range(1000):
            recent.remember((thread, i), i)
            recent.take((thread, i - 1))

    threads = [threading.Thread(target=fill, args=(t,)) for t in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert len(recent) == 8  # each thread's last entry
    assert all(recent.take((t, 999)) == 999 for t in range(8))
