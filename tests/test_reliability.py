"""Reliability: dead and hung peers, timeouts, authentication, and a load run.

Every scenario runs in a group of processes of its own (never the session
``cluster``): the test writes the scenario module below (``SCENARIO_SOURCE``)
into ``tmp_path``, starts one process per rank, and checks the ``RESULT {json}``
line each process prints. Waits inside the scenarios are on conditions with
deadlines, never on sleeps; each test measures how long each failure took to
surface and compares it with the configured timeout plus a margin that is
generous because the test machines are small and busy.

See ``docs/reliability.md`` for the failure and security model these tests check.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests._cluster import REPO_ROOT, free_port

# --- the scenario module, run by every process of a scenario group ---------------------------

SCENARIO_MODULE = "actorrpc_reliability_scenarios"

SCENARIO_SOURCE = r'''
"""Reliability scenarios; ``main()`` runs one role of one scenario and prints RESULT {json}."""

import json
import os
import pickle
import shlex
import signal
import sys
import threading
import time
import traceback

import torch
import zmq

import actorrpc as rpc
from tests._waiting import wait_for
from actorrpc.agent import current_agent
from actorrpc.protocol import MessageKind, encode_header
from actorrpc.serialization import dumps

HARD_LIMIT = float(os.environ.get("SCENARIO_HARD_LIMIT", "110"))

# -- functions called over RPC ------------------------------------------------------------

_lock = threading.Lock()
_started = 0
_release = threading.Event()


def block(limit=100.0):
    """Block until release() (or ``limit`` seconds); counts how many started."""
    global _started
    with _lock:
        _started += 1
    _release.wait(limit)
    return "released"


def started():
    with _lock:
        return _started


def release():
    _release.set()
    return True


def add(a, b):
    return a + b


def echo(x):
    return x


def send_signal(pid, sig):
    os.kill(pid, sig)
    return True


def task_state(path):
    """The state letter in a ``/proc/.../stat`` file (after the command name), None if gone."""
    try:
        with open(path) as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def all_threads_stopped(pid):
    """Whether every thread of ``pid`` is stopped: ``kill(SIGSTOP)`` returns before they are."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    states = [task_state(f"/proc/{pid}/task/{tid}/stat") for tid in tasks]
    return bool(states) and all(state in ("T", "t") for state in states)


def process_gone(pid):
    """Whether ``pid`` has died (a zombie or reaped): ``kill(SIGKILL)`` returns before it does."""
    return task_state(f"/proc/{pid}/stat") in (None, "Z", "X")


def call_peer(name, a, b):
    serving_agent()
    return rpc.rpc_sync(name, add, args=(a, b))


def whoami():
    return rpc.get_worker_info().name


def serving_agent():
    """The agent, once init_rpc has returned here (see test_api_usable_right_after_init)."""
    wait_for(rpc.is_initialized, 30, "init_rpc to return on this worker")
    return current_agent()


def transport_info():
    agent = serving_agent()
    transport = agent._transport
    return {
        "endpoint": transport.endpoint,
        "secret": transport._secret,
        "security": transport._security,
        "identity": agent.identity.decode(),
        "served": agent.stats["requests_served"],
    }


def served():
    return serving_agent().stats["requests_served"]


def in_flight():
    return serving_agent()._inflight


# -- helpers ------------------------------------------------------------------------------


def err(exc):
    return {
        "ok": False,
        "type": type(exc).__name__,
        "mro": [c.__name__ for c in type(exc).__mro__],
        "message": str(exc)[:3000],
    }


def outcome(fn, t0=None):
    """Run ``fn``; its value or error, and the seconds from ``t0`` (default: now) to the end."""
    t0 = time.monotonic() if t0 is None else t0
    try:
        value = fn()
        result = {"ok": True, "value": repr(value)[:300]}
    except BaseException as exc:  # noqa: BLE001 - every outcome is reported
        result = err(exc)
    result["elapsed"] = time.monotonic() - t0
    return result


class Background:
    """Run ``fn`` in a thread; ``result(t0)`` gives its outcome timed from ``t0``."""

    def __init__(self, fn):
        self._fn = fn
        self._outcome = None
        self._end = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        self._outcome = outcome(self._fn)
        self._end = time.monotonic()

    def result(self, t0, timeout=90.0):
        self._thread.join(timeout)
        if self._end is None:
            return {"ok": False, "type": "StillRunning", "mro": [], "message": "did not finish",
                    "elapsed": time.monotonic() - t0}
        return dict(self._outcome, elapsed=self._end - t0)


def future_result(fut, t0, ends):
    try:
        value = fut.wait()
        result = {"ok": True, "value": repr(value)[:300]}
    except BaseException as exc:  # noqa: BLE001
        result = err(exc)
    result["elapsed"] = ends.get(id(fut), time.monotonic()) - t0
    return result


def track_end(fut, ends):
    fut.add_done_callback(lambda f: ends.setdefault(id(fut), time.monotonic()))
    return fut


