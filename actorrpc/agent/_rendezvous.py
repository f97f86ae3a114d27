"""Rendezvous on torch's c10d store (the TCPStore torchrun itself uses).

Each ``init_rpc`` gets its own key space ``actorrpc/<generation>/`` so that a
group can be formed again after ``shutdown`` on the same store. Every worker:

1. claims its rank (a second claimant makes every worker fail),
2. learns the group secret (its own, or the one rank 0 published),
3. publishes ``(name, endpoint, identity)`` under ``worker/<rank>``,
4. waits until all ranks are published (or an error key appears, or the
   deadline passes), then checks that names are unique.

Shutdown barriers use the same key space (:class:`StoreBarrier`).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import secrets
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ..errors import RendezvousError

__all__ = [
    "GroupMember",
    "Rendezvous",
    "StoreBarrier",
    "choose_addresses",
    "connect_store",
    "describe_init_method",
    "group_secret",
    "host_store",
    "is_listening",
    "is_loopback",
    "master_address",
    "poll_until",
    "store_errors",
]

_POLL_INTERVAL = 0.002
_MAX_POLL_INTERVAL = 0.05
WOKEN_FIRST_POLL_INTERVAL = 0.1
MAX_WOKEN_POLL_INTERVAL = 1.0
"""Longest pause between a barrier waiter's polls when a message from the last rank to
arrive ends its wait (``StoreBarrier.wait``'s ``woken``): the polls are then only the
fallback, and each costs a round trip to the store's thread on rank 0 and a liveness
probe of the missing ranks (with the 50 ms of other polls, a worker waiting in
``shutdown`` woke ~110 times a second, and rank 0's store thread ~90)."""


@dataclass(frozen=True)
class GroupMember:
    name: str
    rank: int
    endpoint: str
    identity: bytes


def poll_until(condition: Callable[[], bool], deadline: float,
               woken: threading.Event | None = None) -> bool:
    """Poll ``condition`` with a growing interval until it holds or ``deadline`` passes.

    With ``woken``, the pauses end when it is set (whoever makes ``condition`` hold
    sets it) and grow from :data:`WOKEN_FIRST_POLL_INTERVAL` up to
    :data:`MAX_WOKEN_POLL_INTERVAL` instead of from 2 up to 50 ms. Set while
    ``condition`` still fails (a peer that announced too early), it no longer ends
    pauses: the polls go on every 50 ms at most, never in a tight loop.
    """
    interval = _POLL_INTERVAL if woken is None else WOKEN_FIRST_POLL_INTERVAL
    longest = _MAX_POLL_INTERVAL if woken is None else MAX_WOKEN_POLL_INTERVAL
    while not condition():
        now = time.monotonic()
        if now >= deadline:
            return False
        if woken is not None and woken.is_set():  # (it was set, yet the condition fails)
            woken, longest, interval = None, _MAX_POLL_INTERVAL, _POLL_INTERVAL
        pause = min(interval, deadline - now)
        if woken is None:
            time.sleep(pause)
        else:
            woken.wait(pause)
        interval = min(interval * 2, longest)
    return True


def master_address(init_method: str) -> tuple[str, int] | None:
    """The rendezvous host and port named by ``init_method`` (``env://`` or ``tcp://``)."""
    if init_method.startswith("env://"):
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    elif init_method.startswith("tcp://"):
        parsed = urllib.parse.urlparse(init_method)
        host, port = parsed.hostname, str(parsed.port) if parsed.port else None
    else:
        return None
    if not host or not port or not port.isdigit():
        return None
    return host, int(port)


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def choose_addresses(options: Any) -> tuple[str, str]:
    """Where the inbox binds and which address peers are told.

    A group whose master is on loopback is on one host: bind to loopback. Else
    bind to every interface and advertise the address this host uses to reach
    the master. ``bind_host``/``advertise_host`` options override both.
    """
    master = master_address(options.init_method)
    if options.bind_host:
        bind = options.bind_host
    elif master is None or is_loopback(master[0]):
        bind = "127.0.0.1"
    else:
        bind = "0.0.0.0"
    if options.advertise_host:
        return bind, options.advertise_host
    if bind not in ("0.0.0.0", "*"):
        return bind, bind
    if master is not None:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((master[0], master[1]))
                return bind, str(probe.getsockname()[0])
        except OSError:
            pass
    return bind, socket.gethostname()


def describe_init_method(init_method: str) -> str:
    if init_method.startswith("env://"):
        addr = os.environ.get("MASTER_ADDR", "<MASTER_ADDR unset>")
        port = os.environ.get("MASTER_PORT", "<MASTER_PORT unset>")
        return f"{init_method} ({addr}:{port})"
    return init_method


_hosted_stores: dict[tuple[str, int], tuple[Any, socket.socket | None]] = {}
_hosted_lock = threading.Lock()


def _open_store(init_method: str, rank: int, world_size: int, timeout: float) -> Any:
    """Connect to (rank 0: host) the c10d TCPStore named by ``init_method``.

    Rank 0 keeps the store it hosts for the life of the process, so a peer
    that re-initializes quickly after ``shutdown`` still finds it, and a group
    formed again on the same address continues its generation count. Under
    torchrun's agent store, or for other URL schemes, torch's own
    ``rendezvous`` handler is used.
    """
    master = master_address(init_method)
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    if master is None or (agent_store and init_method.startswith("env://")):
        store, _, _ = next(
            dist.rendezvous(
                init_method, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout)
            )
        )
        return store
    host, port = master
    if rank != 0:
        return connect_store(host, port, time.monotonic() + timeout, init_method)
    return host_store(host, port, timeout)


def connect_store(host: str, port: int, deadline: float, init_method: str) -> Any:
    """A client of the TCPStore at ``host:port``, once something listens there."""
    _wait_until_listening(host, port, deadline, init_method)
    remaining = max(1.0, deadline - time.monotonic())
    return dist.TCPStore(
        host, port, None, False, timedelta(seconds=remaining), wait_for_workers=False
    )


def host_store(host: str, port: int, timeout: float) -> Any:
    """Host (or reuse the one this process hosts) the TCPStore at ``host:port``."""
    with _hosted_lock:
        hosted = _hosted_stores.get((host, port))
        if hosted is None:
            for key in list(_hosted_stores):
                del _hosted_stores[key]  # a new address: stop hosting the old ones
            # a local group's store listens on loopback only: it holds the generated secret
            listener = _loopback_listener(host, port) if is_loopback(host) else None
            store = dist.TCPStore(
                host, port, None, True, timedelta(seconds=timeout),
                wait_for_workers=False, multi_tenant=True,
                master_listen_fd=listener.fileno() if listener is not None else None,
            )
            hosted = _hosted_stores[(host, port)] = (store, listener)
        return hosted[0]


def is_listening(host: str, port: int) -> bool:
    """Whether something accepts connections at ``host:port`` right now."""
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def _wait_until_listening(host: str, port: int, deadline: float, init_method: str) -> None:
    """Poll until the store's port accepts connections; our own deadline, not the client's."""
    interval = _POLL_INTERVAL
    while True:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise RendezvousError(
                    f"the rendezvous master at {describe_init_method(init_method)} is "
                    f"unreachable: nothing accepted a connection before the init timeout ({exc})"
                ) from exc
        time.sleep(interval)
        interval = min(interval * 2, _MAX_POLL_INTERVAL)


def _read_entry(raw: bytes, rank: int) -> dict[str, object]:
    try:
        entry = json.loads(bytes(raw).decode())
        if isinstance(entry, dict) and {"name", "endpoint", "identity"} <= set(entry):
            return entry
    except (ValueError, UnicodeDecodeError):
        pass
    raise RendezvousError(f"the rendezvous entry of rank {rank} is malformed: {bytes(raw)[:80]!r}")


def _loopback_listener(host: str, port: int) -> socket.socket:
    """A listening socket on loopback only, for the store rank 0 hosts for a local group."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((socket.gethostbyname(host), port))
        listener.listen(1024)
    except OSError as exc:
        listener.close()
        raise RendezvousError(f"cannot host the rendezvous store on {host}:{port}: {exc}") from exc
    return listener


@contextlib.contextmanager
def store_errors(what: str) -> Iterator[None]:
    """Map the store's own errors (a peer closed it, a timeout) to :class:`RendezvousError`."""
    try:
        yield
    except RendezvousError:
        raise
    except Exception as exc:
        raise RendezvousError(
            f"{what} failed: the rendezvous store is unreachable or closed "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        ) from exc


def group_secret(store: Any, init_method: str, own_secret: str | None, who: str) -> str:
    """The group secret: our own, else the one the first worker generated in the store.

    Sharing it through the store is safe only when nobody else can reach the
    store: the master must be on loopback (where the store then listens only on
    loopback); otherwise an explicit secret is required.
    """
    if own_secret:
        return own_secret
    master = master_address(init_method)
    if master is None or not is_loopback(master[0]):
        raise RendezvousError(
            "a group whose master is not on this host needs an explicit secret: set "
            "ACTORRPC_SECRET (or ACTORRPC_SECRET_FILE, or the 'secret' option) to the same "
            "value on every worker; `actorrpc launch` generates one for a single node"
        )
    with store_errors(f"{who} reading the group secret"):
        # the first worker to get here sets it; everyone reads back the winner's
        return bytes(store.compare_set("secret", "", secrets.token_hex(32))).decode()


class Rendezvous:
    """The store connection of one ``init_rpc``; lives until ``shutdown`` finishes."""

    def __init__(self, init_method: str, rank: int, world_size: int, timeout: float) -> None:
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.init_method = init_method
        where = describe_init_method(init_method)
        if init_method.startswith("env://"):
            missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(v)]
            if missing:
                raise RendezvousError(
                    f"init_method env:// needs the environment variables {', '.join(missing)}"
                )
        try:
            store = _open_store(init_method, rank, world_size, timeout)
        except RendezvousError:
            raise
        except Exception as exc:
            raise RendezvousError(
                f"rank {rank} could not reach the rendezvous store at {where} within "
                f"{timeout:.0f}s: {type(exc).__name__}: {exc}"
            ) from exc
        self._root = store
        self._status_world: int | None = None  # the world size last published for status
        generation = (int(store.add("actorrpc/inits", 1)) - 1) // world_size
        self.store: Any = dist.PrefixStore(f"actorrpc/{generation}/", store)

    def _fail(self, message: str) -> RendezvousError:
        self.store.set("error", message)
        return RendezvousError(message)

    def _raise_if_failed(self) -> None:
        if self.store.check(["error"]):
            raise RendezvousError(self.store.get("error").decode())

    def group_secret(self, own_secret: str | None) -> str:
        return group_secret(self.store, self.init_method, own_secret, f"rank {self.rank}")

    def join(self, name: str, endpoint: str, identity: bytes) -> list[GroupMember]:
        """Publish this worker and return every member, ordered by rank."""
        with store_errors(f"rank {self.rank} ({name!r}) joining the group"):
            return self._join(name, endpoint, identity)

    def _join(self, name: str, endpoint: str, identity: bytes) -> list[GroupMember]:
        if int(self.store.add(f"claim/{self.rank}", 1)) > 1:
            raise self._fail(
                f"rank {self.rank} was claimed by two workers (this one is named {name!r}); "
                "every worker needs a unique rank"
            )
        published = {"name": name, "endpoint": endpoint, "identity": identity.hex()}
        self.store.set(f"worker/{self.rank}", json.dumps(published))
        keys = [f"worker/{r}" for r in range(self.world_size)]
        deadline = time.monotonic() + self.timeout

        def ready() -> bool:
            self._raise_if_failed()
            return bool(self.store.check(keys))

        if not poll_until(ready, deadline):
            missing = [r for r in range(self.world_size) if not self.store.check([keys[r]])]
            raise RendezvousError(
                f"the group never filled: ranks {missing} of world_size {self.world_size} did "
                f"not join within {self.timeout:.0f}s (rendezvous at "
                f"{describe_init_method(self.init_method)})"
            )
        members = []
        for r in range(self.world_size):
            entry = _read_entry(self.store.get(keys[r]), r)
            member_name, member_endpoint = str(entry["name"]), str(entry["endpoint"])
            member_identity = bytes.fromhex(str(entry["identity"]))
            members.append(GroupMember(member_name, r, member_endpoint, member_identity))
        seen: dict[str, int] = {}
        for member in members:
            if member.name in seen:
                raise self._fail(
                    f"worker name {member.name!r} is not unique: ranks {seen[member.name]} "
                    f"and {member.rank} both use it"
                )
            seen[member.name] = member.rank
        return members

    def publish_status(self, rank: int, world_size: int, payload: str) -> None:
        """Write this worker's status where ``actorrpc status`` reads it (the root key space)."""
        root = self._root
        if root is not None:
            if world_size != self._status_world:  # (once: one store round trip less)
                root.set("actorrpc/status/world", str(world_size))
                self._status_world = world_size
            root.set(f"actorrpc/status/{rank}", payload)

    def barrier(self, tag: str) -> StoreBarrier:
        return StoreBarrier(self.store, tag, self.rank, self.world_size)

    def close(self) -> None:
        self.store = None
        self._root = None


