"""Single device vs mirrored vs the peers vs the hand-written limit.

Trains each model at the same global batch in six configurations, each in its
own fresh process (`benchmarks/_worker.py`), compilation excluded, several
timed epochs (median, min-max):

    A  Keras fit, one device (OneDeviceStrategy)
    B  keras_dist MirroredStrategy fit, all devices
    C  Keras 3's keras.distribution.DataParallel fit, same devices
    D  tf.distribute.MirroredStrategy + Keras on the TF backend (if installed)
    E  the limit: hand-written jax.jit + optax step, data on device ahead of time
    F  keras_dist custom training loop (strategy.run), same mesh

then B over 1, 2, 4, 8 devices (scaling). Prints tables and PASS/MISS per
target, writes JSON, Markdown and a PNG (matplotlib) to `--out`.

    python benchmarks/single_vs_mirrored.py --quick          # < 3 min, 2 cores
    python benchmarks/single_vs_mirrored.py                  # full
    python benchmarks/single_vs_mirrored.py --platform gpu --devices 4
"""

import argparse
import concurrent.futures
import datetime
import json
import pathlib
import platform

from _runs import fmt as _fmt
from _runs import machine, run_worker

HERE = pathlib.Path(__file__).resolve().parent
CONFIGS = "ABCDEF"
NAMES = {
    "A": "Keras fit, 1 device",
    "B": "keras_dist MirroredStrategy fit",
    "C": "keras.distribution.DataParallel fit",
    "D": "tf.distribute.MirroredStrategy (TF backend)",
    "E": "hand-written jax.jit + optax (limit)",
    "F": "keras_dist custom loop (strategy.run)",
}
BATCH = {"tiny": 256, "cnn": 256, "resnet": 128}


def _parser():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="cnn + tiny, short runs")
    p.add_argument("--models", default=None, help="comma list of tiny,cnn,resnet")
    p.add_argument("--configs", default=CONFIGS)
    p.add_argument("--steps", type=int, default=None, help="steps per timed epoch")
    p.add_argument("--repeats", type=int, default=None, help="timed epochs")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--platform", default="cpu", choices=["cpu", "gpu", "tpu"])
    p.add_argument(
        "--scaling",
        default=None,
        help="device counts for B ('' off; default 1,2,4,8, quick: off)",
    )
    p.add_argument("--out", default=str(HERE / "results"))
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="runs at once (>1 only for smoke tests: runs then share the cores)",
    )
    return p


def _tf_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("tensorflow") is not None


def run_config(config, model, devices, args) -> dict:
    batch = BATCH[model]
    row = run_worker(
        HERE / "_worker.py",
        [config, model, devices, args.steps, args.repeats, batch],
        timeout=args.timeout,
        platform_name=args.platform,
        ident={"config": config, "model": model, "devices": devices},
    )
    if "error" not in row:
        row["steps_per_s"] = 1e3 / row["ms_median"]
        row["examples_per_s"] = batch * row["steps_per_s"]
    return row


def _ratio(rows, model, top, bottom):
    a, b = rows.get((model, top)), rows.get((model, bottom))
    if not a or not b or "error" in a or "error" in b:
        return None
    return a["ms_median"] / b["ms_median"]


def analyse(rows: dict, scaling: list, models) -> dict:
    ratios = {
        model: {
            f"{x}/{y}": _ratio(rows, model, x, y)
            for x, y in (("B", "A"), ("B", "C"), ("B", "D"), ("B", "E"), ("F", "E"))
        }
        for model in models
    }
    curve = {r["devices"]: r["ms_median"] for r in scaling if "error" not in r}
    efficiency = {
        n: (curve[1] / ms) / n if 1 in curve else None for n, ms in curve.items()
    }

    def target(name, value, limit, lower_is_better=True):
        ok = value is not None and (
            value <= limit if lower_is_better else value >= limit
        )
        return {"target": name, "value": value, "limit": limit, "pass": ok}

    cnn, tiny = ratios.get("cnn", {}), rows.get(("tiny", "B"))
    targets = [
        target("cnn B/E ms/step <= 1.05", cnn.get("B/E"), 1.05),
        target("cnn B/C ms/step <= 1.00 (B <= C)", cnn.get("B/C"), 1.0),
        target("cnn B/A ms/step <= 1.10", cnn.get("B/A"), 1.10),
        target(
            "cnn D/B >= 3 (B 3x faster than tf.distribute)",
            1 / cnn["B/D"] if cnn.get("B/D") else None,
            3.0,
            lower_is_better=False,
        ),
        target(
            "tiny B ms/step <= 1.5",
            tiny["ms_median"] if tiny and "error" not in tiny else None,
            1.5,
        ),
    ]
    return {
        "ratios": ratios,
        "scaling": curve,
        "efficiency": efficiency,
        "targets": targets,
    }