def options(ctx, **overrides):
    values = {"init_method": ctx["init_method"], "rpc_timeout": 60, "dead_peer_timeout": 2}
    values.update(ctx["args"].get("options", {}))
    values.update(overrides)
    return rpc.ZmqRpcBackendOptions(**values)


def init(ctx, **overrides):
    rank = ctx["rank"]
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=ctx["world_size"],
                 rpc_backend_options=options(ctx, **overrides))


# -- raw ZeroMQ attackers -----------------------------------------------------------------

_EVENT_NAMES = {
    getattr(zmq, name): name
    for name in dir(zmq)
    if name.startswith("EVENT_") and isinstance(getattr(zmq, name), int)
    and name not in ("EVENT_ALL", "EVENT_ALL_V1", "EVENT_ALL_V2")
}


class CreatesFile:
    """Unpickling this calls ``open(path, "w")``, which creates the file."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


class RunsShell:
    """Unpickling this runs ``touch path`` through ``os.system``."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, ("touch " + shlex.quote(self.path),))


def rid():
    """A random routing id (one that starts with a zero byte is reserved by ZeroMQ)."""
    return b"x" + os.urandom(7)


def evil_messages(workdir, tag, sender):
    """Messages that create marker files if their payload is unpickled or run."""
    markers = [os.path.join(workdir, f"pwned-{tag}-{i}") for i in range(3)]
    call, _ = dumps((open, (markers[2], "w"), {}, {}))
    payloads = [pickle.dumps(CreatesFile(markers[0])), pickle.dumps(RunsShell(markers[1])), call]
    messages = []
    for i, payload in enumerate(payloads):
        for kind in (MessageKind.CALL, MessageKind.REMOTE_CALL, MessageKind.RESPONSE):
            messages.append([encode_header(kind, 0, sender, 1000 + i), payload])
    return markers, messages


def attack(endpoint, messages, routing_id, listen=1.0, mechanism="null", **creds):
    """Connect a raw DEALER, send ``messages``, listen ``listen`` s for a reply and log events."""
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, routing_id)
    if mechanism == "plain":
        sock.setsockopt_string(zmq.PLAIN_USERNAME, creds["username"])
        sock.setsockopt_string(zmq.PLAIN_PASSWORD, creds["password"])
    elif mechanism == "curve":
        sock.setsockopt(zmq.CURVE_SERVERKEY, creds["server_key"])
        sock.setsockopt(zmq.CURVE_PUBLICKEY, creds["public_key"])
        sock.setsockopt(zmq.CURVE_SECRETKEY, creds["secret_key"])
    monitor = sock.get_monitor_socket()
    sock.connect(endpoint)
    sent = 0
    for frames in messages:
        try:
            sock.send_multipart(frames, zmq.NOBLOCK)
            sent += 1
        except zmq.Again:
            pass
    replies = []
    deadline = time.monotonic() + listen
    while (left := deadline - time.monotonic()) > 0:
        if sock.poll(int(left * 1000) + 1, zmq.POLLIN):
            replies.append([len(f) for f in sock.recv_multipart()])
    events = []
    from zmq.utils.monitor import recv_monitor_message
    while monitor.poll(0):
        events.append(_EVENT_NAMES.get(recv_monitor_message(monitor)["event"], "?"))
    sock.disable_monitor()
    monitor.close(linger=0)
    sock.close(linger=0)
    context.term()
    return {"sent": sent, "replies": replies, "events": events}


# -- scenario roles -----------------------------------------------------------------------


def role_serve(ctx):
    """Join, then shut down gracefully (serving until everyone does)."""
    init(ctx)
    return {"shutdown": outcome(lambda: rpc.shutdown(timeout=ctx["args"].get("shutdown", 90)))}


def role_serve_late_publish(ctx):
    """Join, but widen init_rpc's window between serving and publishing the agent.

    ``init_rpc`` publishes the agent (``set_current_agent``) after ``Agent.start()``
    has started the I/O thread. This role delays that publication, when it comes
    after the start, until the first request was served, so the race is
    deterministic: the request runs while the process looks uninitialized.
    """
    import actorrpc._api as api

    original = api.set_current_agent

    def late(agent):
        if agent is not None and agent.is_alive():
            try:
                wait_for(lambda: agent.stats["requests_served"] >= 1, 20, "a first request")
            except TimeoutError:
                pass
        original(agent)

    api.set_current_agent = late
    return role_serve(ctx)


def driver_init_race(ctx):
    init(ctx)
    res = {"whoami": outcome(lambda: rpc.rpc_sync("worker1", whoami, timeout=30))}
    res["shutdown"] = outcome(lambda: rpc.shutdown(timeout=60))
    return res


def role_linger(ctx):
    """Join, serve until the driver creates the file ``release``, then leave at once."""
    init(ctx)
    path = os.path.join(ctx["workdir"], "release")
    wait_for(lambda: os.path.exists(path), 100, "the driver's release file")
    return {"shutdown": outcome(lambda: rpc.shutdown(graceful=False))}


