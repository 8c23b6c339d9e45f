"""What the benchmarks share: one configuration in a fresh process, its timings.

A benchmark script (`single_vs_mirrored.py`, `memory.py`) starts each
configuration as a worker script in its own process (no compilation cache,
no state carried from the previous one); the worker prints one line
`RESULT {json}` with `ms_per_step`, the ms/step of each timed epoch.
`combine_runs` merges several fresh processes of one configuration.

A smoke run (`--shared-process`: the test suite's) runs the configurations
of each job slot one after another in one long-lived process instead
(`_host.py`): the same worker code and rows, without starting Python, JAX
and Keras for each; its timings are not figures (say so: `SHARED_PROCESS`).
"""

import atexit
import json
import os
import pathlib
import platform
import queue
import re
import statistics
import subprocess
import sys
import tempfile
import threading

PLATFORM_ENV = "KD_BENCH_PLATFORM"
SHARED_PROCESS = "configurations sharing a process (--shared-process)"
_HOST = pathlib.Path(__file__).resolve().parent / "_host.py"
_sharing = {"on": False}
_hosts = threading.local()  # Each job slot (a pool thread): its own host.
_every_host: list = []


def force_host_devices(count: int = 8) -> str:
    """In a worker, before jax loads: `count` virtual devices on CPU.

    Returns the platform the benchmark runs on (`KD_BENCH_PLATFORM`).
    """
    platform_name = os.environ.get(PLATFORM_ENV, "cpu")
    if platform_name == "cpu":
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            flag = f"--xla_force_host_platform_device_count={count}"
            os.environ["XLA_FLAGS"] = f"{flags} {flag}".strip()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    return platform_name


def print_result(result: dict) -> None:
    """In a worker: the one line the benchmark script reads."""
    print("RESULT " + json.dumps(result), flush=True)


