"""A quiet worker's I/O thread waits long (``agent/_timed_work.py`` ``QuietWatch``) and
whatever other threads queue for it ends the wait (``Transport.nudge``).

Unit tests of the verdict (a stub agent, explicit clock readings), of the transport's
quiet wait (real sockets), and a real two-worker group whose I/O threads would wait
600 s: a finalizer's RRef delete, ``call_soon`` work and a call's deadline still
happen on time there.
"""

from __future__ import annotations

import queue
import threading
from types import SimpleNamespace
from typing import Any

import pytest

from actorrpc.agent._timed_work import MAX_POLL, QUIET_POLL, QUIET_SECONDS, QuietWatch

from ._cluster import free_port, run_script
from ._waiting import start_blocked, wait_until

pytestmark = [pytest.mark.timeout(60), pytest.mark.internals]  # (stand-ins, patched methods)


# -- the verdict ----------------------------------------------------------------------------


class _Pool:
    def __init__(self) -> None:
        self.busy = 0

    def all_idle(self) -> bool:
        return not self.busy


def _quiet_agent() -> Any:
    """What ``QuietWatch`` reads of an agent, all quiet."""
    return SimpleNamespace(
        _pending={}, _soon=queue.SimpleQueue(), riders=SimpleNamespace(queued={}, waiting={}),
        _pool=_Pool(), _inflight=0,
        liveness=SimpleNamespace(dead_peers={}, pings_in_flight=lambda: 0),
    )


def test_a_worker_waits_long_only_after_it_stayed_quiet_for_a_while() -> None:
    agent, watch = _quiet_agent(), QuietWatch()
    assert watch.limit(agent, 100.0) == MAX_POLL  # quiet from now on
    assert watch.limit(agent, 100.0 + QUIET_SECONDS / 2) == MAX_POLL
    assert watch.limit(agent, 100.0 + QUIET_SECONDS) == QUIET_POLL
    watch.interrupted()  # (a message came, or a thread took a turn on the inbox)
    assert watch.limit(agent, 200.0) == MAX_POLL
    assert watch.limit(agent, 200.0 + QUIET_SECONDS) == QUIET_POLL


@pytest.mark.parametrize("busy", [
    "a call pending", "work for the I/O thread", "a notification queued",
    "a notification waiting", "a pool thread at work", "a request being served",
    "a dead peer",
])
def test_anything_going_on_starts_the_quiet_stretch_again(busy: str) -> None:
    agent, watch = _quiet_agent(), QuietWatch()
    watch.limit(agent, 100.0)
    undo = _make_busy(agent, busy)
    assert watch.limit(agent, 100.0 + QUIET_SECONDS) == MAX_POLL, busy
    undo()
    assert watch.limit(agent, 100.0 + QUIET_SECONDS) == MAX_POLL, busy  # (again from here)
    assert watch.limit(agent, 100.0 + 2 * QUIET_SECONDS) == QUIET_POLL, busy


def _make_busy(agent: Any, busy: str) -> Any:
    if busy == "a call pending":
        agent._pending[7] = object()
        return agent._pending.clear
    if busy == "work for the I/O thread":
        agent._soon.put((print, ()))
        return agent._soon.get_nowait
    if busy in ("a notification queued", "a notification waiting"):
        table = agent.riders.queued if busy.endswith("queued") else agent.riders.waiting
        table[1] = [(1, 0, ())]
        return table.clear
    if busy == "a pool thread at work":
        agent._pool.busy = 1
        return lambda: setattr(agent._pool, "busy", 0)
    if busy == "a request being served":
        agent._inflight = 1
        return lambda: setattr(agent, "_inflight", 0)
    agent.liveness.dead_peers[1] = "worker1"
    return agent.liveness.dead_peers.clear


def test_what_was_queued_after_the_last_look_cancels_the_long_wait() -> None:
    agent, watch = _quiet_agent(), QuietWatch()
    assert watch.begin(agent) and watch.waiting and watch.long_waits == 1
    watch.end()  # timed out: still quiet
    assert not watch.waiting
    watch.limit(agent, 100.0)
    assert watch.limit(agent, 100.0 + QUIET_SECONDS) == QUIET_POLL
    agent._soon.put((print, ()))  # queued between the look and the wait
    assert not watch.begin(agent) and not watch.waiting and watch.long_waits == 1
    agent._soon.get_nowait()
    assert watch.limit(agent, 100.0 + QUIET_SECONDS) == MAX_POLL  # quiet again from here
    assert watch.begin(agent)
    watch.nudge_if_waiting()  # something was queued: not quiet any more
    watch.end()
    assert watch.limit(agent, 100.0 + 2 * QUIET_SECONDS) == MAX_POLL