def driver_kill(ctx):
    """SIGKILL worker1 while calls wait on it; worker2 does the killing and survives."""
    init(ctx)
    res = {}
    victim_pid = rpc.rpc_sync("worker1", os.getpid)
    res["victim_pid"] = victim_pid
    owned = rpc.remote("worker1", torch.ones, args=(4,))
    res["owned_before"] = float(owned.to_here().sum())
    ends = {}
    futures = {f"rpc_async#{i}": track_end(rpc.rpc_async("worker1", block), ends) for i in range(3)}
    blocked = rpc.remote("worker1", block)
    background = {
        "rpc_sync": Background(lambda: rpc.rpc_sync("worker1", block)),
        "to_here(value never created)": Background(lambda: blocked.to_here()),
    }
    wait_for(lambda: rpc.rpc_sync("worker1", started) >= 5, 60, "5 blocking calls on worker1")
    wait_for(lambda: any("to_here" in d for d in current_agent().pending_destinations()), 30,
             "the to_here fetch is pending")
    res["kill_sent"] = rpc.rpc_sync("worker2", send_signal, args=(victim_pid, signal.SIGKILL))
    t_kill = time.monotonic()
    # a request that reached worker1 before it died would be answered
    wait_for(lambda: process_gone(victim_pid), 30, "worker1 to die")
    background["to_here(value created before)"] = Background(lambda: owned.to_here())
    background["rpc_sync sent after the kill"] = Background(
        lambda: rpc.rpc_sync("worker1", add, args=(1, 2)))
    pending = {name: future_result(f, t_kill, ends) for name, f in futures.items()}
    pending.update({name: b.result(t_kill) for name, b in background.items()})
    res["pending"] = pending
    res["after_detection"] = {
        "rpc_sync": outcome(lambda: rpc.rpc_sync("worker1", add, args=(1, 2))),
        "rpc_async": outcome(lambda: rpc.rpc_async("worker1", add, args=(1, 2)).wait()),
        "remote.to_here": outcome(lambda: rpc.remote("worker1", add, args=(1, 2)).to_here()),
    }
    res["survivor"] = {
        "rpc_sync": rpc.rpc_sync("worker2", add, args=(2, 3)),
        "round_trip": rpc.rpc_sync("worker2", call_peer, args=("worker0", 4, 5)),
        "rpc_async": [f.wait() for f in [rpc.rpc_async("worker2", add, args=(i, i))
                                         for i in range(20)]] == [2 * i for i in range(20)],
        "remote": float(rpc.remote("worker2", torch.ones, args=(3,)).to_here().sum()),
    }
    res["shutdown"] = outcome(lambda: rpc.shutdown(timeout=30))
    return res


def driver_hang(ctx):
    """SIGSTOP worker1 while calls wait on it; SIGCONT it later; SIGKILL it at the end."""
    init(ctx)
    res = {}
    victim_pid = rpc.rpc_sync("worker1", os.getpid)
    owned = rpc.remote("worker1", torch.ones, args=(4,))
    res["owned_before"] = float(owned.to_here().sum())
    ends = {}
    futures = {f"rpc_async#{i}": track_end(rpc.rpc_async("worker1", block), ends) for i in range(2)}
    wait_for(lambda: rpc.rpc_sync("worker1", started) >= 2, 60, "2 blocking calls on worker1")
    try:
        os.kill(victim_pid, signal.SIGSTOP)
        t_stop = time.monotonic()
        # a request that reached worker1 before the signal took effect would be answered
        wait_for(lambda: all_threads_stopped(victim_pid), 30, "every thread of worker1 stopped")
        futures["rpc_async sent while stopped"] = track_end(
            rpc.rpc_async("worker1", add, args=(1, 2)), ends)
        background = {
            "rpc_sync sent while stopped": Background(
                lambda: rpc.rpc_sync("worker1", add, args=(2, 3))),
            "to_here while stopped": Background(lambda: owned.to_here()),
        }
        pending = {name: future_result(f, t_stop, ends) for name, f in futures.items()}
        pending.update({name: b.result(t_stop) for name, b in background.items()})
        res["pending"] = pending
        res["survivor_while_stopped"] = rpc.rpc_sync("worker2", add, args=(2, 3))
    finally:
        os.kill(victim_pid, signal.SIGCONT)
    t_cont = time.monotonic()

    def answers():
        try:
            return rpc.rpc_sync("worker1", add, args=(5, 5), timeout=10) == 10
        except rpc.PeerUnreachableError:
            return False

    res["revived"] = outcome(lambda: wait_for(answers, 40, "worker1 answers again"), t_cont)
    res["released"] = outcome(lambda: rpc.rpc_sync("worker1", release, timeout=10))
    os.kill(victim_pid, signal.SIGKILL)
    res["shutdown"] = outcome(lambda: rpc.shutdown(timeout=30))
    return res