class StoreBarrier:
    """A counting barrier on the store that can name who never arrived.

    Arriving appends the rank to one key (``<tag>/ranks``), then counts it (``<tag>``):
    a waiter's poll reads the count (one round trip to the store) and, while some are
    missing, who arrived (one more), whatever the world size. (It asked one key per
    rank before: 33 round trips per poll of each waiting worker in a group of 32, on
    rank 0's store, and a system call and wake-up for each on both ends.)
    """

    def __init__(self, store: Any, tag: str, rank: int, world_size: int) -> None:
        self._store = store
        self._tag = tag
        self._rank = rank
        self._world_size = world_size

    def arrive(self) -> bool:
        """Count this rank in; whether it completed the barrier (the last to arrive:
        exactly one rank gets True, the store's counter being atomic)."""
        # appended before counted: a rank counted is never missing
        self._store.append(f"{self._tag}/ranks", f"{self._rank},")
        return int(self._store.add(self._tag, 1)) == self._world_size

    def wait(
        self, deadline: float, dead: Callable[[list[int]], Collection[int]] = lambda missing: (),
        woken: threading.Event | None = None,
    ) -> list[int]:
        """Wait until everyone arrived; return the ranks still missing at the end.

        ``dead(missing)`` names the missing ranks known to be dead; once only
        dead ranks are missing, waiting for them stops early. ``woken``: set by
        whoever learns that the barrier is complete (see :func:`poll_until`).
        """

        def done() -> bool:
            if int(self._store.add(self._tag, 0)) >= self._world_size:
                return True
            missing = self.missing()
            return bool(missing) and set(missing) <= set(dead(missing))

        poll_until(done, deadline, woken)
        return self.missing()

    def missing(self) -> list[int]:
        key = f"{self._tag}/ranks"
        if not self._store.check([key]):
            return list(range(self._world_size))  # nobody arrived (get would block)
        arrived = {int(rank) for rank in bytes(self._store.get(key)).split(b",") if rank}
        return [r for r in range(self._world_size) if r not in arrived]
