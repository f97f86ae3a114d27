"""Unit tests of the RRef fork / reference-counting state machine (no sockets).

Each simulated worker is an :class:`RRefContext` whose control messages go into
an in-memory "network" (a list of in-flight messages). A scenario is a set of
user actions (``remote``, ``share``, ``drop``...) per worker; the explorer runs
it under every delivery order the protocol allows (all interleavings of the
enabled actions and in-flight messages, replayed from scratch for each
schedule), optionally delivering control messages twice, and checks after
every step:

* safety / G2: while any user handle of a value is alive, or a share of it is
  in flight, the owner keeps the value (entry in ``owners`` and value alive);
* G1 bookkeeping: every live confirmed user's fork is registered on the owner;

and at the end (everything delivered, every handle dropped):

* G1: the owner was sent exactly one delete per user fork it knew;
* every table of every worker is empty and the value is freed (weakref dead).

The glue between the context and the sockets in ``_rref.py``/``_remote.py`` is
a few lines per message; :class:`Sim` mirrors it message for message.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from actorrpc.agent import WorkerInfo
from actorrpc.errors import RpcTimeoutError, RRefError
from actorrpc.rref import RRef, RRefContext
from actorrpc.rref._context import (
    CHILD_ACCEPT,
    USER_DELETE,
    GloballyUniqueId,
    OwnerState,
    format_id,
)
from actorrpc.serialization import dumps

# -- the simulation -----------------------------------------------------------------------


class Value:
    """A value held only by RRefs (weak-referenceable)."""


@dataclass
class Msg:
    kind: str
    src: int
    dest: int
    payload: tuple[Any, ...]
    duplicate: bool = False

    def label(self) -> str:
        copy = "*" if self.duplicate else ""
        return f"{self.kind}:{self.src}->{self.dest}:{self.payload!r}{copy}"


class FakeAgent:
    """What an RRef handle needs of its agent: rank, info and the context."""

    def __init__(self, rank: int, ctx: RRefContext) -> None:
        self.rank = rank
        self.info = WorkerInfo(f"w{rank}", rank)
        self.extensions = {"rref": ctx}


@dataclass
class Action:
    label: str
    worker: int
    ready: Callable[[], bool]
    fire: Callable[[], None]
    done: bool = False


@dataclass
class Sim:
    """Workers, network and user-held handles of one run of a scenario."""

    world: int = 3
    duplicate: bool | str = False  # True: every control kind; a kind: only that one
    net: list[Msg] = field(default_factory=list)
    handles: dict[str, RRef[Any]] = field(default_factory=dict)
    actions: list[Action] = field(default_factory=list)
    values: dict[GloballyUniqueId, weakref.ref[Value]] = field(default_factory=dict)
    owner_of: dict[GloballyUniqueId, int] = field(default_factory=dict)
    users: weakref.WeakSet[RRef[Any]] = field(default_factory=weakref.WeakSet)
    known_forks: set[GloballyUniqueId] = field(default_factory=set)
    deletes_sent: list[GloballyUniqueId] = field(default_factory=list)
    created: dict[str, GloballyUniqueId] = field(default_factory=dict)
    trace: list[str] = field(default_factory=list)
    holder: dict[str, int] = field(default_factory=dict)
    states: set[Any] | None = None

    def __post_init__(self) -> None:
        self.ctxs = [RRefContext(r, self._sender(r)) for r in range(self.world)]
        # what RRef handles read of an Agent (typed Any: a stand-in for actorrpc's Agent)
        self.agents: list[Any] = [FakeAgent(r, ctx) for r, ctx in enumerate(self.ctxs)]

    def _sender(self, rank: int) -> Callable[[int, str, tuple[Any, ...]], None]:
        def send(dest: int, kind: str, payload: tuple[Any, ...]) -> None:
            assert kind in (USER_DELETE, CHILD_ACCEPT)
            if kind == USER_DELETE:
                self.deletes_sent.append(payload[1])
            self.net.append(Msg(kind, rank, dest, payload))

        return send

    # -- user actions (what rpc.remote / pickling an RRef / dropping it do) -------------------

    def remote(self, name: str, src: int, owner: int) -> None:
        def fire() -> None:
            ctx = self.ctxs[src]
            rref_id = ctx.new_id()
            self.owner_of[rref_id] = owner
            self.created[name] = rref_id
            if owner == src:
                state = ctx.get_or_create_owner(rref_id)
                self.handles[name] = RRef._make_owner(self.agents[src], state)
                self.net.append(Msg("REMOTE_CALL", src, owner, (rref_id, None, name)))
                return
            fork_id = ctx.new_id()
            handle = RRef._make_user(self.agents[src], self.agents[owner].info, rref_id, fork_id)
            self.users.add(handle)
            ctx.add_pending_user(handle)
            self.handles[name] = handle
            self.net.append(Msg("REMOTE_CALL", src, owner, (rref_id, fork_id, name)))

        self.holder[name] = src
        self.actions.append(Action(f"remote {name} {src}->{owner}", src, lambda: True, fire))

    def timeout(self, name: str) -> None:
        """The creator's remote() times out before REMOTE_RET (the value stays pending)."""

        def ready() -> bool:
            handle = self.handles.get(name)
            return handle is not None and not handle._confirmed

        def fire() -> None:
            handle = self.handles[name]
            handle._creation_error = RpcTimeoutError("RPC ran for more than set timeout")
            self.ctxs[handle._agent.rank].confirm_user(handle._fork_id)  # type: ignore[arg-type]

        self.actions.append(Action(f"timeout {name}", self.holder[name], ready, fire))

    def local(self, name: str, owner: int) -> None:
        """``RRef(value)`` on ``owner``."""

        def fire() -> None:
            ctx = self.ctxs[owner]
            value = Value()
            state = OwnerState(ctx.new_id())
            state.set_value(value)
            ctx.register_local(state)
            self.values[state.rref_id] = weakref.ref(value)
            self.owner_of[state.rref_id] = owner
            self.handles[name] = RRef._make_owner(self.agents[owner], state)

        self.holder[name] = owner
        self.actions.append(Action(f"local {name}@{owner}", owner, lambda: True, fire))

    def share(self, name: str, src: int, dest: int, new: str) -> None:
        """Pickle handle ``name`` held on ``src`` into a message to ``dest``."""

        def ready() -> bool:
            handle = self.handles.get(name)
            return handle is not None and handle._agent.rank == src

        def fire() -> None:
            handle = self.handles[name]
            fork_id, parent = self.ctxs[src].fork_for(handle, dest)
            owner = handle._owner.id
            self.net.append(Msg("SHARE", src, dest, (owner, handle._rref_id, fork_id, parent, new)))

        self.holder[new] = dest
        self.actions.append(Action(f"share {name} {src}->{dest} as {new}", src, ready, fire))

    def drop(self, name: str) -> None:
        def fire() -> None:
            del self.handles[name]

        self.actions.append(
            Action(f"drop {name}", self.holder[name], lambda: name in self.handles, fire)
        )

    def settle(self) -> None:
        """Fire the actions so far and deliver every message, in order (a fixed prefix)."""
        for action in self.actions:
            if not action.done and action.ready():
                action.done = True
                action.fire()
        while self.net:
            self.deliver(self.net.pop(0))

    # -- message delivery (what the handlers in _remote.py / _rebuild_rref do) ---------------

    def deliver(self, msg: Msg) -> None:
        ctx = self.ctxs[msg.dest]
        if msg.kind == "REMOTE_CALL":
            rref_id, fork_id, name = msg.payload
            state = ctx.on_remote_call(rref_id, fork_id)
            value = Value()
            state.set_value(value)
            self.values[rref_id] = weakref.ref(value)
            if fork_id is None:
                ctx.release_if_unforked(rref_id)
            else:
                self.known_forks.add(fork_id)
            self.net.append(Msg("REMOTE_RET", msg.dest, msg.src, (fork_id,)))
        elif msg.kind == "REMOTE_RET":
            (fork_id,) = msg.payload
            if fork_id is not None:
                ctx.confirm_user(fork_id)
        elif msg.kind == "SHARE":
            owner, rref_id, fork_id, parent, new = msg.payload
            agent = self.agents[msg.dest]
            if owner == msg.dest:
                handle = RRef._make_owner(agent, ctx.receive_at_owner(rref_id, fork_id, parent))
            else:
                handle = RRef._make_user(agent, self.agents[owner].info, rref_id, fork_id)
                self.users.add(handle)
                if parent is None:
                    self.known_forks.add(fork_id)  # registered early by the owner
                if ctx.receive_user(handle, parent):
                    request = (rref_id, fork_id, parent)
                    self.net.append(Msg("FORK_REQUEST", msg.dest, owner, request))
            self.handles[new] = handle
        elif msg.kind == "FORK_REQUEST":
            rref_id, fork_id, parent = msg.payload
            ctx.on_fork_request(rref_id, fork_id)
            self.known_forks.add(fork_id)
            self.net.append(Msg("FORK_ACK", msg.dest, msg.src, (fork_id, parent)))
        elif msg.kind == "FORK_ACK":
            ctx.fork_acknowledged(*msg.payload)
        elif msg.kind == USER_DELETE:
            ctx.on_user_delete(*msg.payload)
        elif msg.kind == CHILD_ACCEPT:
            ctx.on_child_accept(*msg.payload)
        else:  # pragma: no cover
            raise AssertionError(msg)

    # -- scheduling -----------------------------------------------------------------------------

    def enabled(self) -> list[tuple[str, Callable[[], None]]]:
        return [(label, fire) for label, _, fire in self.events()]

    def events(self) -> list[tuple[str, int, Callable[[], None]]]:
        """Enabled events: (label, the worker whose state it changes, fire)."""
        events: list[tuple[str, int, Callable[[], None]]] = []
        for action in self.actions:
            if not action.done and action.ready():
                events.append((action.label, action.worker, self._firer(action)))
        for index, msg in enumerate(self.net):
            events.append((msg.label(), msg.dest, self._deliverer(index)))
        return events

    def fingerprint(self) -> Any:
        """The observable state (for checking that the reduced exploration misses none)."""
        return (
            tuple(tuple(sorted(c.debug_info().items())) for c in self.ctxs),
            tuple(sorted(m.label() for m in self.net)),
            tuple(sorted(self.handles)),
            tuple(sorted((repr(k), r() is not None) for k, r in self.values.items())),
            tuple(sorted(a.label for a in self.actions if a.done)),
        )

    def _firer(self, action: Action) -> Callable[[], None]:
        def fire() -> None:
            action.done = True
            action.fire()

        return fire

    def _deliverer(self, index: int) -> Callable[[], None]:
        def deliver() -> None:
            msg = self.net.pop(index)
            if self.duplicate is True:
                duplicable = msg.kind in (USER_DELETE, CHILD_ACCEPT, "FORK_REQUEST", "FORK_ACK")
            else:
                duplicable = msg.kind == self.duplicate
            if duplicable and not msg.duplicate:
                self.net.append(Msg(msg.kind, msg.src, msg.dest, msg.payload, duplicate=True))
            self.deliver(msg)

        return deliver

    # -- checks ---------------------------------------------------------------------------------

    def check_step(self) -> None:
        in_flight = {m.payload[1] for m in self.net if m.kind == "SHARE"}
        live_users = [u for u in list(self.users) if not u._deleted]
        for rref_id, owner in self.owner_of.items():
            ref = self.values.get(rref_id)
            if ref is None:
                continue  # not created yet
            users = [u for u in live_users if u._rref_id == rref_id and u._creation_error is None]
            if users or rref_id in in_flight:
                owner_ctx = self.ctxs[owner]
                assert ref() is not None, f"value of {rref_id} freed while referenced: {self.trace}"
                assert rref_id in owner_ctx.owners or any(
                    h._rref_id == rref_id and h.is_owner() for h in self.handles.values()
                ), f"owner dropped {rref_id} while referenced: {self.trace}"
            for user in users:
                if user._confirmed:
                    forks = self.ctxs[owner].forks.get(rref_id, set())
                    assert user._fork_id in forks, (
                        f"confirmed user {user._fork_id} unknown to the owner: {self.trace}"
                    )

    def check_final(self) -> None:
        assert not self.net and not self.handles
        for ctx in self.ctxs:
            assert ctx.debug_info() == {
                "num_owner_rrefs": 0, "num_forks": 0, "num_pending_users": 0,
                "num_pending_children": 0, "num_confirmed_users": 0,
            }, (ctx.rank, ctx.debug_info(), self.trace)
            assert not ctx.owners and not ctx.forks and not ctx.pending_users
            assert not ctx.pending_children
        live = [u for u in self.users if not u._deleted]
        assert not live, f"user handles still alive: {live}"
        for rref_id, ref in self.values.items():
            assert ref() is None, f"value of {rref_id} not freed: {self.trace}"
        # G1: each user fork the owner knew was deleted exactly once (twice at most with
        # duplicated deliveries, but sent once).
        assert sorted(self.deletes_sent) == sorted(set(self.deletes_sent)), self.trace
        assert self.known_forks <= set(self.deletes_sent), (self.known_forks, self.deletes_sent)


