"""Single device vs mirrored vs the peers vs the hand-written limit.

Trains each model at the same global batch in each configuration
(`benchmarks/_worker.py`), compilation excluded:

    A    Keras fit, one device (OneDeviceStrategy)
    B    keras_dist MirroredStrategy fit, all devices
    B32  B with steps_per_execution=32
    BU   B with keras_dist's pacing off (what the pacer costs; may abort)
    B32U B32 with keras_dist's pacing off
    BH   B on the host path (each batch copied from NumPy during the epoch)
    BH32 BH with steps_per_execution=32
    BN   B with a train_step that does no work: Keras's own per-step floor
    BN32 BN with steps_per_execution=32
    BS   B with shuffle=True, copied to every device (each step gathers its rows)
    BR   BS with the data split over the devices by rows (a budget no copy fits)
    C    keras.distribution.DataParallel, same devices, used as Keras
         documents it: built, compiled and fit inside its scope
    CS   C with shuffle=True (Keras's default)
    C0   the pitfall: the same, but fit outside the scope
    D    tf.distribute.MirroredStrategy + Keras on the TF backend (if installed)
    E    the limit: hand-written jax.jit + optax step, data on device ahead of time
    E32  the limit of 32 steps per dispatch: E's step in a lax.scan of 32 steps
    EK   E with Keras's Adam (stateless_apply): the limit for B's step math
    EK32 E32 with Keras's Adam
    EKU  EK with no bound on the programs in flight (may abort)
    EK32U EK32 with no bound on the programs in flight
    EKH  EK on the host path: each batch copied on a thread, one step ahead
    EKH32 EK32 on the host path: 32 batches a copy, one dispatch ahead
    F    keras_dist custom training loop (strategy.run), same mesh

then B over 1, 2, 4, 8 devices (scaling). Every configuration runs `--repeats`
times, each run a fresh process, in rounds that alternate the configurations
(A B C ... A B C ...); a run's sample is the median ms/step of its timed
epochs; tables show the median and min-max over the runs. Prints tables and
one PASS/MISS line per target (never an exit status), writes JSON, Markdown
and a PNG (matplotlib) to `--out`.

    python benchmarks/single_vs_mirrored.py --quick --repeats 5   # cnn + tiny
    python benchmarks/single_vs_mirrored.py --preset proxy        # host cost, 1 CPU
    python benchmarks/single_vs_mirrored.py --preset gpu          # one GPU, 6 min
    bash benchmarks/gpu_preset.sh run "$OUT"   # the same on a lent machine, one call
    python benchmarks/single_vs_mirrored.py                       # + resnet, scaling
    python benchmarks/single_vs_mirrored.py --platform gpu --devices 4
"""

import argparse
import concurrent.futures
import datetime
import importlib.util
import json
import os
import pathlib
import platform
import sys

from _report_svm import markdown, plot
from _runs import (
    SHARED_PROCESS,
    combine_runs,
    machine,
    run_worker,
    share_processes,
)

HERE = pathlib.Path(__file__).resolve().parent
CONFIGS = ["A", "B", "B32", "BU", "B32U", "BH", "BH32", "BN", "BN32", "BS", "BR"]
CONFIGS += ["C", "CS", "C0", "D", "E", "E32", "EK", "EK32", "EKU", "EK32U"]
CONFIGS += ["EKH", "EKH32", "F"]
BATCH = {"tiny": 256, "cnn": 256, "resnet": 128}
# Steps per epoch: tiny takes ~1-3 ms a step, so it needs more of them to be
# timed at all, and at least 32 for B32's executions of 32 steps.
STEPS = {"quick": {"tiny": 64, "cnn": 6}, "full": {"tiny": 128}}
QUICK_REPEATS, FULL_REPEATS = 3, 5
# A figure to quote: at least 3 runs a configuration and, on an accelerator
# (where a step takes well under a millisecond), epochs of at least 50 steps.
QUOTABLE_REPEATS, QUOTABLE_STEPS = 3, 50
# The host cost of a step against the hand-written loop's: keras_dist's fit on
# the device-resident and the host path, one and 32 steps a dispatch, the
# limits of each, and Keras's own loop's floor (a step doing no work). On one
# CPU device the main thread's CPU time per step stands for an
# accelerator's dispatch ("proxy"); on one GPU the wall time tells ("gpu").
HOST_COST = "B,B32,BH,BH32,BN,BN32,EK,EK32,EKH,EKH32"
PRESETS = {
    "proxy": dict(models="tiny", configs=HOST_COST, devices=1, steps=128, repeats=3),
    # What a GPU figure needs to be quoted: Keras's fit (A), keras_dist's
    # (B, B32), Keras's DataParallel (C) and the hand-written loop (E, E32)
    # beside the host-cost configurations; 3 runs each, 64-step epochs.
    "gpu": dict(
        models="tiny,cnn",
        configs="A,B,B32,C,E,E32,BH,BH32,EK,EK32",
        devices=1,
        platform="gpu",
        steps=64,
        repeats=3,  # 60 fresh processes of ~6 s: about 6 minutes.
        epochs=2,
    ),
}