def test_a_liveness_check_in_flight_leaves_a_worker_quiet() -> None:
    agent, watch = _quiet_agent(), QuietWatch()
    watch.limit(agent, 100.0)
    agent._pending[7] = object()  # the PING's pending call
    agent.liveness.pings_in_flight = lambda: 1
    assert watch.limit(agent, 100.0 + QUIET_SECONDS) == QUIET_POLL
    assert watch.begin(agent)
    watch.end()
    agent._pending[8] = object()  # a call besides it
    assert watch.limit(agent, 100.0 + 2 * QUIET_SECONDS) == MAX_POLL


@pytest.mark.parametrize(("timeout", "liveness_check", "nudged"), [
    (QUIET_POLL, True, False),  # a PING due after the longest wait: its end looks in time
    (0.0, True, False),  # (no deadline)
    (QUIET_POLL / 2, True, True),  # due before the wait would end
    (QUIET_POLL * 10, False, True),  # any other call: its peer's liveness is timed work
])
def test_a_call_nudges_a_long_wait_unless_a_liveness_check_due_after_it(
    timeout: float, liveness_check: bool, nudged: bool
) -> None:
    nudges: list[int] = []
    agent, watch = _quiet_agent(), QuietWatch(nudge=lambda: nudges.append(1))
    watch.limit(agent, 100.0)
    watch.limit(agent, 100.0 + QUIET_SECONDS)
    assert watch.begin(agent)
    watch.nudge_for_call(timeout, liveness_check)
    assert nudges == ([1] if nudged else [])
    assert (watch.quiet_since() == 0.0) is nudged


def test_producers_nudge_only_a_long_wait() -> None:
    nudges: list[int] = []
    agent, watch = _quiet_agent(), QuietWatch(nudge=lambda: nudges.append(1))
    watch.nudge_if_waiting()  # it looks at its timed work within MAX_POLL anyway
    assert nudges == []
    assert watch.begin(agent)
    watch.nudge_if_waiting()
    assert nudges == [1]
    watch.end()
    watch.nudge_if_waiting()
    assert nudges == [1]


# -- the transport's quiet wait ---------------------------------------------------------------


def _ended(thread: threading.Thread) -> bool:
    thread.join(10)
    return not thread.is_alive()


def test_a_quiet_wait_times_out_without_a_message(pair) -> None:
    _, receiver = pair
    assert receiver.wait_quietly(0.02) is False
    assert receiver.receive(0) == []


