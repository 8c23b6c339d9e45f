"""Faults injected under `keras-dist-run --max-restarts`: exact finish, restart time.

Each trial launches `tests/cluster/fault_script.py` (`_workload.backup_run`:
3 epochs of 7 steps, a `BackupAndRestore` backup every 3 steps) as a real
cluster with `--max-restarts 3 --heartbeat-timeout 5`, and injects one fault
at a random global step (seeded): SIGKILL of a random worker, SIGKILL of the
chief, or SIGSTOP of a random process. A trial passes when the launcher
exits 0 after exactly one restart and every process's final state equals
bit for bit that of an uninterrupted run on as many processes (launched
first, no fault): its weights, its optimizer's variables (the step count,
Adam's moments) and the last epoch's loss and metrics as `fit` reports them
(`fault_script.py` writes them). It also times the restart: from the fault
(the faulty process writes the time before it kills or stops itself) to the
first training step after the resume (the chief's `step N` line), with JAX's
compilation cache on (the launcher's default, emptied before each trial, filled by the
trial's first run) and off (`--compilation-cache none`). And the goodput
(`--goodput`) of the uninterrupted run and of one run whose worker is
SIGKILLed at `--failures` random steps (3 restarts).

`--local K`: backups at each epoch's end and `BackupAndRestore`'s local
tier every K steps instead (`local_dir`); each trial's work lost (the
launcher's goodput `lost_steps`: steps redone after the resume) is
reported beside, against K. Writes `restarts_local.{json,md}` then.

Writes `--out/restarts.json` and `.md`.

    python benchmarks/restarts.py --trials 10 --processes 2 4
    python benchmarks/restarts.py --trials 3 --processes 2   # a quick look
    python benchmarks/restarts.py --trials 5 --processes 2 --local 2 --failures 0
"""

import argparse
import datetime
import json
import os
import pathlib
import platform
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("KERAS_BACKEND", "jax")

KINDS = ("kill-worker", "kill-chief", "stop")
STEPS = 21  # 3 epochs of 7 steps.