def _parser():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="cnn + tiny, short runs")
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help="proxy: the host cost of a step on 1 CPU device (3 runs each); "
        "gpu: Keras's fit, DataParallel, keras_dist and the hand-written loop "
        "on one GPU (3 runs each of 64-step epochs, ~6 min)",
    )
    p.add_argument("--models", default=None, help="comma list of tiny,cnn,resnet")
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma list")
    p.add_argument("--steps", type=int, default=None, help="steps per epoch")
    p.add_argument(
        "--epochs", type=int, default=None, help="timed epochs per run (2; full 3)"
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help=f"fresh-process runs per configuration ({FULL_REPEATS}; "
        f"quick {QUICK_REPEATS})",
    )
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--platform", default="cpu", choices=["cpu", "gpu", "tpu"])
    p.add_argument(
        "--scaling",
        default=None,
        help="device counts for B ('' off; default 1,2,4,8, quick: off)",
    )
    p.add_argument("--note", default="", help="free text for the results header")
    p.add_argument("--out", default=str(HERE / "results"))
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="runs at once (>1 only for smoke tests: runs then share the cores)",
    )
    p.add_argument(
        "--shared-process",
        action="store_true",
        help="smoke test: each job slot's runs one after another in one process "
        "(D, on TensorFlow, in its own): the code and rows, no figures",
    )
    return p


def _settings(args) -> None:
    """Fills the defaults that depend on `--quick` and `--preset`, in place."""
    if args.preset:  # Under what the command line says.
        defaults = _parser().parse_args([])
        for key, value in PRESETS[args.preset].items():
            if getattr(args, key) == getattr(defaults, key):
                setattr(args, key, value)
        args.scaling = "" if args.scaling is None else args.scaling
    mode = "quick" if args.quick else "full"
    models = args.models or ("cnn,tiny" if args.quick else "cnn,resnet,tiny")
    args.models = models.split(",")
    args.steps_of = {
        m: args.steps or STEPS[mode].get(m, 8 if args.quick else 50)
        for m in args.models
    }
    args.epochs = args.epochs or (2 if args.quick else 3)
    args.repeats = args.repeats or (QUICK_REPEATS if args.quick else FULL_REPEATS)
    if args.scaling is None:
        args.scaling = "" if args.quick else "1,2,4,8"
    unknown = sorted(set(args.configs.split(",")) - set(CONFIGS))
    if unknown:
        raise SystemExit(
            f"Unknown configuration. Received: --configs {args.configs}. "
            f"Choose from {','.join(CONFIGS)}."
        )
    # D needs TensorFlow; on TPU tf.distribute would need TPUStrategy: skipped.
    has_tf = importlib.util.find_spec("tensorflow") is not None
    args.config_list = [
        c
        for c in CONFIGS
        if c in args.configs.split(",")
        and (c != "D" or (has_tf and args.platform != "tpu"))
    ]


def run_config(config, model, devices, args) -> dict:
    """One fresh-process run; a crashed run is run again, once, and counted.

    (XLA's CPU collectives can abort a run: "Termination timeout for all
    reduce ... of 40 s"; the row keeps what each crash said, `crash_errors`.)
    """
    batch = BATCH[model]
    steps = args.steps_of[model]
    ident = {"config": config, "model": model, "devices": devices}
    crashes = []
    for _ in range(2):
        row = run_worker(
            HERE / "_worker.py",
            [config, model, devices, steps, args.epochs, batch],
            timeout=args.timeout,
            platform_name=args.platform,
            ident=ident,
            shared=config != "D",  # Keras on TensorFlow: KERAS_BACKEND at import.
        )
        if "error" not in row or row["error"] == "timeout":
            break
        crashes.append(row["error"])
    return {**row, "crashed_runs": len(crashes), "crash_errors": crashes}