Scenario = Callable[[Sim], None]


def run_schedule(
    scenario: Scenario,
    choose: Callable[[int], int],
    duplicate: bool | str,
    on_step: Callable[[Sim], None] | None = None,
) -> Sim:
    """Run ``scenario``; ``choose(n)`` picks which of ``n`` enabled events happens next."""
    sim = Sim(duplicate=duplicate)
    scenario(sim)
    for _ in range(10_000):
        if on_step is not None:
            on_step(sim)
        events = sim.enabled()
        if not events:
            break
        label, fire = events[choose(len(events))]
        sim.trace.append(label)
        fire()
        del fire, events
        sim.check_step()
    else:  # pragma: no cover
        raise AssertionError("schedule did not terminate")
    # no gc.collect(): handles and values must be freed by reference counting alone
    sim.check_final()
    return sim


def all_schedules(
    scenario: Scenario,
    duplicate: bool | str = False,
    limit: int = 200_000,
    on_step: Callable[[Sim], None] | None = None,
) -> int:
    """Run ``scenario`` under every permutation of events (by replay); return how many."""
    prefix: list[int] = []
    count = 0
    while True:
        taken: list[tuple[int, int]] = []
        run_schedule(scenario, _replayer(prefix, taken), duplicate, on_step)
        count += 1
        assert count <= limit, "scenario too large to explore exhaustively"
        while taken and taken[-1][0] + 1 >= taken[-1][1]:
            taken.pop()
        if not taken:
            return count
        prefix = [index for index, _ in taken[:-1]] + [taken[-1][0] + 1]