def driver_timeouts(ctx):
    """Every blocking call gives up within its timeout."""
    res = {}
    lonely = f"tcp://127.0.0.1:{ctx['args']['lonely_port']}"
    res["init_rpc world never fills"] = outcome(lambda: rpc.init_rpc(
        "lonely", rank=0, world_size=2,
        rpc_backend_options=rpc.ZmqRpcBackendOptions(init_method=lonely, init_timeout=3)))
    unreachable = f"tcp://127.0.0.1:{ctx['args']['unreachable_port']}"
    res["init_rpc master never starts"] = outcome(lambda: rpc.init_rpc(
        "orphan", rank=1, world_size=2,
        rpc_backend_options=rpc.ZmqRpcBackendOptions(init_method=unreachable, init_timeout=3)))
    init(ctx, rpc_timeout=ctx["args"]["default_timeout"])
    res["rpc_sync(timeout=1)"] = outcome(lambda: rpc.rpc_sync("worker1", block, timeout=1))
    res["rpc_async(timeout=1).wait()"] = outcome(
        lambda: rpc.rpc_async("worker1", block, timeout=1).wait())
    res["rpc_sync(default timeout)"] = outcome(lambda: rpc.rpc_sync("worker1", block))
    no_limit = rpc.remote("worker1", block, timeout=0)
    res["remote(timeout=0).to_here(timeout=1)"] = outcome(lambda: no_limit.to_here(timeout=1))
    res["remote(timeout=1).to_here()"] = outcome(
        lambda: rpc.remote("worker1", block, timeout=1).to_here())
    own = rpc.remote("worker0", block, timeout=0)
    res["self remote(timeout=0).to_here(timeout=1)"] = outcome(lambda: own.to_here(timeout=1))
    release()
    res["release"] = rpc.rpc_sync("worker1", release)
    res["late calls still work"] = rpc.rpc_sync("worker1", add, args=(1, 2))
    # A fetch of an RRef its owner never hears of (its creator died first): the caller gives
    # up after its timeout; the owner should not keep the request in flight for ever. The
    # owner's bound (3 s) outlasts the caller's timeout (0.5 s) by far: with equal ones the
    # owner's timeout reply (a FetchFailure value, which to_here() raises) could beat the
    # caller's own deadline.
    agent = current_agent()
    fetch = agent.send_request(agent.resolve("worker1"), MessageKind.RREF_FETCH,
                               (("never-created", 1), {}, 3.0), 0.5, description="orphan fetch")
    res["orphan fetch"] = outcome(fetch.wait)
    res["orphan fetch released on the owner"] = outcome(lambda: wait_for(
        lambda: rpc.rpc_sync("worker1", in_flight) == 1, 10, "owner has only our query in flight"))
    res["shutdown(timeout=3), peer never arrives"] = outcome(lambda: rpc.shutdown(timeout=3))
    with open(os.path.join(ctx["workdir"], "release"), "w"):
        pass
    return res


def driver_security(ctx):
    """Unauthenticated and wrongly authenticated peers never reach the protocol layer."""
    init(ctx)
    res = {}
    info = rpc.rpc_sync("worker1", transport_info)
    endpoint, secret = info["endpoint"], info["secret"]
    res["security"] = info["security"]
    res["endpoint"] = endpoint
    res["served_before"] = rpc.rpc_sync("worker1", served)
    own_identity = current_agent().identity
    attackers = {
        "no credentials": dict(routing_id=rid()),
        "no credentials, worker0's routing id": dict(routing_id=own_identity),
        "PLAIN wrong password": dict(routing_id=rid(), mechanism="plain",
                                     username="actorrpc", password=secret[::-1]),
        "PLAIN wrong username": dict(routing_id=rid(), mechanism="plain",
                                     username="root", password=secret),
        "PLAIN guessed password": dict(routing_id=rid(), mechanism="plain",
                                       username="actorrpc", password="actorrpc"),
    }
    public, secret_key = zmq.curve_keypair()
    attackers["CURVE client (random key)"] = dict(
        routing_id=rid(), mechanism="curve", server_key=public,
        public_key=public, secret_key=secret_key)
    # control: the right secret passes the handshake, but an unknown routing id is dropped
    attackers["control: PLAIN right secret, not a member"] = dict(
        routing_id=rid(), mechanism="plain", username="actorrpc", password=secret)
    res["attacks"] = {}
    markers = []
    for i, (name, spec) in enumerate(attackers.items()):
        for sender in (0, 1):
            paths, messages = evil_messages(ctx["workdir"], f"{i}-{sender}", sender)
            markers += paths
            key = f"{name} (header sender {sender})"
            res["attacks"][key] = attack(endpoint, messages, **spec)
            res["attacks"][key]["serving"] = rpc.rpc_sync("worker1", add, args=(2, 3), timeout=20)
    res["markers_created"] = [p for p in markers if os.path.exists(p)]
    res["served_after"] = rpc.rpc_sync("worker1", served)
    res["shutdown"] = outcome(lambda: rpc.shutdown(timeout=60))
    return res