def _ratio(rows, model, top, bottom, scale=1.0):
    a, b = rows.get((model, top)), rows.get((model, bottom))
    if not a or not b or "error" in a or "error" in b:
        return None
    return a["ms_median"] / (b["ms_median"] * scale)


RATIOS = (("B", "A"), ("B", "C"), ("BS", "CS"), ("B", "C0"), ("B", "D"))
RATIOS += (("B", "E"),)
RATIOS += (("B32", "E"), ("B32", "E32"), ("BS", "B"), ("BR", "BS"), ("F", "E"))
# What keras_dist's fit adds to the step math Keras runs, and what Keras's
# Adam costs against optax's (EK: the hand-written loop with Keras's Adam).
RATIOS += (("B", "EK"), ("B32", "EK32"), ("EK", "E"))
# Against the same-math loops with no bound on the programs in flight, and
# what pacing costs keras_dist (B/BU) and the loop (EK/EKU).
RATIOS += (("B", "EKU"), ("B32", "EK32U"), ("B", "BU"), ("EK", "EKU"))
# The host path against its double-buffered limits.
RATIOS += (("BH", "EKH"), ("BH32", "EKH32"))


def _cpu(rows, model, config):
    """The main thread's CPU ms per step of a row, or None."""
    row = rows.get((model, config))
    return None if not row or "error" in row else row.get("host_cpu_ms")


def _cpu_ratio(rows, model, top, bottoms):
    """CPU per step of `top` over the sum of `bottoms`' (None if one is missing)."""
    values = [_cpu(rows, model, c) for c in (top, *bottoms)]
    if any(v is None for v in values) or not sum(values[1:]):
        return None
    return values[0] / sum(values[1:])


# (name, measure, top, bottoms, limit): `measure` "cpu" (the main thread's
# CPU per step) or "wall" (ms per step); the target holds when top / sum of
# bottoms <= limit.
TARGETS = [
    ("keras_dist fit <= the hand-written limit", "wall", "B", ("E",), 1.0),
    ("keras_dist fit <= Keras DataParallel", "wall", "B", ("C",), 1.0),
    (
        "keras_dist fit <= Keras DataParallel, shuffle=True",
        "wall",
        "BS",
        ("CS",),
        1.0,
    ),
    (
        "host CPU, steps_per_execution=32, on device <= 1.2x the loop's",
        "cpu",
        "B32",
        ("EK32",),
        1.2,
    ),
    (
        "host CPU, steps_per_execution=32, host path <= 1.2x the loop's",
        "cpu",
        "BH32",
        ("EKH32",),
        1.2,
    ),
    (
        "steps_per_execution=32, host path <= 1.2x the double-buffered loop",
        "wall",
        "BH32",
        ("EKH32",),
        1.2,
    ),
    (
        "host CPU, on device <= 1.2x the loop's step + Keras's loop's floor",
        "cpu",
        "B",
        ("EK", "BN"),
        1.2,
    ),
    (
        "host CPU, host path <= 1.2x the loop's step + Keras's loop's floor",
        "cpu",
        "BH",
        ("EKH", "BN"),
        1.2,
    ),
]


def targets(rows: dict, models) -> list:
    """The targets whose rows were measured: name, value, limit, pass."""
    out = []
    for model in models:
        for name, measure, top, bottoms, limit in TARGETS:
            if any((model, c) not in rows for c in (top, *bottoms)):
                continue
            if measure == "cpu":
                value = _cpu_ratio(rows, model, top, bottoms)
            else:
                value = _ratio(rows, model, top, bottoms[0])
            label = f"{top}/{'+'.join(bottoms)} <= {limit:g}"
            out.append(
                {
                    "target": f"{model}: {name} ({label})",
                    "value": value,
                    "limit": limit,
                    "pass": value is not None and value <= limit,
                }
            )
    return out


def analyse(rows: dict, scaling: list, models) -> dict:
    ratios = {
        model: {f"{x}/{y}": _ratio(rows, model, x, y) for x, y in RATIOS}
        for model in models
    }
    curve = {r["devices"]: r["ms_median"] for r in scaling if "error" not in r}
    efficiency = {
        n: (curve[1] / ms) / n if 1 in curve else None for n, ms in curve.items()
    }
    return {
        "ratios": ratios,
        "scaling": curve,
        "efficiency": efficiency,
        "targets": targets(rows, models),
    }