def _replayer(prefix: list[int], taken: list[tuple[int, int]]) -> Callable[[int], int]:
    """Choose ``prefix`` first, then the first event; record (choice, choices) in ``taken``."""

    def choose(n: int) -> int:
        index = prefix[len(taken)] if len(taken) < len(prefix) else 0
        taken.append((index, n))
        return index

    return choose


def explore(
    scenario: Scenario, duplicate: bool | str = False, states: set[Any] | None = None
) -> int:
    """Every interleaving up to commuting independent events; return the schedules run.

    Stateless depth-first search with sleep sets: two events are independent when
    they change different workers (a delivery changes its destination, an action
    its worker), so running them in either order reaches the same state; sleep
    sets skip such re-orderings, yet every reachable state is still visited
    (``states`` collects their fingerprints, see ``test_reduction_keeps_every_state``).
    """
    count = 0

    def replay(path: list[str]) -> Sim:
        sim = Sim(duplicate=duplicate)
        scenario(sim)
        for label in path:
            [fire] = [f for lab, _, f in sim.events() if lab == label][:1]
            sim.trace.append(label)
            fire()
            del fire
            sim.check_step()
        return sim

    def visit(path: list[str], sleep: dict[str, int]) -> None:
        nonlocal count
        sim = replay(path)
        if states is not None:
            states.add(sim.fingerprint())
        events = {label: worker for label, worker, _ in sim.events()}
        if not events:
            sim.check_final()
            count += 1
            return
        del sim
        done: dict[str, int] = {}
        for label in sorted(events):
            if label in sleep:
                continue
            worker = events[label]
            child_sleep = {
                other: w for other, w in {**sleep, **done}.items() if w != worker
            }
            visit([*path, label], child_sleep)
            done[label] = worker

    visit([], {})
    return count


