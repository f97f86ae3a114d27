"""End-to-end tests of `actorrpc launch` with plain worker scripts (no RPC involved)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ._cluster import free_port

LAUNCH = [sys.executable, "-m", "actorrpc.cli.main", "launch"]
OPTIONS = [
    "--nproc-per-node",
    "--nnodes",
    "--node-rank",
    "--master-addr",
    "--master-port",
    "--max-restarts",
    "--names",
]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACTORRPC_")}
    env.update(extra)
    return env


def _script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "worker.py"
    path.write_text(textwrap.dedent(body))
    return path


def _run(args: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 45):
    """Run the CLI to completion; stop it (and so its workers) if it overruns."""
    proc = subprocess.Popen(
        args,
        cwd=cwd,
        env=env if env is not None else _env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        pytest.fail(f"launch did not finish in {timeout}s\nstdout:\n{out}\nstderr:\n{err}")
    return proc.returncode, out, err




@pytest.mark.timeout(60)
def test_two_workers_get_ranks_and_prefixed_output(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        """
        import os, sys
        e = os.environ
        print(f"RANK={e['RANK']} LOCAL_RANK={e['LOCAL_RANK']} WORLD_SIZE={e['WORLD_SIZE']}"
              f" LOCAL_WORLD_SIZE={e['LOCAL_WORLD_SIZE']} MASTER_ADDR={e['MASTER_ADDR']}"
              f" MASTER_PORT={e['MASTER_PORT']} NAME={e['ACTORRPC_WORKER_NAME']}"
              f" SECRET={e['ACTORRPC_SECRET']} ARGS={sys.argv[1:]}")
        print(f"to stderr {e['RANK']}", file=sys.stderr)
        """,
    )
    code, out, err = _run([*LAUNCH, "--nproc-per-node", "2", str(script), "a", "--b"], tmp_path)
    assert code == 0, err

    pattern = re.compile(
        r"^\[(\d)\]: RANK=(\d) LOCAL_RANK=(\d) WORLD_SIZE=2 LOCAL_WORLD_SIZE=2"
        r" MASTER_ADDR=127\.0\.0\.1 MASTER_PORT=(\d+) NAME=(\S+) SECRET=([0-9a-f]+)"
        r" ARGS=\['a', '--b'\]$",
        re.MULTILINE,
    )
    found = {m.group(1): m.groups() for m in pattern.finditer(out)}
    assert sorted(found) == ["0", "1"], out
    for prefix, (_, rank, local_rank, _port, name, _secret) in found.items():
        assert prefix == rank == local_rank
        assert name == f"worker{rank}"
    ports = {groups[3] for groups in found.values()}
    secrets = {groups[5] for groups in found.values()}
    assert len(ports) == 1 and 0 < int(ports.pop()) < 65536
    assert len(secrets) == 1 and len(secrets.pop()) == 64
    assert "[0]: to stderr 0" in err and "[1]: to stderr 1" in err


@pytest.mark.timeout(60)
def test_failing_worker_stops_the_others_and_sets_exit_code(tmp_path: Path) -> None:
    fifo = tmp_path / "ready.fifo"
    os.mkfifo(fifo)
    stopped = tmp_path / "stopped0"
    script = _script(
        tmp_path,
        f"""
        import os, signal, sys, threading
        if os.environ["RANK"] == "0":
            def on_signal(signum, frame):
                with open({str(stopped)!r}, "w") as f:
                    f.write(signal.Signals(signum).name)
                os._exit(128 + signum)
            signal.signal(signal.SIGTERM, on_signal)
            signal.signal(signal.SIGINT, on_signal)
            with open({str(fifo)!r}, "w") as f:  # blocks until rank 1 opens it
                f.write("ready")
            threading.Event().wait(60)  # "forever", but capped
            sys.exit(0)
        else:
            with open({str(fifo)!r}) as f:  # rank 0 has its handlers set by now
                f.read()
            sys.exit(3)
        """,
    )
    start = time.monotonic()
    code, out, err = _run([*LAUNCH, "--nproc-per-node", "2", str(script)], tmp_path)
    elapsed = time.monotonic() - start
    assert code == 3, (out, err)
    assert elapsed < 30
    assert stopped.read_text() in ("SIGTERM", "SIGINT")
    assert "worker 1 failed with exit code 3" in err


@pytest.mark.timeout(60)
def test_max_restarts_restarts_the_workers(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        """
        import os, sys
        attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
        print(f"attempt {attempt}")
        sys.exit(5 if attempt == "0" and os.environ["RANK"] == "1" else 0)
        """,
    )
    args = [*LAUNCH, "--nproc-per-node", "2", "--max-restarts", "1", str(script)]
    code, out, err = _run(args, tmp_path)
    assert code == 0, err
    assert "[1]: attempt 0\n" in out and "[1]: attempt 1\n" in out, out


@pytest.mark.timeout(60)
def test_sigint_is_forwarded_to_workers(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        f"""
        import os, signal, threading
        rank = os.environ["RANK"]
        def on_signal(signum, frame):
            with open(os.path.join({str(tmp_path)!r}, "got" + rank), "w") as f:
                f.write(signal.Signals(signum).name)
            os._exit(1)
        signal.signal(signal.SIGINT, on_signal)
        print("ready", flush=True)
        threading.Event().wait(60)
        """,
    )
    proc = subprocess.Popen(
        [*LAUNCH, "--nproc-per-node", "2", str(script)],
        cwd=tmp_path,
        env=_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        ready: set[str] = set()
        for line in proc.stdout:  # blocks until the workers have their handlers
            if line.strip() in ("[0]: ready", "[1]: ready"):
                ready.add(line.strip())
                if len(ready) == 2:
                    break
        assert len(ready) == 2
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=40) == 128 + signal.SIGINT
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for rank in "01":
        assert (tmp_path / f"got{rank}").read_text() == "SIGINT"


@pytest.mark.timeout(60)
def test_help_lists_every_option(tmp_path: Path) -> None:
    code, out, err = _run([*LAUNCH, "--help"], tmp_path)
    assert code == 0, err
    for option in OPTIONS:
        assert option in out
    assert "SCRIPT" in out and "ACTORRPC_WORKER_NAME" in out
    code, out, err = _run([sys.executable, "-m", "actorrpc.cli.main", "--help"], tmp_path)
    assert code == 0 and "launch" in out, err


@pytest.mark.timeout(60)
def test_names_pattern_and_given_secret_and_port(tmp_path: Path) -> None:
    port = free_port()
    script = _script(
        tmp_path,
        """
        import os, socket
        e = os.environ
        if e["RANK"] == "0":  # MASTER_PORT is left free for the job's own rendezvous
            with socket.socket() as s:
                s.bind((e["MASTER_ADDR"], int(e["MASTER_PORT"])))
        print(f"{e['ACTORRPC_WORKER_NAME']} {e['ACTORRPC_SECRET']} {e['MASTER_PORT']}")
        """,
    )
    args = [*LAUNCH, "--nproc-per-node", "3", "--names", "ps,trainer{rank}"]
    args += ["--master-port", str(port), str(script)]
    code, out, err = _run(args, tmp_path, env=_env(ACTORRPC_SECRET="s3cret"))
    assert code == 0, err
    for rank, name in enumerate(["ps", "trainer1", "trainer2"]):
        assert f"[{rank}]: {name} s3cret {port}\n" in out, out


@pytest.mark.timeout(60)
def test_names_pattern_that_repeats_a_name_is_refused(tmp_path: Path) -> None:
    script = _script(tmp_path, "raise SystemExit(9)\n")
    args = [*LAUNCH, "--nproc-per-node", "3", "--names", "ps,trainer", str(script)]
    code, out, err = _run(args, tmp_path)
    assert code == 2
    assert "--names" in err and "trainer" in err


def test_worker_name() -> None:
    from actorrpc.cli._worker import worker_name

    assert [worker_name("ps,trainer{rank}", r) for r in range(4)] == [
        "ps",
        "trainer1",
        "trainer2",
        "trainer3",
    ]
    assert worker_name("w{rank}-{local_rank}", 5, 1) == "w5-1"
    with pytest.raises(ValueError):
        worker_name("a,,b", 0)


def test_line_assembler_passes_on_whole_lines_only() -> None:
    from actorrpc.cli._tail import LineAssembler

    assembler = LineAssembler()
    assert assembler.feed("trainer2 s3cret") == []
    assert assembler.feed("") == []
    assert assembler.feed(" 11276\nps") == ["trainer2 s3cret 11276\n"]
    assert assembler.feed("\n\nlast") == ["ps\n", "\n"]
    assert assembler.finish() == ["last\n"]
    assert assembler.finish() == []


class _Tail:
    """``tail_whole_lines`` of ``log`` in a thread, into a string; stopped on exit."""

    def __init__(self, log: Path, header: str) -> None:
        import io
        import threading

        from actorrpc.cli._tail import tail_whole_lines

        self.out = io.StringIO()
        self.finished = threading.Event()
        self.thread = threading.Thread(
            target=tail_whole_lines,
            kwargs=dict(header=header, file=str(log), dst=self.out, finished=self.finished,
                        interval_sec=0.01),
        )

    def __enter__(self) -> _Tail:
        self.thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.finished.set()
        self.thread.join(10)
        assert not self.thread.is_alive()


@pytest.mark.timeout(30)
def test_tail_holds_a_split_line_and_character_until_whole(tmp_path: Path) -> None:
    from ._waiting import wait_for

    log = tmp_path / "stdout.log"
    euro = "€".encode()
    log.write_bytes(b"first\nsec" + euro[:1])  # a worker stopped mid-line and mid-character
    with _Tail(log, "[2]: ") as tail:
        # The first read takes the whole file, fragment included.
        wait_for(lambda: tail.out.getvalue() == "[2]: first\n", 10, "the first whole line")
        with log.open("ab") as fp:
            fp.write(euro[1:] + b"ond\nno newline at exit")
        wait_for(lambda: tail.out.getvalue().endswith("ond\n"), 10, "the completed line")
    assert tail.out.getvalue() == "[2]: first\n[2]: sec€ond\n[2]: no newline at exit\n"


def test_line_assembler_passes_an_endless_line_on_in_pieces() -> None:
    from actorrpc.cli._tail import LONGEST_LINE, LineAssembler

    assembler = LineAssembler()
    assert assembler.feed("x" * LONGEST_LINE) == []
    assert assembler.feed("yz") == ["x" * LONGEST_LINE + "\n"]
    assert assembler.finish() == ["yz\n"]


@pytest.mark.timeout(30)
def test_tail_ends_lines_at_carriage_returns_as_they_come(tmp_path: Path) -> None:
    from ._waiting import wait_for

    log = tmp_path / "stderr.log"
    log.write_bytes(b"progress 10%\r")  # a progress bar's refresh (tqdm writes "\r")
    with _Tail(log, "[0]: ") as tail:
        with log.open("ab") as fp:  # (a "\r" last in a read waits for what follows it)
            fp.write(b"progress 50%\r")
        wait_for(lambda: "10%" in tail.out.getvalue(), 10, "the first refresh")
        assert tail.out.getvalue() == "[0]: progress 10%\n"
        with log.open("ab") as fp:
            fp.write(b"done\r")
            fp.flush()
            fp.write(b"\n")  # "\r\n" split between writes: one line end
    assert tail.out.getvalue() == "[0]: progress 10%\n[0]: progress 50%\n[0]: done\n"


def test_whole_line_tails_overlapping_in_threads_restore_torchs_tail() -> None:
    from torch.distributed.elastic.multiprocessing import tail_log

    from actorrpc.cli._tail import tail_whole_lines, whole_line_tails

    original = tail_log.tail_logfile
    first, second = whole_line_tails(), whole_line_tails()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)  # the first to enter ends first
    assert tail_log.tail_logfile is tail_whole_lines
    second.__exit__(None, None, None)
    assert tail_log.tail_logfile is original