def run_worker(
    script,
    args: list,
    *,
    timeout: float,
    platform_name: str,
    ident: dict,
    processes: int = 1,
    devices: int = 8,
    shared: bool = True,
) -> dict:
    """Runs `script args` in a fresh process; its RESULT, or `ident` + error.

    The row gets the median, min and max of its `ms_per_step`, and the
    median of its `host_cpu_ms_per_step` (when the worker measures it).
    With `processes` > 1 it runs under keras-dist-run (`devices` split over
    them); the row is process 0's, with every process's row in `ranks`.
    With `share_processes()` on, a one-process run that may (`shared`: its
    worker needs no process of its own, as Keras on TensorFlow does) runs
    in this job slot's long-lived process instead.
    """
    launcher = []
    if processes > 1:
        launcher = ["-m", "keras_dist_run", "-n", str(processes)]
        launcher += ["--devices-per-process", str(devices // processes)]
    command = [sys.executable, *launcher, str(script), *(str(a) for a in args)]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env[PLATFORM_ENV] = platform_name
    try:
        if _sharing["on"] and shared and processes == 1:
            done = _in_host(str(script), [str(a) for a in args], env, timeout)
        else:
            done = subprocess.run(
                command, capture_output=True, text=True, timeout=timeout, env=env
            )
    except subprocess.TimeoutExpired:
        return {**ident, "error": "timeout"}
    lines = done.stdout.splitlines()
    found = [re.match(r"(?:\[(\d+)\] )?RESULT (.*)", x) for x in lines]
    results = {int(m[1] or 0): json.loads(m[2]) for m in found if m}
    if done.returncode or 0 not in results:
        return {**ident, "error": failure(done.stderr or done.stdout)}
    row = results[0]
    if processes > 1:
        row["ranks"] = [dict(results[r]) for r in sorted(results)]  # Copies.
    times = row["ms_per_step"]
    row["ms_median"] = statistics.median(times)
    row["ms_min"], row["ms_max"] = min(times), max(times)
    if row.get("host_cpu_ms_per_step"):
        row["host_cpu_ms"] = statistics.median(row["host_cpu_ms_per_step"])
    return row


def indicative_note(payload: dict) -> str:
    """The tables' words for a run whose figures are not to be quoted."""
    why = payload.get("indicative")
    return f" Indicative only: {why}." if why else ""


def share_processes(on: bool = True) -> None:
    """From now on, one-process runs share their job slot's process (or not)."""
    _sharing["on"] = on


def _in_host(script: str, args: list, env: dict, timeout: float):
    """`script args` in this thread's host process (started at its first run)."""
    host = getattr(_hosts, "process", None)
    if host is None or host.poll() is not None:
        # Its C++ logs (XLA's, TensorFlow's): what a crash said, if it dies.
        log = tempfile.TemporaryFile("w+")  # noqa: SIM115 (the host's lifetime)
        host = subprocess.Popen(
            [sys.executable, str(_HOST)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=env,
        )
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=_read, args=(host, lines), daemon=True).start()
        _hosts.process, _hosts.lines, _hosts.log = host, lines, log
        _every_host.append(host)
    try:
        host.stdin.write(json.dumps({"script": script, "args": args}) + "\n")
        host.stdin.flush()
    except BrokenPipeError:  # It died since: its reader says so below.
        pass
    while True:
        try:
            line = _hosts.lines.get(timeout=timeout)
        except queue.Empty:
            host.kill()
            host.wait()  # Gone before the next run asks for a host.
            raise subprocess.TimeoutExpired(script, timeout) from None
        if line is None:  # It died: a crash no Python handler saw.
            code = host.wait()
            _hosts.log.seek(0)
            said = _hosts.log.read()
            return subprocess.CompletedProcess(script, code or 1, "", said)
        if line.startswith("HOST "):
            done = json.loads(line[5:])
            return subprocess.CompletedProcess(
                script, done["returncode"], done["stdout"], done["stderr"]
            )


def _read(host, lines: queue.Queue) -> None:
    for line in host.stdout:
        lines.put(line)
    lines.put(None)


@atexit.register
def _close_hosts() -> None:
    for host in _every_host:
        if host.poll() is None:
            host.stdin.close()  # Its loop ends; it exits.
            try:
                host.wait(timeout=30)
            except subprocess.TimeoutExpired:
                host.kill()


def failure(output: str) -> str:
    """What a crashed worker said: its first fatal log line, else its last lines.

    (XLA aborts with a line `F1125 12:33:32.28 ... rendezvous.cc:161] ...`
    and a C++ stack after it.)
    """
    lines = output.strip().splitlines()
    fatal = [x for x in lines if re.match(r"F\d{4} ", x)]
    return fatal[0] if fatal else " | ".join(lines[-3:])


def combine_runs(runs: list) -> dict:
    """One row from the rows of several fresh processes of one configuration.

    Each process counts as one sample, the median of its timed epochs; the
    row gets `ms_per_step` (one value per completed process, in run order),
    their median, min and max, `failed_runs` (processes that never printed a
    result: left out, and said so in the tables) and `runs` (every process's
    own row), and `host_cpu_ms`, the median of the processes' own. With no
    completed process the row is the first error.
    """
    done = [r for r in runs if "error" not in r]
    if not done:
        return {**runs[0], "failed_runs": len(runs), "runs": runs}
    times = [r["ms_median"] for r in done]
    row = {k: v for k, v in done[0].items() if k not in ("ms_min", "ms_max")}
    row.update(
        ms_per_step=times,
        ms_median=statistics.median(times),
        ms_min=min(times),
        ms_max=max(times),
        first_epoch_s=statistics.median(r["first_epoch_s"] for r in done),
        peak_rss_mb=max(r["peak_rss_mb"] for r in done),
        host_cpu_ms=_median_of(done, "host_cpu_ms"),
        crashed_runs=sum(r.get("crashed_runs", 0) for r in runs),
        crash_errors=[e for r in runs for e in r.get("crash_errors", [])],
        failed_runs=len(runs) - len(done),
        runs=runs,
    )
    return row


def _median_of(rows: list, key: str):
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def machine(platform_name: str, devices: int) -> str:
    """`x86_64, 2 cores, cpu x 8 (virtual devices)`."""
    virtual = " (virtual devices)" if platform_name == "cpu" else ""
    return (
        f"{platform.machine()}, {os.cpu_count()} cores, {platform_name} "
        f"x {devices}{virtual}"
    )


def fmt(value, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def targets_table(targets: list, spec: str = ".2f") -> list[str]:
    """Markdown lines: one row per target, its value (`spec`) and PASS/MISS."""
    out = ["", "| target | value | result |", "|---|---:|---|"]
    for t in targets:
        value = "n/a" if t["value"] is None else format(t["value"], spec)
        verdict = "PASS" if t["pass"] else "MISS"
        out.append(f"| {t['target']} | {value} | {verdict} |")
    return out


def pyplot():
    """matplotlib's pyplot on the Agg backend, or None (with a message)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG (pip install matplotlib)")
        return None
    return plt


def write_results(out: str, stem: str, payload: dict, markdown, plot) -> None:
    """Prints `markdown(payload)`; writes `stem.json`, `.md` and `.png` to `out`."""
    folder = pathlib.Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    text = markdown(payload)
    print("\n" + text)
    (folder / f"{stem}.json").write_text(json.dumps(payload, indent=1) + "\n")
    (folder / f"{stem}.md").write_text(text)
    if plot(payload, folder / f"{stem}.png"):
        print(f"wrote {folder / stem}.png")
    print(f"wrote {folder / stem}.json and .md")


def loss_target(rows: dict, ref: dict | None):
    """The largest relative distance of a final loss from `ref`'s, and its target.

    None (and MISS) unless `ref` and every row completed.
    """
    ok = [r for r in rows.values() if "error" not in r]
    worst = None
    if ref and len(ok) == len(rows):
        worst = max(
            abs(r["final_loss"] - ref["final_loss"]) / abs(ref["final_loss"])
            for r in ok
        )
    return worst, {
        "target": "every final loss = one device's (relative 1e-4)",
        "value": worst,
        "limit": 1e-4,
        "pass": worst is not None and worst <= 1e-4,
    }