# -- scenarios --------------------------------------------------------------------------------
# Workers: 0 = A (creator / first user), 1 = B (owner), 2 = C (third worker).


def created_by_remote(sim: Sim) -> None:
    """Case 1: A creates a value on B with remote() and drops it."""
    sim.remote("a", 0, 1)
    sim.drop("a")


def user_shares_with_user(sim: Sim) -> None:
    """Case 4: A's user is shared with C (fork request / ack / child accept / deletes)."""
    sim.remote("a", 0, 1)
    sim.share("a", 0, 2, "c")
    sim.drop("a")
    sim.drop("c")


def user_shares_with_owner(sim: Sim) -> None:
    """Case 2: A's user is sent back to the owner B."""
    sim.remote("a", 0, 1)
    sim.share("a", 0, 1, "b")
    sim.drop("a")
    sim.drop("b")


def owner_shares_with_user(sim: Sim) -> None:
    """Case 3: B's local RRef is sent to A and C (early fork registration)."""
    sim.local("o", 1)
    sim.share("o", 1, 0, "a")
    sim.share("o", 1, 2, "c")
    sim.drop("o")
    sim.drop("a")
    sim.drop("c")


def owner_shares_with_itself(sim: Sim) -> None:
    """The owner sends its RRef to itself and drops the original before it arrives."""
    sim.local("o", 1)
    sim.share("o", 1, 1, "o2")
    sim.drop("o")
    sim.drop("o2")


