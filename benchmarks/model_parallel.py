"""A keras-hub Gemma on 2-D (batch x model) meshes: memory, time, communication.

Trains a keras-hub `GemmaCausalLM` (4 layers, hidden 512, 8 query and 2
key/value heads, vocab 4096, seq 128, global batch 16, Adam; random weights
from a config) in each configuration, each in its own fresh process
(`benchmarks/_model_parallel_worker.py`), from the same weights:

    one_device      OneDeviceStrategy (the reference loss)
    mirrored_8x1    MirroredStrategy: data parallel, state replicated
    fsdp_8x1        MirroredStrategy(shard_variables=True)
    auto_4x2        MirroredStrategy(model_parallel=2): automatic layouts
    auto_2x4        MirroredStrategy(model_parallel=4)
    auto_1x8        MirroredStrategy(model_parallel=8)
    hub_2x4         model_parallel=4 with keras-hub's GemmaBackbone.get_layout_map
    auto_2x4_fsdp   model_parallel=4, shard_variables=True (TP + FSDP)

and reports the state (weights + Adam) on the fullest device, the step time
(median ms/step over the timed epochs), the bytes the compiled step's
collectives hold on a device per step and the model's FLOPs per step (both
read from the program XLA compiled, by `kd.utils.ScalingReport`), and the
final loss, with PASS/MISS for: every loss equals one device's to 1e-4
(relative); 2-D meshes hold <= 1/k of Mirrored's weights per device.
Writes `model_parallel.{json,md,png}` to `--out`.

    python benchmarks/model_parallel.py --quick   # hidden 128, 2 layers: ~3 min CPU
    python benchmarks/model_parallel.py           # the model above
    python benchmarks/model_parallel.py --platform gpu   # on 8 GPUs
"""

import argparse
import datetime
import pathlib
import platform

from _runs import (
    SHARED_PROCESS,
    fmt,
    indicative_note,
    loss_target,
    machine,
    pyplot,
    run_worker,
    share_processes,
    targets_table,
    write_results,
)

HERE = pathlib.Path(__file__).resolve().parent
CONFIGS = [
    "one_device",
    "mirrored_8x1",
    "fsdp_8x1",
    "auto_4x2",
    "auto_2x4",
    "auto_1x8",
    "hub_2x4",
    "auto_2x4_fsdp",
]
MODEL_AXIS = {"auto_4x2": 2, "auto_2x4": 4, "auto_1x8": 8, "hub_2x4": 4}
MB = 1 << 20


def _parser():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the small model")
    p.add_argument(
        "--model",
        default=None,
        choices=["gemma", "gemma-small", "tiny"],
        help="the model (default: gemma; gemma-small with --quick; tiny: a "
        "smoke run's, 1 layer of hidden 64)",
    )
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--steps", type=int, default=None, help="steps per epoch")
    p.add_argument("--repeats", type=int, default=2, help="timed epochs")
    p.add_argument("--platform", default="cpu", choices=["cpu", "gpu", "tpu"])
    p.add_argument("--out", default=str(HERE / "results"))
    p.add_argument(
        "--shared-process",
        action="store_true",
        help="smoke test: the configurations one after another in one process "
        "(per job): the code and rows, no figures",
    )
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    return p


def analyse(rows: dict) -> dict:
    ok = {c: r for c, r in rows.items() if "error" not in r}
    for row in ok.values():
        row["state_bytes_per_device"] = (
            row["weight_bytes_per_device"] + row["optimizer_bytes_per_device"]
        )
        row["communicated_bytes"] = sum((row["collective_bytes"] or {}).values())
    ref, base = ok.get("one_device"), ok.get("mirrored_8x1")
    worst, target = loss_target(rows, ref)
    targets = [target]
    for config, k in MODEL_AXIS.items():
        if config not in ok or base is None:
            continue
        ratio = ok[config]["weight_bytes_per_device"] / base["weight_bytes_per_device"]
        targets.append(
            {
                "target": f"{config} weights per device <= 1/{k} of Mirrored's "
                "(+ vectors kept whole)",
                "value": ratio,
                "limit": 1 / k,
                "pass": ratio <= 1 / k * 1.05,
            }
        )
    if "hub_2x4" in ok and "auto_2x4" in ok:
        ratio = ok["auto_2x4"]["communicated_bytes"] / max(
            1, ok["hub_2x4"]["communicated_bytes"]
        )
        targets.append(
            {
                "target": "automatic (2, 4) collective bytes / keras-hub's map "
                "(informative)",
                "value": ratio,
                "limit": None,
                "pass": True,
            }
        )
    return {"max_loss_rel_diff": worst, "targets": targets}