def _run_all(args, jobs) -> dict:
    """Every job `repeats` times, in rounds: A B C ... A B C ...; job -> runs."""
    runs = {job: [] for job in jobs}
    order = [job for _ in range(args.repeats) for job in jobs]
    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
        futures = [(job, pool.submit(run_config, *job, args)) for job in order]
        for i, (job, future) in enumerate(futures):
            runs[job].append(future.result())
            print(f"[{i + 1}/{len(order)}] " + _line(runs[job][-1]), flush=True)
    return {job: combine_runs(r) for job, r in runs.items()}


def _indicative(args) -> "str | None":
    """Why this run's figures are not to be quoted, or None."""
    why = [SHARED_PROCESS] if args.shared_process else []
    if args.repeats < QUOTABLE_REPEATS:
        why.append(f"{args.repeats} runs per configuration (< {QUOTABLE_REPEATS})")
    short = [
        f"{m} {args.steps_of[m]}"
        for m in args.models
        if args.platform != "cpu" and args.steps_of[m] < QUOTABLE_STEPS
    ]
    if short:
        why.append(
            f"steps per epoch on {args.platform} {', '.join(short)} "
            f"(< {QUOTABLE_STEPS})"
        )
    return "; ".join(why) or None


def main(argv=None) -> dict:
    args = _parser().parse_args(argv)
    _settings(args)
    models, configs = args.models, args.config_list
    indicative = _indicative(args)
    if args.shared_process:
        share_processes()
    if indicative:
        print(f"{indicative}: indicative only, not figures to quote.")
    scaling_model = "cnn" if "cnn" in models else models[0]
    jobs = [
        (c, m, args.devices)
        for m in models
        for c in configs
        if not (c[0] == "E" and "32" in c) or args.steps_of[m] % 32 == 0
    ]
    counts = [int(v) for v in args.scaling.split(",") if v]
    jobs += [("B", scaling_model, n) for n in counts if n != args.devices]
    load = os.getloadavg()[0]
    start = datetime.datetime.now(datetime.UTC)
    results = _run_all(args, jobs)
    rows = {
        (m, c): results[(c, m, args.devices)]
        for m in models
        for c in configs
        if (c, m, args.devices) in results
    }
    for row in rows.values():
        if "error" not in row:
            row["steps_per_s"] = 1e3 / row["ms_median"]
            row["examples_per_s"] = BATCH[row["model"]] * row["steps_per_s"]
    scaling = [results[("B", scaling_model, n)] for n in counts]
    payload = {
        "benchmark": "single_vs_mirrored",
        "date": start.strftime("%Y-%m-%d %H:%M UTC"),
        "minutes": (datetime.datetime.now(datetime.UTC) - start)
        / datetime.timedelta(minutes=1),
        "command": "python benchmarks/single_vs_mirrored.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine(args.platform, args.devices),
        "load_average": [load, os.getloadavg()[0]],
        "note": args.note,
        "python": platform.python_version(),
        "quick": args.quick,
        "preset": args.preset,
        "steps": args.steps_of,
        "epochs": args.epochs,
        "repeats": args.repeats,
        "indicative": indicative,
        "models": models,
        "rows": list(rows.values()),
        "scaling_model": scaling_model,
        "scaling_rows": scaling,
    }
    payload["analysis"] = analyse(rows, scaling, models)
    _write(payload, pathlib.Path(args.out))
    return payload


def _write(payload: dict, out: pathlib.Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(payload)
    print("\n" + text)
    for t in payload["analysis"]["targets"]:
        value = "n/a" if t["value"] is None else f"{t['value']:.2f}"
        print(f"{'PASS' if t['pass'] else 'MISS'}  {t['target']}: {value}")
    (out / "single_vs_mirrored.json").write_text(json.dumps(payload, indent=1) + "\n")
    (out / "single_vs_mirrored.md").write_text(text)
    if plot(payload, out / "single_vs_mirrored.png"):
        print(f"wrote {out / 'single_vs_mirrored.png'}")
    print(f"wrote {out / 'single_vs_mirrored.json'} and .md")


def _line(row: dict) -> str:
    head = f"{row['model']:>7} {row['config']:<3} x{row['devices']}"
    if "error" in row:
        return f"{head}: FAILED {row['error']}"
    return f"{head}: {row['ms_median']:8.2f} ms/step"


if __name__ == "__main__":
    main()