def forward_chain(sim: Sim) -> None:
    """A -> C -> A: a user forwards a user it received, maybe before it is confirmed."""
    sim.remote("a", 0, 1)
    sim.settle()
    sim.share("a", 0, 2, "c")
    sim.drop("a")
    sim.share("c", 2, 0, "a2")
    sim.drop("c")
    sim.drop("a2")


def timed_out_creation(sim: Sim) -> None:
    """A's remote() times out and A drops the handle: its delete may beat REMOTE_CALL."""
    sim.remote("a", 0, 1)
    sim.timeout("a")
    sim.drop("a")


def remote_to_self(sim: Sim) -> None:
    """remote() to the creator itself (no fork) shared to a user."""
    sim.remote("o", 1, 1)
    sim.share("o", 1, 0, "a")
    sim.drop("o")
    sim.drop("a")


SCENARIOS = [
    created_by_remote,
    user_shares_with_user,
    user_shares_with_owner,
    owner_shares_with_user,
    owner_shares_with_itself,
    forward_chain,
    timed_out_creation,
    remote_to_self,
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.__name__)
def test_every_interleaving(scenario: Scenario) -> None:
    assert explore(scenario) >= 1


SMALL_SCENARIOS = [s for s in SCENARIOS if s not in (user_shares_with_user, forward_chain)]
CONTROL_KINDS = [USER_DELETE, CHILD_ACCEPT, "FORK_REQUEST", "FORK_ACK"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("scenario", SMALL_SCENARIOS, ids=lambda s: s.__name__)
def test_every_interleaving_with_all_deliveries_duplicated(scenario: Scenario) -> None:
    """Idempotence: every control message may arrive twice, the copy at any later time."""
    assert explore(scenario, duplicate=True) >= 1


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", CONTROL_KINDS)
def test_case4_every_interleaving_with_duplicates_of(kind: str) -> None:
    """Case 4 with one kind of control message duplicated (all kinds at once is too many)."""
    assert explore(user_shares_with_user, duplicate=kind) >= 1


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "scenario", [user_shares_with_owner, timed_out_creation, remote_to_self],
    ids=lambda s: s.__name__,
)
def test_reduction_keeps_every_state(scenario: Scenario) -> None:
    """The reduced search reaches the same states as running every permutation."""
    reduced: set[Any] = set()
    explore(scenario, states=reduced)
    full: set[Any] = set()

    def record(sim: Sim) -> None:
        full.add(sim.fingerprint())

    all_schedules(scenario, on_step=record)
    assert reduced == full


def test_exploration_is_exhaustive() -> None:
    """The plain explorer runs every interleaving (counted by hand on a small scenario)."""
    # remote(); then drop | REMOTE_CALL; after REMOTE_CALL: drop | REMOTE_RET; the delete
    # comes last: (drop, CALL, RET, DEL), (CALL, drop, RET, DEL), (CALL, RET, drop, DEL).
    assert all_schedules(created_by_remote) == 3


# -- targeted properties ----------------------------------------------------------------------


def _one_value_user() -> tuple[Sim, RRef[Any]]:
    """A confirmed user on A of a value owned by B, everything delivered."""
    sim = Sim()
    sim.remote("a", 0, 1)
    sim.actions[0].done = True
    sim.actions[0].fire()
    while sim.net:
        sim._deliverer(0)()
    return sim, sim.handles["a"]


