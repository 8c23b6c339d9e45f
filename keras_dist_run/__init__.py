"""`keras-dist-run`: start N local processes as one JAX cluster.

    keras-dist-run -n 2 [--devices-per-process 4] [--evaluator] train.py --epochs 3
    keras-dist-run -n 2 -m package.train --epochs 3
    keras-dist-run -n 2 python -c "import keras_dist as kd; kd.cluster.initialize()"
    python -m keras_dist_run -n 2 train.py

The command is a Python script, a module (`-m`, as `python -m`), or any
executable on PATH (`python ...`, a console script; `--no-python` makes
even a file run as an executable), as torchrun starts them; its arguments
follow it.

Each process gets `KERAS_DIST_COORDINATOR` (a free loopback port),
`KERAS_DIST_NUM_PROCESSES` and `KERAS_DIST_PROCESS_ID`, which
`kd.cluster.initialize()` (and so `MultiWorkerMirroredStrategy()`) reads.
Output lines are prefixed with the rank. SIGINT/SIGTERM are forwarded (a
preemption: the processes get `--preemption-grace` seconds to back up and
exit, then SIGKILL; the launcher exits with 128 + the signal). If a process
exits with a non-zero status, the others are stopped (SIGTERM, then SIGKILL
after 10 s: JAX ignores SIGTERM once it joined a cluster) and the launcher
exits with that status — within 30 s, never hanging. A process whose
keras_dist heartbeat stops (`--heartbeat-timeout`, default 60 s: SIGSTOP, a
frozen host) or, with `--hang-timeout`, a cluster whose training loop makes
no step that long is killed likewise. The launcher's last line names the
process, its step and the cause; with `--max-restarts N` it starts the
whole group again instead, up to N times (`BackupAndRestore` resumes it),
unless the same exception ended a process at the same step as before.
`--compilation-cache` (default ~/.cache/keras-dist-run/jax) keeps JAX's
compiled programs for the restarts. Gloo's connection
lines (`[Gloo] Rank 0 is connected to 1 peer ranks...`), which say nothing a
user can act on, are dropped unless `--verbose`.

`--evaluator` starts one more process beside the workers, outside the JAX
cluster: it gets no `KERAS_DIST_*` variables but a `TF_CONFIG` whose task is
`{"type": "evaluator", "index": 0}` (the workers listed on loopback), so the
script can branch on `kd.cluster.resolve().task_type == "evaluator"` and run
a `kd.callbacks.SidecarEvaluator`. Its lines are prefixed `[evaluator]`. Its
failure is reported but does not stop training; the launcher waits for it
after the workers end (it stops on its own once training is done) and exits
with its status if the workers succeeded.
"""

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from types import FrameType
from typing import IO

from keras_dist_run._goodput import Attempt, account, table
from keras_dist_run._health import (
    RESTART_EXIT_CODE,
    Failure,
    Watch,
    at_step,
    failure_record,
)

__all__ = ["main"]

_LAUNCHER_VARS = (
    "KERAS_DIST_COORDINATOR",
    "KERAS_DIST_NUM_PROCESSES",
    "KERAS_DIST_PROCESS_ID",
)
GRACE_SECONDS = 10.0
POLL_SECONDS = 0.05


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now.

    Example:

    ```python
    from keras_dist.launch import free_port

    port = free_port()
    os.environ["KERAS_DIST_PORT"] = str(port)
    ```
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_EXAMPLES = """examples:
  keras-dist-run -n 2 train.py --epochs 3
      2 processes of train.py (its arguments after the script's name)
  keras-dist-run -n 2 -m package.train --epochs 3
      2 processes of `python -m package.train`
  keras-dist-run -n 2 python -c "import keras_dist as kd; kd.cluster.initialize()"
      any command on PATH (`python`, a console script)
  keras-dist-run -n 2 --devices-per-process 4 train.py
      each process sees 4 virtual CPU devices (8 in the cluster): try a
      multi-host program on a laptop
  keras-dist-run -n 4 --port 12345 train.py
      the coordinator on 127.0.0.1:12345 instead of a free port
  keras-dist-run -n 2 --preemption-grace 120 train.py
      on Ctrl-C or SIGTERM the processes get 120 s to back up and exit
  keras-dist-run -n 2 --evaluator train.py
      one more process with TF_CONFIG task "evaluator" (SidecarEvaluator)
  keras-dist-run -n 2 --max-restarts 3 train.py
      a process that dies or stops answering restarts all of them, up to 3
      times; BackupAndRestore resumes training where it was backed up
"""