def driver_curve(ctx):
    """A CURVE group works end to end; PLAIN, NULL and foreign CURVE keys are refused."""
    init(ctx)
    res = {}
    info = rpc.rpc_sync("worker1", transport_info)
    endpoint, secret = info["endpoint"], info["secret"]
    res["security"] = [current_agent()._transport._security, info["security"]]
    res["rpc_sync"] = rpc.rpc_sync("worker1", add, args=(2, 3))
    big = torch.arange(262144, dtype=torch.float32)  # 1 MiB
    res["echo_1mib"] = bool(torch.equal(rpc.rpc_sync("worker1", echo, args=(big,)), big))
    res["rpc_async"] = [f.wait() for f in [rpc.rpc_async("worker1", add, args=(i, 1))
                                           for i in range(20)]] == list(range(1, 21))
    rref = rpc.remote("worker1", torch.ones, args=(5,))
    res["remote.to_here"] = float(rref.to_here().sum())
    res["round_trip"] = rpc.rpc_sync("worker1", call_peer, args=("worker0", 7, 8))
    del rref
    from actorrpc.transport._security import curve_keypair as _curve_keypair
    group_public, group_secret_key = _curve_keypair(secret)
    other_public, other_secret = zmq.curve_keypair()
    attackers = {
        "no credentials": dict(),
        "PLAIN with the group secret": dict(mechanism="plain", username="actorrpc",
                                            password=secret),
        "CURVE, foreign key": dict(mechanism="curve", server_key=group_public,
                                   public_key=other_public, secret_key=other_secret),
        "control: CURVE group key, not a member": dict(
            mechanism="curve", server_key=group_public, public_key=group_public,
            secret_key=group_secret_key),
    }
    res["attacks"] = {}
    markers = []
    for i, (name, spec) in enumerate(attackers.items()):
        paths, messages = evil_messages(ctx["workdir"], f"curve-{i}", 1)
        markers += paths
        res["attacks"][name] = attack(endpoint, messages, routing_id=rid(), **spec)
    res["markers_created"] = [p for p in markers if os.path.exists(p)]
    res["serving_after"] = rpc.rpc_sync("worker1", add, args=(1, 1))
    # Can a non-member read the group secret from the rendezvous store over the network?
    host = ctx["args"].get("external_ip")
    if host:
        import datetime
        import torch.distributed as dist
        port = int(ctx["init_method"].rsplit(":", 1)[1])

        def read_secret():
            client = dist.TCPStore(host, port, is_master=False,
                                   timeout=datetime.timedelta(seconds=3))
            # the agent's view: PrefixStore("actorrpc/<generation>/"), generation 0 here
            return bytes(dist.PrefixStore("actorrpc/0/", client).get("secret")).decode() == secret

        res["store_secret_from_network"] = outcome(read_secret)
    res["shutdown"] = outcome(lambda: rpc.shutdown(timeout=60))
    return res


SCENARIOS = {
    "kill": driver_kill,
    "hang": driver_hang,
    "timeouts": driver_timeouts,
    "security": driver_security,
    "curve": driver_curve,
    "init_race": driver_init_race,
}


def _watchdog(parent):
    start = time.monotonic()
    while os.getppid() == parent and time.monotonic() - start < HARD_LIMIT:
        time.sleep(0.5)
    os._exit(3)


def main():
    scenario, rank, world_size, init_method, workdir, args = sys.argv[1:7]
    ctx = {"scenario": scenario, "rank": int(rank), "world_size": int(world_size),
           "init_method": init_method, "workdir": workdir, "args": json.loads(args)}
    threading.Thread(target=_watchdog, args=(os.getppid(),), daemon=True).start()
    roles = ctx["args"].get("roles", {})
    role = roles.get(rank) or ("driver" if ctx["rank"] == 0 else "serve")
    try:
        if role == "driver":
            result = SCENARIOS[scenario](ctx)
        else:
            result = {"serve": role_serve, "linger": role_linger,
                      "serve_late_publish": role_serve_late_publish}[role](ctx)
        code = 0
    except BaseException:  # noqa: BLE001
        result = {"crash": traceback.format_exc()}
        code = 1
    print("RESULT " + json.dumps(result), flush=True)
    sys.stdout.flush()
    os._exit(code)