def test_g2_parent_kept_until_child_accepted() -> None:
    sim, handle = _one_value_user()
    parent_ref = weakref.ref(handle)
    rref_id = handle._rref_id
    fork_id, parent = sim.ctxs[0].fork_for(handle, 2)
    del handle
    sim.handles.clear()  # user code dropped the parent
    assert parent == 0 and parent_ref() is not None, "G2: parent must stay alive"
    assert sim.ctxs[0].debug_info()["num_pending_children"] == 1
    assert not any(m.kind == USER_DELETE for m in sim.net)
    child = RRef._make_user(sim.agents[2], sim.agents[1].info, rref_id, fork_id)
    assert sim.ctxs[2].receive_user(child, parent)
    assert not child.confirmed_by_owner()
    sim.ctxs[1].on_fork_request(child._rref_id, fork_id)
    assert parent_ref() is not None and not any(m.kind == USER_DELETE for m in sim.net)
    sim.ctxs[2].fork_acknowledged(fork_id, parent)
    assert child.confirmed_by_owner()
    # the child accept is in flight; the parent is still held
    [accept] = [m for m in sim.net if m.kind == CHILD_ACCEPT]
    assert parent_ref() is not None
    sim.net.remove(accept)
    sim.deliver(accept)
    assert parent_ref() is None, "the accepted parent is released"
    [delete] = [m for m in sim.net if m.kind == USER_DELETE]
    assert delete.dest == 1 and delete.src == 0


def test_g1_owner_told_of_every_delete() -> None:
    sim, handle = _one_value_user()
    rref_id = handle._rref_id
    forks: list[GloballyUniqueId] = []
    for dest in (0, 2, 2):
        fork_id, parent = sim.ctxs[0].fork_for(handle, dest)
        assert parent == 0
        child = RRef._make_user(sim.agents[dest], sim.agents[1].info, rref_id, fork_id)
        sim.handles[f"child{len(forks)}"] = child
        assert sim.ctxs[dest].receive_user(child, parent)
        sim.ctxs[1].on_fork_request(rref_id, fork_id)
        sim.ctxs[dest].fork_acknowledged(fork_id, parent)
        forks.append(fork_id)
        del child
    first_fork = handle._fork_id
    assert first_fork is not None
    assert sim.ctxs[1].forks[rref_id] == {first_fork, *forks}
    del handle
    sim.handles.clear()
    while sim.net:
        sim._deliverer(0)()
    assert sorted(sim.deletes_sent) == sorted([first_fork, *forks])
    assert sim.ctxs[1].debug_info()["num_forks"] == 0
    sim.check_final()


def test_delete_before_late_fork_add_leaves_no_entry() -> None:
    """Tombstones: a REMOTE_CALL or fork request after the fork's delete registers nothing."""
    ctx = RRefContext(1, lambda *a: None)
    rref_id, fork_id = GloballyUniqueId(0, 1), GloballyUniqueId(0, 2)
    ctx.on_user_delete(rref_id, fork_id)
    state = ctx.on_remote_call(rref_id, fork_id)
    value = Value()
    state.set_value(value)
    ref = weakref.ref(value)
    del value, state
    assert ctx.debug_info()["num_owner_rrefs"] == 0 and not ctx.forks
    assert ref() is None
    ctx.on_fork_request(rref_id, GloballyUniqueId(2, 7))  # a live fork: pending owner
    ctx.on_user_delete(rref_id, GloballyUniqueId(2, 7))
    ctx.on_fork_request(rref_id, GloballyUniqueId(2, 7))  # duplicate after delete
    assert not ctx.owners and not ctx.forks


def test_tombstones_are_bounded() -> None:
    ctx = RRefContext(1, lambda *a: None)
    ctx.TOMBSTONE_LIMIT = 10
    for i in range(100):
        ctx.on_user_delete(GloballyUniqueId(0, 1), GloballyUniqueId(0, i))
    assert len(ctx._tombstones) == 10
    assert ctx.is_tombstoned(GloballyUniqueId(0, 99))
    assert not ctx.is_tombstoned(GloballyUniqueId(0, 0))


def test_control_messages_are_idempotent() -> None:
    sent: list[Any] = []
    ctx = RRefContext(1, lambda *a: sent.append(a))
    state = ctx.get_or_create_owner(GloballyUniqueId(1, 1))
    fork = GloballyUniqueId(0, 5)
    ctx.add_fork(state, fork)
    ctx.add_fork(state, fork)
    assert ctx.forks[state.rref_id] == {fork}
    ctx.on_fork_request(state.rref_id, fork)
    assert ctx.debug_info()["num_forks"] == 1
    ctx.on_user_delete(state.rref_id, fork)
    ctx.on_user_delete(state.rref_id, fork)
    ctx.on_user_delete(GloballyUniqueId(9, 9), GloballyUniqueId(9, 10))  # unknown rref
    ctx.on_child_accept(GloballyUniqueId(3, 3))  # unknown child
    ctx.confirm_user(GloballyUniqueId(3, 4))  # unknown user
    assert ctx.debug_info()["num_owner_rrefs"] == 0 and not sent