def _trial(
    workdir: pathlib.Path,
    n: int,
    kind: str,
    rank: int,
    step: "int | str",
    cache: bool,
    local: "int | None" = None,
):
    """One launch; `kind` "none": no fault; `step` "a,b,c": a SIGKILL at each;
    `local`: a local tier every that many steps."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KD_", "XLA_"))}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    env.update(
        TF_CPP_MIN_LOG_LEVEL="3",
        KD_FAULT="stop" if kind == "stop" else "kill",
        KD_STEP_SECONDS="0.1",  # A step long enough to be seen by a heartbeat.
    )
    if kind != "none":
        env.update(KD_KILL_RANK=str(rank), KD_KILL_AT=str(step))
    if local is not None:
        env.update(KD_LOCAL=str(local))
    cache_dir = workdir / "jax-cache"
    command = [
        sys.executable,
        "-m",
        "keras_dist_run",
        "-n",
        str(n),
        "--devices-per-process",
        "1",
        "--max-restarts",
        "3",
        "--heartbeat-timeout",
        "5",
        "--compilation-cache",
        str(cache_dir) if cache else "none",
        "--goodput",
        str(workdir / "goodput.json"),
        str(ROOT / "tests" / "cluster" / "fault_script.py"),
        str(workdir),
    ]
    start = time.time()
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    stamped = []
    assert process.stdout is not None
    for line in process.stdout:  # Every line, with the time it arrived.
        stamped.append((time.time(), line.rstrip("\n")))
    code = process.wait(timeout=900)
    restarted = [t for t, line in stamped if "restarting all" in line]
    fault = (
        float((workdir / "killed").read_text())
        if (workdir / "killed").exists()
        else None
    )
    resumed = None
    if restarted:
        resumed = next(
            (
                t
                for t, line in stamped
                if t > restarted[0] and re.match(r"\[0\] step \d+", line)
            ),
            None,
        )
    causes = [line for _, line in stamped if line.startswith("keras-dist-run:")]
    return {
        "code": code,
        "restarts": len(restarted),
        "causes": causes,
        "seconds": round(time.time() - start, 1),
        "fault_to_step": None
        if fault is None or resumed is None
        else round(resumed - fault, 2),
        "tail": [line for _, line in stamped[-5:]],
        "goodput": json.loads((workdir / "goodput.json").read_text())
        if (workdir / "goodput.json").exists()
        else None,
    }


def _state(workdir: pathlib.Path, n: int) -> dict | None:
    """Every process's final state (None: one wrote none): its weights, its
    optimizer's variables and the last epoch's logs; they must agree."""
    found = []
    for rank in range(n):
        weights, rest = workdir / f"weights_{rank}.json", workdir / f"state_{rank}.json"
        if not (weights.exists() and rest.exists()):
            return None
        found.append({"weights": json.loads(weights.read_text())})
        found[-1].update(json.loads(rest.read_text()))
    assert all(s == found[0] for s in found), "the processes' final states differ"
    return found[0]


PARTS = ("weights", "optimizer", "last_epoch")


def _exact(workdir: pathlib.Path, n: int, reference: dict) -> dict | None:
    """Which parts of the final state are bit for bit the uninterrupted run's
    at the same size: weights, optimizer variables, the last epoch's loss and
    metrics (None: a process wrote none)."""
    state = _state(workdir, n)
    if state is None:
        return None
    return {part: state[part] == reference[part] for part in PARTS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--trials", type=int, default=10, help="per fault kind and size"
    )
    parser.add_argument("--processes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--failures", type=int, default=3, help="SIGKILLs in the goodput run"
    )
    parser.add_argument("--out", default=str(HERE / "results"))
    parser.add_argument(
        "--local", type=int, default=None, help="a local tier every K steps"
    )
    args = parser.parse_args()

    draw = random.Random(args.seed)
    rows, goodput = [], {}
    for n in args.processes:
        # The uninterrupted run at this size: the reference, bit for bit.
        workdir = pathlib.Path(tempfile.mkdtemp(prefix="kd-restarts-"))
        try:
            clean = _trial(workdir, n, "none", 0, 0, True, args.local)
            reference = _state(workdir, n)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        assert clean["code"] == 0 and reference is not None, clean["tail"]
        goodput[f"{n} processes, no failure"] = clean["goodput"]
        for kind in KINDS:
            for trial in range(args.trials):
                rank = (
                    0
                    if kind == "kill-chief"
                    else draw.randrange(1 if kind == "kill-worker" else 0, n)
                )
                step = draw.randint(2, STEPS - 2)
                cache = trial % 2 == 0  # Every other trial without the cache.
                workdir = pathlib.Path(tempfile.mkdtemp(prefix="kd-restarts-"))
                try:
                    row = _trial(workdir, n, kind, rank, step, cache, args.local)
                    try:
                        parts = _exact(workdir, n, reference)
                    except AssertionError as error:
                        parts, row["mismatch"] = None, str(error)[:300]
                    row["exact_parts"] = parts
                    row["exact"] = parts is not None and all(parts.values())
                finally:
                    shutil.rmtree(workdir, ignore_errors=True)
                row.update(processes=n, kind=kind, rank=rank, step=step, cache=cache)
                row["passed"] = (
                    row["code"] == 0 and row["restarts"] == 1 and bool(row["exact"])
                )
                report = row.pop("goodput") or {}
                row["lost_steps"] = report.get("lost_steps")
                print(
                    f"{n} processes, {kind} of {rank} at step {step}, cache {cache}: "
                    f"{'PASS' if row['passed'] else 'FAIL'} (exit {row['code']}, "
                    f"{row['restarts']} restart(s), "
                    f"fault to step {row['fault_to_step']} s)",
                    flush=True,
                )
                rows.append(row)
        if args.failures:  # One run, a worker killed at several steps.
            steps = sorted(draw.sample(range(2, STEPS - 1), args.failures))
            workdir = pathlib.Path(tempfile.mkdtemp(prefix="kd-restarts-"))
            try:
                at = ",".join(map(str, steps))
                row = _trial(workdir, n, "kill-worker", n - 1, at, True, args.local)
                exact = _exact(workdir, n, reference)
            finally:
                shutil.rmtree(workdir, ignore_errors=True)
            assert row["code"] == 0 and exact and all(exact.values()), row["tail"]
            label = f"{n} processes, {args.failures} failures (steps {at})"
            goodput[label] = row["goodput"]
    payload = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, cpu x 1 a process",
        "command": "python benchmarks/restarts.py " + " ".join(sys.argv[1:]),
        "local_save_freq": args.local,
        "trials": rows,
        "goodput": goodput,
    }
    _write(pathlib.Path(args.out), payload)


def _median(values: list) -> str:
    values = [v for v in values if v is not None]
    return f"{statistics.median(values):.1f}" if values else "n/a"


def _write(folder: pathlib.Path, payload: dict) -> None:
    rows = payload["trials"]
    lines = [
        "# Restarts under injected faults",
        "",
        f"{payload['date']}, {payload['machine']}: `{payload['command']}`",
        "",
        "| processes | fault | trials | finished after 1 restart, bit for bit "
        "(weights, optimizer, last epoch's metrics) "
        "| fault to first step, cache on (median s) | cache off (median s) "
        "| steps lost (median, max) |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    if payload.get("local_save_freq"):
        lines[2:2] = [
            f"Backups at each epoch's end (7 steps) and a local tier every "
            f"{payload['local_save_freq']} steps (`BackupAndRestore(local_dir=...)`).",
            "",
        ]
    for n in sorted({r["processes"] for r in rows}):
        for kind in KINDS:
            group = [r for r in rows if r["processes"] == n and r["kind"] == kind]
            if not group:
                continue
            on = [r["fault_to_step"] for r in group if r["cache"]]
            off = [r["fault_to_step"] for r in group if not r["cache"]]
            passed = sum(r["passed"] for r in group)
            lost = [r.get("lost_steps") for r in group]
            lost = [v for v in lost if v is not None]
            spread = f"{statistics.median(lost):g}, {max(lost)}" if lost else "n/a"
            lines.append(
                f"| {n} | {kind} | {len(group)} | {passed} "
                f"| {_median(on)} | {_median(off)} | {spread} |"
            )
    lines += [
        "",
        "Goodput (`keras-dist-run --goodput`): seconds of the wall time in each "
        "bucket, cache on.",
        "",
        "| run | wall | goodput | productive | start-up | input | checkpoint "
        "| evaluation | failures | other | steps lost |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, report in payload["goodput"].items():
        b = report["seconds"]
        lines.append(
            f"| {label} | {report['wall_s']:.1f} | {100 * report['goodput']:.1f}% "
            + "".join(
                f"| {b[k]:.1f} "
                for k in ("productive", "startup", "input", "checkpoint")
            )
            + f"| {b['evaluation']:.1f} | {b['failures']:.1f} | {b['other']:.1f} "
            f"| {report['lost_steps']} |"
        )
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    folder.mkdir(parents=True, exist_ok=True)
    name = "restarts_local" if payload.get("local_save_freq") else "restarts"
    (folder / f"{name}.json").write_text(json.dumps(payload, indent=1) + "\n")
    (folder / f"{name}.md").write_text(text)
    print(f"wrote {folder / name}.json and .md")


if __name__ == "__main__":
    main()