'''


# --- running a scenario group ----------------------------------------------------------------


@dataclass
class RankRun:
    rank: int
    returncode: int | None
    result: dict[str, Any]
    stdout: str
    stderr: str

    def describe(self) -> str:
        return (f"rank {self.rank}: exit {self.returncode}\n--- stdout\n{self.stdout[-3000:]}\n"
                f"--- stderr\n{self.stderr[-6000:]}")


@dataclass
class GroupRun:
    ranks: list[RankRun] = field(default_factory=list)

    def result(self, rank: int = 0) -> dict[str, Any]:
        run = self.ranks[rank]
        if not run.result or "crash" in run.result:
            # not an AssertionError: an xfail(raises=AssertionError) must not absorb it
            pytest.fail(f"rank {rank} did not finish its scenario:\n{self.describe()}")
        return run.result

    def describe(self) -> str:
        return "\n".join(run.describe() for run in self.ranks)


def scenario_env(workdir: Path, **extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("ACTORRPC_", "SLURM_", "TORCHELASTIC_"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env["PYTHONPATH"] = os.pathsep.join(
        [str(workdir), REPO_ROOT, *filter(None, [os.environ.get("PYTHONPATH")])])
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def run_group(
    workdir: Path,
    scenario: str,
    world_size: int,
    args: dict[str, Any] | None = None,
    deadline_s: float = 105.0,
    module: str = SCENARIO_MODULE,
    source: str = SCENARIO_SOURCE,
) -> GroupRun:
    """Start ``world_size`` processes running ``module.main()`` for ``scenario``; wait for all."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / f"{module}.py").write_text(source)
    init_method = f"tcp://127.0.0.1:{free_port()}"
    env = scenario_env(workdir, SCENARIO_HARD_LIMIT=str(deadline_s + 5))
    processes = []
    for rank in range(world_size):
        out = open(workdir / f"rank{rank}.out", "w")  # noqa: SIM115 - closed below
        err = open(workdir / f"rank{rank}.err", "w")  # noqa: SIM115
        processes.append((rank, out, err, subprocess.Popen(
            [sys.executable, "-c", f"import {module}; {module}.main()", scenario, str(rank),
             str(world_size), init_method, str(workdir), json.dumps(args or {})],
            cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
        )))
    deadline = time.monotonic() + deadline_s
    group = GroupRun()
    for rank, out, err, process in processes:
        try:
            code: int | None = process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            code = None
        out.close()
        err.close()
        stdout = (workdir / f"rank{rank}.out").read_text()
        stderr = (workdir / f"rank{rank}.err").read_text()
        if code is None:
            stderr += "\n[killed by the test: scenario deadline passed]"
        result: dict[str, Any] = {}
        for line in stdout.splitlines():
            if line.startswith("RESULT "):
                result = json.loads(line[len("RESULT "):])
        group.ranks.append(RankRun(rank, code, result, stdout, stderr))
    return group


def assert_error(outcome: dict[str, Any], type_name: str, *fragments: str, context: str = ""):
    assert not outcome["ok"], f"{context}: expected {type_name}, but it succeeded: {outcome}"
    assert type_name in outcome["mro"], f"{context}: expected {type_name}, got {outcome}"
    for fragment in fragments:
        assert fragment in outcome["message"], f"{context}: {fragment!r} not in {outcome}"


# Detection of a dead or hung peer: a call waits, the peer is silent for
# ``liveness_interval`` (1 s), the I/O loop notices within another interval and
# sends a PING, and the PING times out after ``dead_peer_timeout`` (2 s here).
DEAD_PEER_TIMEOUT = 2.0
LIVENESS_INTERVAL = 1.0
DETECTION_BOUND = DEAD_PEER_TIMEOUT + 2 * LIVENESS_INTERVAL
MARGIN = 4.0  # scheduling on a busy 2-core machine


# --- (a) a worker is SIGKILLed while calls wait on it ----------------------------------------


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> GroupRun:
    return run_group(tmp_path_factory.mktemp("kill"), "kill", 3)


@pytest.mark.timeout(120)
def test_sigkill_fails_every_pending_call_naming_the_dead_worker(killed):
    result = killed.result(0)
    assert result["owned_before"] == 4.0
    assert result["kill_sent"] is True
    assert killed.ranks[1].returncode == -signal.SIGKILL, killed.describe()
    pending = result["pending"]
    assert len(pending) == 7, pending
    for name, outcome in pending.items():
        assert_error(outcome, "PeerUnreachableError", "worker1", context=name)
        assert outcome["elapsed"] < DETECTION_BOUND + MARGIN, (name, outcome)


@pytest.mark.timeout(120)
def test_sigkill_later_calls_fail_fast(killed):
    for name, outcome in killed.result(0)["after_detection"].items():
        assert_error(outcome, "PeerUnreachableError", "worker1", context=name)
        assert outcome["elapsed"] < 1.0 + MARGIN, (name, outcome)


@pytest.mark.timeout(120)
def test_sigkill_survivors_keep_calling_each_other(killed):
    survivor = killed.result(0)["survivor"]
    assert survivor == {"rpc_sync": 5, "round_trip": 9, "rpc_async": True, "remote": 3.0}


@pytest.mark.timeout(120)
def test_sigkill_survivors_shutdown_names_the_dead_peer(killed):
    driver = killed.result(0)["shutdown"]
    assert_error(driver, "ShutdownError", "worker1", "dead peer", context="worker0 shutdown")
    assert driver["elapsed"] < 30, driver
    survivor = killed.result(2)["shutdown"]
    assert_error(survivor, "ShutdownError", "worker1", "dead peer", context="worker2 shutdown")
    assert survivor["elapsed"] < 60, survivor
    assert killed.ranks[0].returncode == 0 and killed.ranks[2].returncode == 0, killed.describe()


# --- (b) a worker hangs (SIGSTOP) while calls wait on it --------------------------------------


@pytest.fixture(scope="module")
def hung(tmp_path_factory) -> GroupRun:
    return run_group(tmp_path_factory.mktemp("hang"), "hang", 3)


@pytest.mark.timeout(120)
def test_sigstop_fails_pending_calls_within_detection_time(hung):
    result = hung.result(0)
    assert result["owned_before"] == 4.0
    pending = result["pending"]
    assert len(pending) == 5, pending
    for name, outcome in pending.items():
        assert_error(outcome, "PeerUnreachableError", "worker1", "did not answer", context=name)
        assert outcome["elapsed"] < DETECTION_BOUND + MARGIN, (name, outcome)
        assert outcome["elapsed"] >= DEAD_PEER_TIMEOUT - 0.2, (name, outcome)
    assert result["survivor_while_stopped"] == 5


@pytest.mark.timeout(120)
def test_sigstop_peer_revives_after_sigcont_and_dead_at_shutdown(hung):
    result = hung.result(0)
    assert result["revived"]["ok"], result["revived"]
    assert result["revived"]["elapsed"] < 20, result["revived"]
    assert result["released"]["ok"], result["released"]
    assert_error(result["shutdown"], "ShutdownError", "worker1", context="worker0 shutdown")
    assert result["shutdown"]["elapsed"] < 30
    assert_error(hung.result(2)["shutdown"], "ShutdownError", "worker1", "dead peer",
                 context="worker2 shutdown")


# --- (c) every blocking call honours its timeout ----------------------------------------------

DEFAULT_TIMEOUT = 8.0


@pytest.fixture(scope="module")
def timeouts(tmp_path_factory) -> GroupRun:
    args = {"lonely_port": free_port(), "unreachable_port": free_port(),
            "default_timeout": DEFAULT_TIMEOUT, "roles": {"1": "linger"}}
    return run_group(tmp_path_factory.mktemp("timeouts"), "timeouts", 2, args)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case, limit, error, fragment", [
    ("init_rpc world never fills", 3.0, "RendezvousError", ""),
    ("init_rpc master never starts", 3.0, "RendezvousError", ""),
    ("rpc_sync(timeout=1)", 1.0, "RpcTimeoutError", "RPC ran for more than"),
    ("rpc_async(timeout=1).wait()", 1.0, "RpcTimeoutError", "RPC ran for more than"),
    ("rpc_sync(default timeout)", DEFAULT_TIMEOUT, "RpcTimeoutError", "RPC ran for more than"),
    ("remote(timeout=0).to_here(timeout=1)", 1.0, "RpcTimeoutError", "RPC ran for more than"),
    ("remote(timeout=1).to_here()", 1.0, "RpcTimeoutError", "timed out"),
    ("self remote(timeout=0).to_here(timeout=1)", 1.0, "RpcTimeoutError", ""),
    ("shutdown(timeout=3), peer never arrives", 3.0, "ShutdownError", "worker1"),
])
def test_blocking_call_honours_its_timeout(timeouts, case, limit, error, fragment):
    outcome = timeouts.result(0)[case]
    assert_error(outcome, error, fragment, context=case)
    assert limit - 0.2 <= outcome["elapsed"] < limit + MARGIN, (case, outcome)


@pytest.mark.timeout(120)
def test_orphan_fetch_does_not_stay_in_flight_on_the_owner(timeouts):
    result = timeouts.result(0)
    assert_error(result["orphan fetch"], "RpcTimeoutError", context="orphan fetch")
    assert result["orphan fetch released on the owner"]["ok"], result


@pytest.mark.timeout(120)
def test_timeouts_group_still_serves_and_exits(timeouts):
    result = timeouts.result(0)
    assert result["release"] is True and result["late calls still work"] == 3
    assert timeouts.result(1)["shutdown"]["ok"], timeouts.describe()
    assert [r.returncode for r in timeouts.ranks] == [0, 0], timeouts.describe()


# --- (d) security: unauthenticated peers never reach the protocol layer ----------------------


def _refused(name: str, attack: dict[str, Any]) -> None:
    assert attack["sent"] > 0, (name, attack)
    assert attack["replies"] == [], f"{name}: got a reply: {attack}"
    assert "EVENT_HANDSHAKE_SUCCEEDED" not in attack["events"], (name, attack)
    assert any(e.startswith("EVENT_HANDSHAKE_FAILED") for e in attack["events"]), (name, attack)


@pytest.fixture(scope="module")
def plain_group(tmp_path_factory) -> GroupRun:
    return run_group(tmp_path_factory.mktemp("security"), "security", 2)


def test_attack_payloads_are_real(tmp_path):
    """Control: the payloads the attackers send do create the marker when unpickled."""
    source = SCENARIO_SOURCE
    namespace: dict[str, Any] = {}
    start = source.index("class CreatesFile")
    end = source.index("def evil_messages")
    exec("import os, shlex\n" + source[start:end], namespace)  # noqa: S102 - our own text
    for cls in ("CreatesFile", "RunsShell"):
        marker = tmp_path / f"control-{cls}"
        pickle.loads(pickle.dumps(namespace[cls](str(marker))))
        assert marker.exists(), cls


@pytest.mark.timeout(120)
def test_unauthenticated_and_wrong_password_peers_are_refused(plain_group):
    result = plain_group.result(0)
    assert result["security"] == "plain"
    assert result["endpoint"].startswith("tcp://127.0.0.1:"), result["endpoint"]
    assert result["markers_created"] == []
    for name, attack in result["attacks"].items():
        assert attack["serving"] == 5, (name, attack)
        if name.startswith("control"):
            # the right secret passes the handshake; a non-member's message is still dropped
            assert "EVENT_HANDSHAKE_SUCCEEDED" in attack["events"], (name, attack)
            assert attack["replies"] == [], (name, attack)
        else:
            _refused(name, attack)
    # nothing but our own calls was served: 14 `add` checks and the `served` call itself
    assert result["served_after"] - result["served_before"] <= 14 + 1 + 3, result
    assert result["shutdown"]["ok"], result["shutdown"]
    assert plain_group.result(1)["shutdown"]["ok"], plain_group.describe()


@pytest.fixture(scope="module")
def curve_group(tmp_path_factory) -> GroupRun:
    external = _external_ip()
    args = {"options": {"security": "curve"}, "external_ip": external}
    return run_group(tmp_path_factory.mktemp("curve"), "curve", 2, args)


def _external_ip() -> str | None:
    """A non-loopback address of this host, if it has one."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("192.0.2.1", 9))  # no packet is sent for a UDP connect
            address = probe.getsockname()[0]
    except OSError:
        return None
    return None if address.startswith("127.") else address


@pytest.mark.timeout(120)
def test_curve_group_works_end_to_end(curve_group):
    result = curve_group.result(0)
    assert result["security"] == ["curve", "curve"]
    assert result["rpc_sync"] == 5 and result["echo_1mib"] is True
    assert result["rpc_async"] is True and result["remote.to_here"] == 5.0
    assert result["round_trip"] == 15 and result["serving_after"] == 2
    assert result["shutdown"]["ok"], result["shutdown"]
    assert curve_group.result(1)["shutdown"]["ok"], curve_group.describe()


@pytest.mark.timeout(120)
def test_curve_refuses_plain_null_and_foreign_keys(curve_group):
    result = curve_group.result(0)
    assert result["markers_created"] == []
    for name, attack in result["attacks"].items():
        if name.startswith("control"):
            assert "EVENT_HANDSHAKE_SUCCEEDED" in attack["events"], (name, attack)
            assert attack["replies"] == [], (name, attack)
        else:
            _refused(name, attack)


@pytest.mark.timeout(120)
def test_generated_secret_is_not_readable_from_the_network(curve_group):
    outcome = curve_group.result(0).get("store_secret_from_network")
    if outcome is None:
        pytest.skip("this host has no non-loopback address")
    assert not (outcome["ok"] and outcome["value"] == "True"), outcome


# --- a call served right after init_rpc may use the RPC API ---------------------------------


@pytest.mark.timeout(120)
def test_api_usable_right_after_init(tmp_path):
    group = run_group(tmp_path, "init_race", 2, {"roles": {"1": "serve_late_publish"}})
    whoami = group.result(0)["whoami"]
    assert whoami["ok"] and whoami["value"] == "'worker1'", whoami


# --- the load test, quick mode ----------------------------------------------------------------


@pytest.mark.timeout(120)
def test_load_test_quick_loses_nothing(tmp_path):
    out = tmp_path / "load_test.json"
    process = subprocess.run(
        [sys.executable, os.path.join(REPO_ROOT, "benchmarks", "load_test.py"), "--quick",
         "--json", str(out), "--timeout", "100"],
        cwd=REPO_ROOT, env=scenario_env(tmp_path), capture_output=True, text=True, timeout=115,
    )
    assert out.exists(), f"exit {process.returncode}\n{process.stdout}\n{process.stderr[-5000:]}"
    report = json.loads(out.read_text())
    totals = report["totals"]
    assert totals["calls"] == 5000, totals
    assert totals["ok"] == 5000, (totals, process.stdout[-3000:])
    assert totals["failed"] == 0 and totals["lost"] == 0 and totals["duplicated"] == 0, totals
    assert totals["wrong_result"] == 0 and totals["served"] == 5000, totals
    assert report["workers"] == 4 and report["threads_per_worker"] == 8
    assert process.returncode == 0, process.stderr[-5000:]