def test_unforked_local_rref_not_in_owner_table() -> None:
    sim = Sim()
    sim.local("o", 1)
    sim.actions[0].fire()
    assert sim.ctxs[1].debug_info()["num_owner_rrefs"] == 0
    handle = sim.handles["o"]
    fork_id, parent = sim.ctxs[1].fork_for(handle, 0)
    assert parent is None
    assert sim.ctxs[1].debug_info() == {
        "num_owner_rrefs": 1, "num_forks": 1, "num_pending_users": 0,
        "num_pending_children": 0, "num_confirmed_users": 0,
    }


def test_failed_creation_cannot_be_shared() -> None:
    """A remote() that itself failed (timeout...) cannot be shared; a raising function can."""
    sim = Sim()
    sim.remote("a", 0, 1)
    sim.actions[0].fire()
    handle = sim.handles["a"]
    handle._creation_error = RpcTimeoutError("RPC ran for more than set timeout")
    with pytest.raises(RRefError, match="creation failed"):
        sim.ctxs[0].fork_for(handle, 2)
    assert sim.ctxs[0].debug_info()["num_pending_children"] == 0
    handle._creation_error = ValueError("raised by the function; the owner keeps it")
    fork_id, parent = sim.ctxs[0].fork_for(handle, 2)
    assert parent == 0 and sim.ctxs[0].debug_info()["num_pending_children"] == 1


def test_forgotten_pending_user_sends_nothing() -> None:
    """remote() whose REMOTE_CALL could not be sent: no delete, no table entry."""
    sim = Sim()
    sim.remote("a", 0, 1)
    sim.actions[0].fire()
    handle = sim.handles.pop("a")
    sim.net.clear()
    sim.ctxs[0].forget_pending_user(handle._fork_id)  # type: ignore[arg-type]
    del handle
    assert not sim.net and sim.ctxs[0].debug_info()["num_pending_users"] == 0


def test_delete_all_users_at_shutdown() -> None:
    sim, handle = _one_value_user()
    assert sim.ctxs[0].delete_all_users() == 1
    assert handle._deleted
    del handle
    sim.handles.clear()
    [delete] = sim.net
    assert delete.kind == USER_DELETE and delete.dest == 1
    sim.deliver(sim.net.pop())
    assert sim.ctxs[1].debug_info()["num_owner_rrefs"] == 0
    assert sim.ctxs[1].leaks() == []


def test_leaks_listed_in_torch_format() -> None:
    ctx = RRefContext(1, lambda *a: None)
    ctx.add_fork(ctx.get_or_create_owner(GloballyUniqueId(1, 1)), GloballyUniqueId(0, 2))
    assert ctx.leaks() == [
        "Leaking RRef GloballyUniqueId(created_on=1, local_id=1) with fork Id "
        "GloballyUniqueId(created_on=0, local_id=2)"
    ]


def test_owner_state_wait_timeout_and_error() -> None:
    state = OwnerState(GloballyUniqueId(0, 1))
    with pytest.raises(RpcTimeoutError, match="RPC ran for more than"):
        state.wait(0.01)
    state.set_error(KeyError("k"))
    state.set_value(1)  # first completion wins
    with pytest.raises(KeyError):
        state.wait(1)



def test_owner_state_runs_callbacks_once_whether_added_before_or_after() -> None:
    state = OwnerState(GloballyUniqueId(0, 2))
    calls: list[str] = []
    state.when_ready(lambda: calls.append("early"))
    assert calls == [] and not state.is_ready() and state.error() is None
    state.set_value("v")
    state.set_value("ignored")  # first completion wins
    state.set_error(KeyError("ignored"))
    state.when_ready(lambda: calls.append("late"))  # done: runs at once
    assert calls == ["early", "late"]
    assert state.is_ready() and state.wait(0) == "v" and state.type_name == "str"


def test_owner_state_wait_blocks_until_another_thread_sets_the_value() -> None:
    import threading

    state = OwnerState(GloballyUniqueId(0, 3))
    results: list[Any] = []
    waiter = threading.Thread(target=lambda: results.append(state.wait(30)))
    waiter.start()
    # the waiter made its event, or is about to: either way set_value releases it
    state.set_value(42)
    waiter.join(30)
    assert results == [42] and not waiter.is_alive()
    assert state.wait(0) == 42  # done: no event needed