@pytest.mark.parametrize("wake", ["nudge", "wake"])
def test_a_nudge_or_a_wake_from_another_thread_ends_a_quiet_wait(
    pair, wake: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, receiver = pair
    thread, result = start_blocked(monkeypatch, lambda: receiver.wait_quietly(30.0))
    getattr(receiver, wake)()
    assert _ended(thread) and result == [True]


def test_a_nudge_given_before_the_wait_ends_it_at_once_and_counts_once(pair) -> None:
    _, receiver = pair
    receiver.nudge()
    receiver.nudge()
    assert receiver.wait_quietly(30.0) is True
    assert receiver.wait_quietly(0.02) is False  # (both were drained)


def test_a_message_ends_a_quiet_wait_and_is_received_afterwards(
    pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    sender, receiver = pair
    thread, result = start_blocked(monkeypatch, lambda: receiver.wait_quietly(30.0))
    sender.link(b"1:receiver", receiver.endpoint).send([b"AR-header", b"hello"])
    assert _ended(thread) and result == [True]
    assert wait_until(lambda: receiver.receive(0.01) != [], timeout=10)


def test_a_nudge_after_close_is_harmless() -> None:
    from actorrpc.transport import Transport

    transport = Transport(b"0:closing", security="none")
    transport.close()
    assert transport._nudge_fd == -1  # (the write end stays open: nothing else gets its number)
    transport.nudge()  # (a pipe with no reader: EPIPE, ignored)


# -- a real group whose I/O threads would wait 600 s ------------------------------------------

# what both scripts below begin with
_PRELUDE = r'''
import gc, multiprocessing as mp, os, sys, time, threading
import torch
import actorrpc as rpc
from actorrpc.agent import _timed_work
from actorrpc.agent._agent import current_agent
from actorrpc.agent._timed_work import QuietWatch


def options():
    return rpc.ZmqRpcBackendOptions(init_method=os.environ["INIT"], rpc_timeout=60)


def watch_parent(parent):
    while os.getppid() == parent:  # (a parent killed at a timeout leaves no worker behind)
        threading.Event().wait(0.5)
    os._exit(3)
'''

_GROUP = _PRELUDE + r'''

def quiet():
    # a long wait once quiet for 50 ms; without a nudge nothing would end it in time
    _timed_work.QUIET_SECONDS = 0.05
    _timed_work.QUIET_POLL = 600.0


def peer(done, began, parent):
    threading.Thread(target=watch_parent, args=(parent,), daemon=True).start()
    quiet()
    original = QuietWatch.begin

    def begin(self, agent):  # each quiet wait of w1 is told to w0
        if original(self, agent):
            began.put(self.long_waits)
            return True
        return False

    QuietWatch.begin = begin
    rpc.init_rpc("w1", rank=1, world_size=2, rpc_backend_options=options())
    done.wait(60)  # (not in shutdown meanwhile: its barrier would probe w0 all along)
    rpc.shutdown(timeout=60)


def waits_quietly(agent, what):
    # (seen twice: ``waiting`` is set a moment before its last look, which may cancel it)
    deadline = time.monotonic() + 30
    while not (agent.quiet.waiting and not threading.Event().wait(0.005)
               and agent.quiet.waiting):
        assert time.monotonic() < deadline, f"no quiet wait before {what}"
        threading.Event().wait(0.005)


def done_within(condition, what, seconds=30):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen while the worker was quiet"
        threading.Event().wait(0.005)


if __name__ == "__main__":
    import faulthandler
    faulthandler.dump_traceback_later(40, exit=True)  # (a hang shows where)
    quiet()
    context = mp.get_context("spawn")
    done, began = context.Event(), context.Queue()
    process = context.Process(target=peer, args=(done, began, os.getpid()), daemon=True)
    process.start()
    rpc.init_rpc("w0", rank=0, world_size=2, rpc_backend_options=options())
    agent = current_agent()
    for i in range(20):  # (enough for the same-host rings)
        assert rpc.rpc_sync("w1", torch.add, args=(i, 1)) == i + 1

    waits_quietly(agent, "call_soon")
    ran = threading.Event()
    agent.call_soon(ran.set)
    done_within(ran.is_set, "call_soon work")

    waits_quietly(agent, "work for the pool")
    release, started = threading.Event(), [threading.Event(), threading.Event()]
    for event in started:
        agent.submit(lambda event=event: (event.set(), release.wait(30)))
        # (at once after the first started, the second waits for the pool to grow, which
        # is the I/O thread's timed work: see _pool.STALL_SECONDS)
        assert event.wait(30), "a pool task did not start while the worker was quiet"
    release.set()

    owned = rpc.remote("w1", torch.ones, args=(2,))
    assert float(owned.to_here().sum()) == 2.0
    owners = rpc.get_worker_stats("w1")["rref"]["num_owner_rrefs"]
    waits_quietly(agent, "the delete")
    del owned
    gc.collect()  # (the finalizer queues the delete for the owner)
    done_within(lambda: not agent.riders.queued and not agent.riders.waiting, "the delete")
    done_within(lambda: rpc.get_worker_stats("w1")["rref"]["num_owner_rrefs"] == owners - 1,
                "the owner's count")

    waits_quietly(agent, "a call with a deadline")
    future = rpc.rpc_async("w1", time.sleep, args=(5,), timeout=0.3)
    # (nobody blocks on it: the I/O thread's timed work alone fails it)
    done_within(future.done, "the call's deadline", seconds=4)
    try:
        future.wait()
    except rpc.RpcTimeoutError:
        print("timed out on time")
    else:
        raise AssertionError("the call's deadline passed unnoticed until its reply came")

    while not began.empty():
        began.get()
    began.get(timeout=30)  # w1 waits quietly (its ring's doorbell must wake it)
    assert rpc.rpc_sync("w1", torch.add, args=(2, 3), timeout=30) == 5
    assert rpc.get_worker_stats("w1")["rings"]["in"] == 1
    done.set()
    rpc.shutdown(timeout=60)
    process.join(60)
    assert process.exitcode == 0, process.exitcode
    print("ok")
'''


def test_a_quiet_group_still_does_its_timed_work_on_time(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("INIT", f"tcp://127.0.0.1:{free_port()}")
    output = run_script(tmp_path, _GROUP, timeout=55)
    assert "timed out on time" in output and output.rstrip().endswith("ok"), output



# -- liveness checks leave a quiet group quiet ------------------------------------------------

_PROBED = _PRELUDE + r'''

def until(condition, what, seconds=20):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        threading.Event().wait(0.005)


def quiet_for_a_while(agent):
    since = agent.quiet.quiet_since()
    return since > 0 and time.monotonic() - since >= _timed_work.QUIET_SECONDS


def peer(ask, answers, leave, parent):
    threading.Thread(target=watch_parent, args=(parent,), daemon=True).start()
    _timed_work.QUIET_SECONDS = 0.2
    rpc.init_rpc("w1", rank=1, world_size=2, rpc_backend_options=options())
    agent = current_agent()

    def answer():  # its quiet stretch's start, read in place (a message would end it)
        while ask.wait(60):  # (nobody asks for a minute: the test is over)
            ask.clear()
            answers.put(agent.quiet.quiet_since() if quiet_for_a_while(agent) else 0.0)

    threading.Thread(target=answer, daemon=True).start()
    leave.wait(60)
    rpc.shutdown(timeout=60)  # (waits there for w0, probing it about once a second)


def peer_quiet_since(ask, answers):
    ask.set()
    return answers.get(timeout=30)


if __name__ == "__main__":
    import faulthandler
    faulthandler.dump_traceback_later(50, exit=True)  # (a hang shows where)
    _timed_work.QUIET_SECONDS = 0.2
    context = mp.get_context("spawn")
    ask, answers, leave = context.Event(), context.Queue(), context.Event()
    process = context.Process(target=peer, args=(ask, answers, leave, os.getpid()), daemon=True)
    process.start()
    rpc.init_rpc("w0", rank=0, world_size=2, rpc_backend_options=options())
    agent = current_agent()
    for i in range(20):  # (enough for the same-host rings)
        assert rpc.rpc_sync("w1", torch.add, args=(i, 1)) == i + 1

    # both quiet, then w0 checks w1's liveness: neither the PING nor its answer ends it
    until(lambda: quiet_for_a_while(agent), "w0's quiet")
    until(lambda: peer_quiet_since(ask, answers) > 0, "w1's quiet")
    peer_since = peer_quiet_since(ask, answers)
    since = agent.quiet.quiet_since()
    served = agent.stats.requests_served[1]
    agent.liveness.probe(1)
    until(lambda: agent.liveness.pings_in_flight() == 0, "the answer to the liveness check")
    assert agent.liveness.last_seen[1] > since
    assert agent.quiet.quiet_since() == since, "the answer to a liveness check ended w0's quiet"
    assert peer_quiet_since(ask, answers) == peer_since, "a liveness check ended w1's quiet"
    print("a liveness check left both quiet")

    # w1 waits in shutdown: its barrier's probes of w0 leave w0 quiet
    leave.set()
    until(lambda: agent.stats.requests_served[1] >= served + 3, "three probes by w1's barrier",
          seconds=30)
    assert agent.quiet.quiet_since() == since, "w1's probes from shutdown ended w0's quiet"
    assert agent.quiet.long_waits > 0
    print("probes from shutdown left w0 quiet")
    rpc.shutdown(timeout=60)
    process.join(60)
    assert process.exitcode == 0, process.exitcode
    print("ok")
'''


def test_liveness_checks_leave_a_quiet_group_quiet(tmp_path, monkeypatch) -> None:
    """A worker waiting in ``shutdown`` probes the ranks it waits for about once a second:
    counted as activity, those probes and their answers kept both workers' I/O threads
    looking at their timed work ~20 times a second instead of once."""
    monkeypatch.setenv("INIT", f"tcp://127.0.0.1:{free_port()}")
    output = run_script(tmp_path, _PROBED, timeout=55)
    assert "a liveness check left both quiet" in output, output
    assert "probes from shutdown left w0 quiet" in output and output.rstrip().endswith("ok"), (
        output
    )