def markdown(payload: dict) -> str:
    spec = payload["spec"]
    out = [
        f"Measured {payload['date']} on {payload['machine']}: keras-hub "
        f"GemmaCausalLM vocab {spec['vocab']}, hidden {spec['hidden']}, "
        f"{spec['layers']} layers, {spec['heads']} query / {spec['kv_heads']} "
        f"key-value heads, seq {spec['seq']}, global batch {spec['batch']}, "
        f"{payload['params']:,} parameters, Adam; {payload['steps']} steps x "
        f"{payload['repeats']} timed epochs after one warm-up epoch."
        + indicative_note(payload),
        "",
        "| config | mesh (batch, model) | state MB per device | largest weight, "
        "share per device | collectives MB per device per step | GFLOP per step "
        "| ms/step (median) | final loss |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for config, r in payload["rows"].items():
        if "error" in r:
            out.append(f"| {config} | failed: {r['error']} |||||||")
            continue
        mesh = r["mesh"]
        shape = f"({mesh.get('batch', 1)}, {mesh.get('model', 1)})"
        _, held, whole = r["largest"]
        flops = r["model_flops_per_step"]
        out.append(
            f"| {config} | {shape} | {r['state_bytes_per_device'] / MB:.2f} | "
            f"1/{whole // held} | {r['communicated_bytes'] / MB:.2f} | "
            f"{fmt(flops and flops / 1e9, 1)} | {r['ms_median']:.0f} | "
            f"{r['final_loss']:.6f} |"
        )
    out += targets_table(payload["analysis"]["targets"], spec=".3g")
    kinds = sorted(
        {k for r in payload["rows"].values() for k in r.get("collective_bytes") or {}}
    )
    out += [
        "",
        "Collective bytes per device per step, by kind (MB):",
        "",
        "| config | " + " | ".join(kinds) + " |",
        "|---|" + "---:|" * len(kinds),
    ]
    for config, r in payload["rows"].items():
        if "error" in r:
            continue
        cells = [f"{(r['collective_bytes'] or {}).get(k, 0) / MB:.2f}" for k in kinds]
        out.append(f"| {config} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def plot(payload: dict, path: pathlib.Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    rows = {c: r for c, r in payload["rows"].items() if "error" not in r}
    names = list(rows)
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    panels = [
        (
            [rows[c]["state_bytes_per_device"] / MB for c in names],
            "MB of state per device",
        ),
        (
            [rows[c]["communicated_bytes"] / MB for c in names],
            "collective MB per device per step",
        ),
        ([rows[c]["ms_median"] for c in names], "ms / step (median)"),
    ]
    for ax, (values, label) in zip(axes, panels, strict=True):
        ax.bar(names, values)
        ax.set_title(label)
        ax.tick_params(axis="x", rotation=40)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _line(row: dict) -> str:
    if "error" in row:
        return f"{row['config']:>14}: FAILED {row['error']}"
    state = (row["weight_bytes_per_device"] + row["optimizer_bytes_per_device"]) / MB
    sent = sum((row["collective_bytes"] or {}).values()) / MB
    return (
        f"{row['config']:>14}: {state:8.2f} MB/device  {sent:8.2f} MB sent/step  "
        f"{row['ms_median']:8.0f} ms/step  loss {row['final_loss']:.6f}"
    )


def main(argv=None) -> dict:
    args = _parser().parse_args(argv)
    if args.shared_process:
        share_processes()
        print(f"{SHARED_PROCESS}: indicative only, not figures to quote.")
    model = args.model or ("gemma-small" if args.quick else "gemma")
    args.steps = args.steps or (2 if args.quick else 3)
    rows = {}
    for config in args.configs.split(","):
        rows[config] = run_worker(
            HERE / "_model_parallel_worker.py",
            [config, model, args.steps, args.repeats],
            timeout=args.timeout,
            platform_name=args.platform,
            ident={"config": config, "model": model},
        )
        print(_line(rows[config]), flush=True)
    done = next((r for r in rows.values() if "error" not in r), {})
    payload = {
        "benchmark": "model_parallel",
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(args.platform, 8),
        "python": platform.python_version(),
        "model": model,
        "spec": done.get("spec", {}),
        "params": done.get("params", 0),
        "steps": args.steps,
        "repeats": args.repeats,
        "rows": rows,
        "indicative": SHARED_PROCESS if args.shared_process else None,
    }
    payload["analysis"] = analyse(rows)
    stem = "model_parallel_quick" if args.quick else "model_parallel"
    write_results(args.out, stem, payload, markdown, plot)
    return payload


if __name__ == "__main__":
    main()