def test_a_failing_owner_state_callback_is_logged_and_the_others_still_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    state = OwnerState(GloballyUniqueId(0, 4))
    calls: list[str] = []

    def failing() -> None:
        raise ValueError("a callback's own error")

    state.when_ready(failing)
    state.when_ready(lambda: calls.append("second"))
    state.set_value(1)  # does not raise
    assert calls == ["second"] and state.wait(0) == 1
    assert "a callback waiting for the value of RRef" in caplog.text

# -- random scenarios with hypothesis -------------------------------------------------------


def _random_scenario(data: Any) -> Scenario:
    """Random remote()/share/drop programs over 3 workers (drawn once, replayed per schedule)."""
    steps: list[tuple[Any, ...]] = []
    names: list[tuple[str, int]] = []
    for i in range(data.draw(st.integers(1, 2), label="values")):
        src, owner = data.draw(st.integers(0, 2)), data.draw(st.integers(0, 2))
        name = f"v{i}"
        steps.append(("remote", name, src, owner))
        names.append((name, src))
    for j in range(data.draw(st.integers(0, 3), label="shares")):
        name, holder = data.draw(st.sampled_from(names))
        dest = data.draw(st.integers(0, 2))
        new = f"s{j}"
        steps.append(("share", name, holder, dest, new))
        names.append((new, dest))
    drawn_names = [n for n, _ in names]

    def scenario(sim: Sim) -> None:
        for step in steps:
            getattr(sim, step[0])(*step[1:])
        for name in drawn_names:
            sim.drop(name)

    return scenario


@pytest.mark.timeout(120)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data(), st.booleans())
def test_random_programs_random_orders(data: Any, duplicate: bool) -> None:
    scenario = _random_scenario(data)
    choices = data.draw(st.lists(st.integers(0, 1000), min_size=60, max_size=60), label="order")
    stream: Iterator[int] = itertools.chain(choices, itertools.repeat(0))
    run_schedule(scenario, lambda n: next(stream) % n, duplicate)


# -- the owner's fetch timers ----------------------------------------------------------------


def test_cancelled_fetch_timers_never_run_and_live_ones_do() -> None:
    import threading

    from actorrpc.rref._remote import _Timers

    timers = _Timers()
    ran: list[str] = []
    done, busy, release = threading.Event(), threading.Event(), threading.Event()
    # hold the timer thread in a callback, so the timers below are due before it looks
    timers.call_later(0.0, lambda: (busy.set(), release.wait(10)))
    assert busy.wait(10), "the timer thread never ran"
    cancelled = [timers.call_later(0.0, lambda: ran.append("cancelled")) for _ in range(3)]
    for timer in cancelled:
        timer.cancel()
    timers.call_later(0.01, lambda: (ran.append("live"), done.set()))
    release.set()
    assert done.wait(10), "a live timer never ran"
    assert ran == ["live"]


def test_fetch_timers_answered_in_time_do_not_pile_up() -> None:
    from actorrpc.rref._remote import _PRUNE_AT, _Timers

    timers = _Timers()
    for _ in range(10 * _PRUNE_AT):  # a stream of fetches, each answered at once
        timers.call_later(3600.0, lambda: None).cancel()
    assert timers.pending() <= _PRUNE_AT + 1
    live = [timers.call_later(3600.0, lambda: None) for _ in range(3 * _PRUNE_AT)]
    for _ in range(10 * _PRUNE_AT):
        timers.call_later(3600.0, lambda: None).cancel()
    assert len(live) <= timers.pending() <= 2 * len(live) + _PRUNE_AT  # live ones are kept


def test_ids_travel_as_plain_tuples_and_show_as_torch_shows_them() -> None:
    ctx = RRefContext(3, lambda *args: None)
    rref_id = ctx.new_id()
    assert type(rref_id) is tuple and rref_id == GloballyUniqueId(3, 0)
    assert {GloballyUniqueId(3, 0): "found"}[rref_id] == "found"  # one table entry either way
    body, _ = dumps((rref_id, ctx.new_id()), "arguments")
    assert b"GloballyUniqueId" not in body  # pickled natively: no class, no reduce
    assert format_id(rref_id) == "GloballyUniqueId(created_on=3, local_id=0)"
    assert format_id(None) == "None"