def markdown(payload: dict) -> str:
    out = [
        f"Measured {payload['date']} on {payload['machine']}; "
        f"{payload['steps']} steps x {payload['repeats']} timed epochs per config.",
        "",
        "| model | config | ms/step (median) | min-max | steps/s | examples/s "
        "| peak RSS MB |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in payload["rows"]:
        name = f"{r['config']} {NAMES[r['config']]}"
        if "error" in r:
            out.append(f"| {r['model']} | {name} | failed: {r['error']} | | | | |")
            continue
        out.append(
            f"| {r['model']} | {name} | {r['ms_median']:.2f} | "
            f"{r['ms_min']:.2f}-{r['ms_max']:.2f} | {r['steps_per_s']:.1f} | "
            f"{r['examples_per_s']:.0f} | {r['peak_rss_mb']:.0f} |"
        )
    out += [
        "",
        "| model | B/A | B/C | B/D | B/E | F/E |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for model, ratios in payload["analysis"]["ratios"].items():
        out.append(
            f"| {model} | " + " | ".join(_fmt(v) for v in ratios.values()) + " |"
        )
    analysis = payload["analysis"]
    if analysis["scaling"]:
        model = payload["scaling_model"]
        out += [
            "",
            f"| devices (B, {model}) | ms/step | speed-up | efficiency |",
            "|---:|---:|---:|---:|",
        ]
        for n, ms in sorted(analysis["scaling"].items()):
            eff = analysis["efficiency"][n]
            speedup = None if eff is None else eff * n
            out.append(f"| {n} | {ms:.2f} | {_fmt(speedup)} | {_fmt(eff)} |")
    out += ["", "| target | value | result |", "|---|---:|---|"]
    for t in analysis["targets"]:
        verdict = "PASS" if t["pass"] else "MISS"
        out.append(f"| {t['target']} | {_fmt(t['value'])} | {verdict} |")
    return "\n".join(out) + "\n"


def plot(payload: dict, path: pathlib.Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG (pip install matplotlib)")
        return False
    rows = [r for r in payload["rows"] if "error" not in r]
    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(1, len(models))
    for i, model in enumerate(models):
        mine = {r["config"]: r["ms_median"] for r in rows if r["model"] == model}
        xs = [CONFIGS.index(c) + i * width for c in mine]
        axes[0].bar(xs, list(mine.values()), width=width, label=model)
    axes[0].set_xticks(
        [i + 0.4 - width / 2 for i in range(len(CONFIGS))], list(CONFIGS)
    )
    axes[0].set_ylabel("ms / step (median)")
    axes[0].set_yscale("log")
    axes[0].set_title("ms/step per configuration")
    axes[0].legend()
    curve = payload["analysis"]["scaling"]
    if curve:
        ns = sorted(curve)
        axes[1].plot(ns, [curve[n] for n in ns], marker="o", label="B: keras_dist fit")
        axes[1].set_xscale("log", base=2)
        axes[1].set_xlabel("devices (same global batch)")
        axes[1].set_ylabel("ms / step")
        axes[1].set_title(f"scaling, {payload['scaling_model']}")
        axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main(argv=None) -> dict:
    args = _parser().parse_args(argv)
    models = (args.models or ("cnn,tiny" if args.quick else "cnn,resnet,tiny")).split(
        ","
    )
    args.steps = args.steps or (6 if args.quick else 50)
    if args.scaling is None:
        args.scaling = "" if args.quick else "1,2,4,8"
    args.repeats = args.repeats or (2 if args.quick else 5)
    # D needs TensorFlow; on TPU tf.distribute would need TPUStrategy: skipped.
    configs = [
        c
        for c in args.configs
        if c != "D" or (_tf_installed() and args.platform != "tpu")
    ]
    scaling_model = "cnn" if "cnn" in models else models[0]
    jobs = [(model, config, args.devices) for model in models for config in configs]
    counts = [int(v) for v in args.scaling.split(",") if v]
    jobs += [(scaling_model, "B", n) for n in counts if n != args.devices]
    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
        futures = {
            job: pool.submit(run_config, job[1], job[0], job[2], args) for job in jobs
        }
        results = {}
        for job, future in futures.items():
            results[job] = future.result()
            print(_line(results[job]), flush=True)
    rows = {(m, c): results[(m, c, args.devices)] for m in models for c in configs}
    scaling = [results[(scaling_model, "B", n)] for n in counts]
    payload = {
        "benchmark": "single_vs_mirrored",
        "date": datetime.date.today().isoformat(),
        "machine": machine(args.platform, args.devices),
        "python": platform.python_version(),
        "steps": args.steps,
        "repeats": args.repeats,
        "models": models,
        "rows": list(rows.values()),
        "scaling_model": scaling_model,
        "scaling_rows": scaling,
    }
    payload["analysis"] = analyse(rows, scaling, models)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(payload)
    print("\n" + text)
    (out / "single_vs_mirrored.json").write_text(json.dumps(payload, indent=1) + "\n")
    (out / "single_vs_mirrored.md").write_text(text)
    if plot(payload, out / "single_vs_mirrored.png"):
        print(f"wrote {out / 'single_vs_mirrored.png'}")
    print(f"wrote {out / 'single_vs_mirrored.json'} and .md")
    return payload


def _line(row: dict) -> str:
    head = f"{row['model']:>7} {row['config']} x{row['devices']}"
    if "error" in row:
        return f"{head}: FAILED {row['error']}"
    return f"{head}: {row['ms_median']:8.2f} ms/step ({row['examples_per_s']:.0f} ex/s)"


if __name__ == "__main__":
    main()