def _version() -> str:
    """keras-dist's installed version (no import of keras_dist: no JAX)."""
    from importlib import metadata

    try:
        return metadata.version("keras-dist")
    except metadata.PackageNotFoundError:  # A source tree on sys.path.
        return "unknown (keras-dist is not installed)"


def _number(
    convert: Callable[[str], float], what: str, minimum: float
) -> Callable[[str], float]:
    """An argparse type: `convert(text)`, at least `minimum`."""

    def parse(text: str) -> float:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {what}, received {text!r}"
            ) from None
        if value < minimum:
            raise argparse.ArgumentTypeError(
                f"must be >= {minimum:g}. Received: {value:g}"
            )
        return value

    return parse


def _port(text: str) -> int:
    """A TCP port (1-65535) nothing listens on at 127.0.0.1 yet."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a TCP port number, received {text!r}"
        ) from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(
            f"{port} is not a TCP port: use 1-65535, or leave --port out for a free one"
        )
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        # As a server binds it: a port in TIME_WAIT is free, a listener not.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError as error:
            raise argparse.ArgumentTypeError(
                f"127.0.0.1:{port} cannot be used ({error.strerror or error}): "
                "pick another port, or leave --port out for a free one"
            ) from None
    return port


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="keras-dist-run",
        description="Start N local processes of a Python script as one JAX "
        "cluster (loopback only),\nfor kd.MultiWorkerMirroredStrategy().",
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s (keras-dist {_version()})"
    )
    parser.add_argument(
        "-n",
        "--num-processes",
        type=_number(int, "a whole number", 1),
        required=True,
        metavar="N",
        help="how many processes to start (>= 1); each gets KERAS_DIST_PROCESS_ID "
        "0..N-1",
    )
    parser.add_argument(
        "--devices-per-process",
        type=_number(int, "a whole number", 1),
        default=None,
        metavar="D",
        help="virtual CPU devices per process (XLA_FLAGS); default: leave as is",
    )
    parser.add_argument(
        "--port",
        type=_port,
        default=None,
        help="coordinator port on 127.0.0.1, checked free before any process "
        "starts (default: a free one)",
    )
    parser.add_argument(
        "--preemption-grace",
        type=_number(float, "seconds", 0),
        default=60.0,
        metavar="SECONDS",
        help="after forwarding SIGINT/SIGTERM, seconds the processes get to back "
        "up and exit before SIGKILL (default 60)",
    )
    parser.add_argument(
        "--max-restarts",
        type=_number(int, "a whole number", 0),
        default=0,
        metavar="N",
        help="when a process fails or hangs, stop all and start them again, up "
        "to N times; BackupAndRestore resumes them (default 0). The same "
        "exception at the same step twice in a row is not retried",
    )
    parser.add_argument(
        "--heartbeat-timeout",
        type=_number(float, "seconds", 1),
        default=60.0,
        metavar="SECONDS",
        help="a process whose keras_dist heartbeat (a thread, 4 times a second) "
        "stops this long is frozen: it is killed, the others stopped "
        "(default 60; JAX's own check aborts a peer after about 100)",
    )
    parser.add_argument(
        "--hang-timeout",
        type=_number(float, "seconds", 1),
        default=None,
        metavar="SECONDS",
        help="while fit/evaluate/predict runs, no step on any process for this "
        "long is a hang: the process furthest behind is named and all are "
        "stopped (default: off; set it above your longest compile or save)",
    )
    parser.add_argument(
        "--compilation-cache",
        default=None,
        metavar="DIR",
        help="JAX's persistent compilation cache for the processes, so a "
        "restart does not compile again (default: $JAX_COMPILATION_CACHE_DIR "
        "if set, else ~/.cache/keras-dist-run/jax; 'none': off)",
    )
    parser.add_argument(
        "--goodput",
        default=None,
        metavar="FILE",
        help="write where the wall time went (productive steps, start-up, input, "
        "checkpoints, evaluation, failures) to FILE (a path, or gs://... or "
        "s3://... with gcsfs or s3fs installed) as JSON and print it as a "
        "table at the end (printed after a restart anyway)",
    )
    parser.add_argument(
        "--evaluator",
        action="store_true",
        help="also start one evaluator process (TF_CONFIG task 'evaluator', "
        "outside the JAX cluster), e.g. for kd.callbacks.SidecarEvaluator",
    )
    parser.add_argument(
        "-m",
        "--module",
        action="store_true",
        help="the command is a Python module, run as `python -m MODULE`",
    )
    parser.add_argument(
        "--no-python",
        action="store_true",
        help="run the command as an executable, not with Python (a command "
        "that is no file, e.g. `python` or a console script, runs so anyway)",
    )
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="also relay the collectives' connection lines ([Gloo] ...)",
    )
    parser.add_argument(
        "script",
        metavar="command",
        help="the Python script (or, with -m, module; or executable) to run in "
        "every process",
    )
    parser.add_argument(
        "args",
        nargs=argparse.REMAINDER,
        help="arguments passed to the command (everything after its name)",
    )
    return parser


def _command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list:
    """What every process runs: `python script`, `python -m module`, or an
    executable."""
    if args.module:
        return [sys.executable, "-m", args.script, *args.args]
    is_file = os.path.isfile(args.script)
    script = args.script.endswith(".py") or not os.access(args.script, os.X_OK)
    if is_file and script and not args.no_python:
        return [sys.executable, args.script, *args.args]
    executable = args.script if is_file else shutil.which(args.script)
    if executable is None:
        parser.error(
            f"command not found: {args.script!r} is neither a file nor on PATH. "
            "Give a Python script (train.py), a module with -m (-m package.train), "
            "or an executable (python -c ..., a console script)."
        )
    return [executable, *args.args]


def _environment(
    rank: int | None,
    n: int,
    port: int,
    devices: int | None,
    state: str,
    cache: str | None = None,
) -> dict:
    """A worker's variables, or (`rank=None`) the evaluator's TF_CONFIG."""
    env = dict(os.environ)
    env["KERAS_DIST_RUN_STATE"] = state  # Where it says it is joining, joined.
    for name in ("TF_CONFIG", "SLURM_PROCID", "SLURM_NTASKS", *_LAUNCHER_VARS):
        env.pop(name, None)  # The launcher's cluster wins.
    env["PYTHONUNBUFFERED"] = "1"
    # The processes run keras_dist, so Keras on JAX, even if the script
    # imports Keras before keras_dist (as `python -m keras_dist.launch` gave
    # them: importing keras_dist set it); a backend the user set is kept
    # (keras_dist then says it needs JAX).
    env.setdefault("KERAS_BACKEND", "jax")
    if cache is not None:
        env["JAX_COMPILATION_CACHE_DIR"] = cache
        # Every program: a restart would compile the small ones again too.
        env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    if rank is None:
        # Only worker 0's address is real (the coordinator); the others just
        # have to be distinct: the evaluator connects to none of them.
        workers = [f"127.0.0.1:{port + i}" for i in range(n)]
        cluster = {"worker": workers, "evaluator": [f"127.0.0.1:{port + n}"]}
        task = {"type": "evaluator", "index": 0}
        env["TF_CONFIG"] = json.dumps({"cluster": cluster, "task": task})
    else:
        env.update(
            KERAS_DIST_COORDINATOR=f"127.0.0.1:{port}",
            KERAS_DIST_NUM_PROCESSES=str(n),
            KERAS_DIST_PROCESS_ID=str(rank),
        )
    if devices is not None:
        flags = [
            f
            for f in env.get("XLA_FLAGS", "").split()
            if "xla_force_host_platform_device_count" not in f
        ]
        flags.append(f"--xla_force_host_platform_device_count={devices}")
        env["XLA_FLAGS"] = " ".join(flags)
    return env


# Gloo's report of each connection it makes ("[Gloo] Rank 1 is connected to
# 7 peer ranks. Expected number of connected peer ranks is : 7"), a line per
# peer and context, written piece by piece by several threads at once: the
# pieces below and the counts arrive whole but interleaved, lines cut and run
# together ("[Gloo] Rank 2Expected number of ... is :  is connected to 77"),
# and a count can end up on a line of its own, after a line of pieces.
_GLOO_PIECES = re.compile(
    r"\[Gloo\] Rank | is connected to | peer ranks\. "
    r"|Expected number of connected peer ranks is : "
)


def _chatter(line: str, after_chatter: bool = False) -> bool:
    """Whether `line` holds only pieces of Gloo's connection reports and
    counts: at least one piece, or (`after_chatter`: the line before was
    chatter) a count alone."""
    rest, pieces = _GLOO_PIECES.subn("", line)
    rest = "".join(rest.split())
    if not pieces:
        return after_chatter and rest.isdigit()
    return rest == "" or rest.isdigit()


def _pump(rank: "int | str", stream: IO[str], sink: IO[str], verbose: bool) -> None:
    after_chatter = False
    for line in iter(stream.readline, ""):
        after_chatter = not verbose and _chatter(line, after_chatter)
        if not after_chatter:
            sink.write(f"[{rank}] {line}")
            sink.flush()
    stream.close()


class _Cluster:
    """One start of the processes (an attempt: `--max-restarts` starts more)."""

    def __init__(self, args: argparse.Namespace, state: str, port: int) -> None:
        self.n = args.num_processes
        # Where each process says it is joining the cluster, then joined
        # (`kd.cluster.initialize`), and its heartbeat (`_health.py`).
        self.state = state
        self.watch = Watch(state, self.n, args.heartbeat_timeout, args.hang_timeout)
        self.alone: set[int] = set()  # Ended (status 0) without joining.
        command = args.command
        self.processes: list[subprocess.Popen] = []
        self.pumps: list[threading.Thread] = []
        ranks = [*range(self.n), *([None] if args.evaluator else [])]
        for rank in ranks:
            process = subprocess.Popen(
                command,
                env=_environment(
                    rank,
                    self.n,
                    port,
                    args.devices_per_process,
                    self.state,
                    args.compilation_cache,
                ),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,  # Its own group: we stop all it spawns.
            )
            self.processes.append(process)
            label = "evaluator" if rank is None else rank
            for stream, sink in (
                (process.stdout, sys.stdout),
                (process.stderr, sys.stderr),
            ):
                pump = threading.Thread(
                    target=_pump, args=(label, stream, sink, args.verbose), daemon=True
                )
                pump.start()
                self.pumps.append(pump)
        self.workers = self.processes[: self.n]
        self.evaluator = self.processes[self.n] if args.evaluator else None
        self.interrupted: int | None = None
        self.preemption_grace = args.preemption_grace

    def kill(self, rank: int) -> None:
        """SIGKILL to a worker's process group (a stopped process too)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.workers[rank].pid, signal.SIGKILL)

    def signal_all(self, signum: int) -> None:
        for process in self.processes:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signum)

    def stop(self, signum: int = signal.SIGTERM, grace: float = GRACE_SECONDS) -> None:
        """Signals everyone still running, then SIGKILL after `grace` seconds."""
        self.signal_all(signum)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(
            p.poll() is None for p in self.processes
        ):
            time.sleep(POLL_SECONDS)
        self.signal_all(signal.SIGKILL)
        for process in self.processes:
            process.wait(timeout=10)

    def run(self) -> "int | Failure":
        """Until the workers end: an exit status, or the `Failure` that
        stopped them (a worker failed or hung; the others stopped)."""
        evaluator_reported = False
        while True:
            if self.interrupted is not None:
                # A preemption: let every process back up (BackupAndRestore
                # agrees on a step through JAX's preemption service) and exit.
                self.stop(self.interrupted, self.preemption_grace)
                return 128 + self.interrupted
            codes = [p.poll() for p in self.workers]
            failed = [(rank, c) for rank, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                return self._stop_after_failure(failed)
            running = [rank for rank, c in enumerate(codes) if c is None]
            hung = self.watch.hung(running)
            if hung is not None:
                self.kill(hung.rank)  # Frozen: it would not see a SIGTERM.
                return self._stop(hung)
            waited_for = self._ended_alone(codes)
            if waited_for is not None:
                return waited_for
            evaluator = self.evaluator.poll() if self.evaluator else 0
            if evaluator not in (None, 0) and not evaluator_reported:
                print(
                    f"keras-dist-run: the evaluator {_how(evaluator)}; training "
                    "goes on.",
                    file=sys.stderr,
                    flush=True,
                )
                evaluator_reported = True
            if all(c == 0 for c in codes) and evaluator is not None:
                return evaluator if evaluator >= 0 else 128 - evaluator
            time.sleep(POLL_SECONDS)

    def _said(self, stage: str, rank: int) -> bool:
        return os.path.exists(os.path.join(self.state, f"{stage}_{rank}"))

    def _ended_alone(self, codes: list) -> int | None:
        """Names a worker that ended (status 0) without joining the cluster;
        if others wait for it in `kd.cluster.initialize`, stops them and
        returns 1, else None (they run on, alone too)."""
        if self.n == 1:
            return None
        for rank, code in enumerate(codes):
            if code == 0 and rank not in self.alone and not self._said("joined", rank):
                self.alone.add(rank)
                print(
                    f"keras-dist-run: process {rank} finished without joining the "
                    f"cluster: it ran alone, a one-process program, not process "
                    f"{rank} of {self.n}. A program joins through "
                    "`kd.MultiWorkerMirroredStrategy()` or "
                    "`kd.cluster.initialize()` (a `MirroredStrategy` uses its own "
                    "process's devices only).",
                    file=sys.stderr,
                    flush=True,
                )
        waiting = [
            rank
            for rank, code in enumerate(codes)
            if code is None
            and self._said("joining", rank)
            and not self._said("joined", rank)
        ]
        if not self.alone or not waiting:
            return None
        running = sum(p.poll() is None for p in self.processes)
        print(
            f"keras-dist-run: process {_listed(waiting)} "
            f"{'waits' if len(waiting) == 1 else 'wait'} to join the cluster with "
            f"process {_listed(sorted(self.alone))}, which finished without "
            f"joining it; stopping the other {running}.",
            file=sys.stderr,
            flush=True,
        )
        self.stop()
        return 1

    def _stop_after_failure(self, failed: list) -> Failure:
        # A process killed by a signal is the cause, else the first to fail
        # of its own error, not one that lost a peer (it exits 75): peers
        # that fail at the same time usually fail because one vanished.
        records = {rank: failure_record(self.state, rank) for rank, _ in failed}

        def first(failure: tuple) -> tuple:
            record = records[failure[0]] or {}
            lost = failure[1] == RESTART_EXIT_CODE or record.get("lost_a_peer")
            return (failure[1] > 0, bool(lost), record.get("time", float("inf")))

        rank, code = min(failed, key=first)
        before = "" if self._said("joined", rank) or self.n == 1 else " before joining"
        record = records[rank]
        status = code if code > 0 else 128 - code
        if record is not None:  # An uncaught exception: its type, message, step.
            error = f"{record.get('type')}: {record.get('message')}"
            if record.get("where"):
                error += f" ({record['where']})"
            lost = record.get("lost_a_peer")
            how = "lost a peer" if lost else "failed"
            step = record.get("step")
            # A lost peer is no bug of the program: never "the same error again".
            same = None if lost else (record.get("type"), record.get("message"), step)
            return self._stop(
                Failure(
                    rank,
                    f"process {rank} {how}{at_step(step)} with {error}",
                    status,
                    same,
                )
            )
        step = at_step(self.watch.step(rank))
        line = f"process {rank} {_how(code)}{step}{before}"
        return self._stop(Failure(rank, line, status))

    def _stop(self, failure: Failure) -> Failure:
        running = sum(
            p.poll() is None
            for p in self.processes
            if p is not self.workers[failure.rank]
        )
        others = f"stopping the other {running}" if running else "no other was running"
        print(
            f"keras-dist-run: {failure.line}; {others}.",
            file=sys.stderr,
            flush=True,
        )
        self.stop()
        return failure


def _listed(ranks: list[int]) -> str:
    return (
        ", ".join(map(str, ranks[:-1]))
        + (" and " if ranks[:-1] else "")
        + str(ranks[-1])
    )


def _how(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with status {code}"


def main(argv: Sequence[str] | None = None) -> int:
    """Runs `keras-dist-run` with `argv` (default `sys.argv[1:]`): its exit status.

    Example:

    ```python
    from keras_dist.launch import main

    exit_code = main(["-n", "2", "--devices-per-process", "4", "train.py"])
    ```
    """
    parser = _parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:  # Nothing at all: the whole help, examples included.
        parser.print_help(sys.stderr)
        return 2
    args = parser.parse_args(argv)
    args.command = _command(args, parser)
    args.compilation_cache = _compilation_cache(args.compilation_cache)
    _check_goodput(args.goodput, parser)
    interrupted: dict = {}
    cluster: _Cluster | None = None

    def forward(signum: int, frame: FrameType | None) -> None:
        interrupted["signal"] = signum
        if cluster is not None:
            cluster.interrupted = signum

    previous_handlers = {
        s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)
    }
    previous: Failure | None = None
    attempts: list[Attempt] = []
    try:
        for restart in range(args.max_restarts + 1):
            state = tempfile.mkdtemp(prefix="keras-dist-run-")
            started = time.time()
            try:
                cluster = _Cluster(args, state, args.port or free_port())
                cluster.interrupted = interrupted.get("signal")
                outcome = cluster.run()
                chief = cluster.watch.beats().get(0, (0.0, None))[1]
                failed = isinstance(outcome, Failure)
                attempts.append(Attempt(started, time.time(), chief, failed))
            finally:
                if cluster is not None:
                    for pump in cluster.pumps:
                        pump.join(timeout=5)
                shutil.rmtree(state, ignore_errors=True)
            if not isinstance(outcome, Failure):
                _goodput_report(args, attempts)
                return outcome
            again = previous is not None and outcome.signature is not None
            if again and outcome.signature == previous.signature:  # type: ignore[union-attr]
                _goodput_report(args, attempts)
                _last_word(
                    f"{outcome.line}, as before the restart: a restart does not "
                    f"fix it; exiting with status {outcome.code}."
                )
                return outcome.code
            if restart == args.max_restarts or "signal" in interrupted:
                _goodput_report(args, attempts)
                left = " (no restarts left)" if args.max_restarts else ""
                _last_word(f"{outcome.line}; exiting with status {outcome.code}{left}.")
                return outcome.code
            _last_word(
                f"{outcome.line}; restarting all {args.num_processes} (restart "
                f"{restart + 1} of {args.max_restarts})."
            )
            previous = outcome
        raise AssertionError("unreachable")
    finally:
        for s, handler in previous_handlers.items():
            signal.signal(s, handler)


# The URL schemes `--goodput` writes: the package that serves each, and
# keras_dist's extra that brings it.
_BUCKETS = {"gs": ("gcsfs", "gcs"), "s3": ("s3fs", "s3")}


def _check_goodput(path: str | None, parser: argparse.ArgumentParser) -> None:
    """A `--goodput` URL is one a library installed here writes (checked
    before the processes start, not when the report is due)."""
    if path is None or "://" not in path:
        return
    scheme = path.split("://", 1)[0]
    served = _BUCKETS.get(scheme)
    if served is None:
        parser.error(
            f"--goodput: no library writes {scheme}:// here. Received: "
            f"--goodput {path}. Give a local path, gs://... (gcsfs) or s3://... "
            "(s3fs)."
        )
    import importlib.util

    package, extra = served
    if importlib.util.find_spec(package) is None:
        parser.error(
            f"--goodput {path} needs `{package}`, which is not installed: "
            f"`pip install {package}` (keras_dist's `{extra}` extra), or give "
            "a local path."
        )


def _write_report(path: str, text: str) -> None:
    """`text` to `path`: a local file, or a bucket's object (one upload,
    through etils.epath's fsspec backend, as keras_dist's checkpoints)."""
    if "://" in path:
        from etils.epath import backend

        with backend.fsspec_backend.open(path, "w") as f:
            f.write(text)
        return
    with open(path, "w") as f:
        f.write(text)


def _goodput_report(args: argparse.Namespace, attempts: list[Attempt]) -> None:
    """Where the wall time went (`_goodput.py`): as JSON to `--goodput`, and
    as a table when asked for or after a restart, if anything trained."""
    result = account(attempts)
    if args.goodput:
        _write_report(args.goodput, json.dumps(result, indent=1))
    if any(row["steps"] for row in result["attempts"]) and (
        args.goodput or len(attempts) > 1
    ):
        print(table(result), file=sys.stderr, flush=True)


def _last_word(line: str) -> None:
    """What the launcher says once every process has stopped and its output
    is relayed: the last line a user reads, not a survivor's traceback."""
    print(f"keras-dist-run: {line}", file=sys.stderr, flush=True)


def _compilation_cache(option: str | None) -> str | None:
    """The processes' JAX compilation cache folder (None: leave as is)."""
    if option is not None:
        return None if option.lower() == "none" else os.path.abspath(option)
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return None  # The user's, inherited.
    root = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(root, "keras-dist-run", "jax")


if __name__ == "__main__":
    sys.exit(main())
