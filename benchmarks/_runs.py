"""What the benchmarks share: one configuration in a fresh process, its timings.

A benchmark script (`single_vs_mirrored.py`, `memory.py`) starts each
configuration as a worker script in its own process (no compilation cache,
no state carried from the previous one); the worker prints one line
`RESULT {json}` with `ms_per_step`, the ms/step of each timed epoch.
`combine_runs` merges several fresh processes of one configuration.
"""

import json
import os
import pathlib
import platform
import re
import statistics
import subprocess
import sys

PLATFORM_ENV = "KD_BENCH_PLATFORM"


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
) -> dict:
    """Runs `script args` in a fresh process; its RESULT, or `ident` + error.

    The row gets the median, min and max of its `ms_per_step`, and the
    median of its `host_cpu_ms_per_step` (when the worker measures it).
    With `processes` > 1 it runs under keras-dist-run (`devices` split over
    them); the row is process 0's, with every process's row in `ranks`.
    """
    launcher = []
    if processes > 1:
        launcher = ["-m", "keras_dist_run", "-n", str(processes)]
        launcher += ["--devices-per-process", str(devices // processes)]
    command = [sys.executable, *launcher, str(script), *(str(a) for a in args)]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env[PLATFORM_ENV] = platform_name
    try:
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
