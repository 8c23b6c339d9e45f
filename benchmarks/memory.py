"""Memory per device of the strategies for models that outgrow one device.

Trains a keras-hub GPT-2 (`GPT2Backbone` under a Dense head, random
weights, synthetic next-token data) in each configuration, each in its own
fresh process (`benchmarks/_memory_worker.py`), from the same weights:

    one_device       OneDeviceStrategy (the reference)
    mirrored         MirroredStrategy: every device holds all the state
    zero1            MirroredStrategy(shard_optimizer_state=True)
    fsdp             MirroredStrategy(shard_variables=True)
    ps               ParameterServerStrategy(MinSizePartitioner(..., max_shards=8))
    central_storage  CentralStorageStrategy: the state in host memory

and reports the state (weights + optimizer) on the fullest device from
`strategy.memory_report(model)`, the total, the ratio to Mirrored, the step
time (median ms/step over the timed epochs, min-max) and the final loss,
with PASS/MISS for: every loss equals one device's to 1e-4 (relative), FSDP
and ParameterServer hold <= 1/4 of Mirrored's state per device. Writes
`memory.{json,md,png}` to `--out`.

    python benchmarks/memory.py --quick      # GPT-2 hidden 128, 2 layers: ~80 s CPU
    python benchmarks/memory.py              # hidden 256, 4 layers, vocab 8192
"""

import argparse
import concurrent.futures
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
CONFIGS = ["one_device", "mirrored", "zero1", "fsdp", "ps", "central_storage"]
NAMES = {
    "one_device": "OneDeviceStrategy",
    "mirrored": "MirroredStrategy",
    "zero1": "Mirrored, shard_optimizer_state (ZeRO-1)",
    "fsdp": "Mirrored, shard_variables (FSDP)",
    "ps": "ParameterServerStrategy (MinSizePartitioner)",
    "central_storage": "CentralStorageStrategy (host memory)",
}
MB = 1 << 20


def _parser():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smaller GPT-2, short runs")
    p.add_argument("--model", default=None, help="gpt2, gpt2-small or tiny")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--steps", type=int, default=None, help="steps per epoch")
    p.add_argument("--repeats", type=int, default=None, help="timed epochs")
    p.add_argument("--out", default=str(HERE / "results"))
    p.add_argument(
        "--shared-process",
        action="store_true",
        help="smoke test: the configurations one after another in one process "
        "(per job): the code and rows, no figures",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    p.add_argument("--jobs", type=int, default=1, help="runs at once (smoke tests)")
    return p


def state_bytes(row: dict) -> int:
    """Weights + optimizer state on the fullest device (device memory)."""
    return row["weight_bytes_per_device"] + row["optimizer_bytes_per_device"]


def analyse(rows: dict) -> dict:
    ok = {c: r for c, r in rows.items() if "error" not in r}
    base = ok.get("mirrored")
    for row in ok.values():
        row["state_bytes_per_device"] = state_bytes(row)
        row["state_bytes"] = row["weight_bytes"] + row["optimizer_bytes"]
        row["ratio_to_mirrored"] = (
            state_bytes(row) / state_bytes(base) if base else None
        )
    ref = ok.get("one_device")
    worst, target = loss_target(rows, ref)
    targets = [target]
    for config in ("fsdp", "ps"):
        ratio = ok[config]["ratio_to_mirrored"] if config in ok else None
        targets.append(
            {
                "target": f"{config} state per device <= 1/4 of Mirrored's",
                "value": ratio,
                "limit": 0.25,
                "pass": ratio is not None and ratio <= 0.25,
            }
        )
    return {"max_loss_rel_diff": worst, "targets": targets}


def markdown(payload: dict) -> str:
    spec = payload["spec"]
    out = [
        f"Measured {payload['date']} on {payload['machine']}: GPT2Backbone "
        f"vocab {spec['vocab']}, hidden {spec['hidden']}, {spec['layers']} "
        f"layers, seq {spec['seq']}, batch {spec['batch']}, "
        f"{payload['params']:,} parameters, Adam; {payload['steps']} steps x "
        f"{payload['repeats']} timed epochs after one warm-up epoch."
        + indicative_note(payload),
        "",
        "| config | state MB per device | of total MB | vs Mirrored "
        "| host MB per device | ms/step (median) | min-max | final loss |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for config, r in payload["rows"].items():
        if "error" in r:
            out.append(f"| {config} | failed: {r['error']} |||||||")
            continue
        out.append(
            f"| {config} | {r['state_bytes_per_device'] / MB:.2f} | "
            f"{r['state_bytes'] / MB:.2f} | {fmt(r['ratio_to_mirrored'])} | "
            f"{r['host_bytes_per_device'] / MB:.2f} | {r['ms_median']:.1f} | "
            f"{r['ms_min']:.1f}-{r['ms_max']:.1f} | {r['final_loss']:.6f} |"
        )
    out += targets_table(payload["analysis"]["targets"], spec=".3g")
    return "\n".join(out) + "\n"


def plot(payload: dict, path: pathlib.Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    rows = {c: r for c, r in payload["rows"].items() if "error" not in r}
    names = list(rows)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    device = [rows[c]["state_bytes_per_device"] / MB for c in names]
    host = [rows[c]["host_bytes_per_device"] / MB for c in names]
    axes[0].bar(names, device, label="device memory")
    axes[0].bar(names, host, bottom=device, label="host memory (pinned_host)")
    axes[0].set_ylabel("MB of weights + optimizer state per device")
    axes[0].set_title("state on the fullest device")
    axes[0].legend()
    axes[1].bar(names, [rows[c]["ms_median"] for c in names], color="tab:gray")
    axes[1].set_ylabel("ms / step (median)")
    axes[1].set_title("step time")
    for ax in axes:
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _line(row: dict) -> str:
    if "error" in row:
        return f"{row['config']:>16}: FAILED {row['error']}"
    state = (row["weight_bytes_per_device"] + row["optimizer_bytes_per_device"]) / MB
    return (
        f"{row['config']:>16}: {state:8.2f} MB/device  "
        f"{row['ms_median']:8.1f} ms/step  loss {row['final_loss']:.6f}"
    )


def main(argv=None) -> dict:
    args = _parser().parse_args(argv)
    if args.shared_process:
        share_processes()
        print(f"{SHARED_PROCESS}: indicative only, not figures to quote.")
    model = args.model or ("gpt2-small" if args.quick else "gpt2")
    args.steps = args.steps or (2 if args.quick else 3)
    args.repeats = args.repeats or 3
    configs = args.configs.split(",")
    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
        futures = {
            c: pool.submit(
                run_worker,
                HERE / "_memory_worker.py",
                [c, model, args.steps, args.repeats],
                timeout=args.timeout,
                platform_name="cpu",
                ident={"config": c, "model": model},
            )
            for c in configs
        }
        rows = {}
        for config, future in futures.items():
            rows[config] = future.result()
            print(_line(rows[config]), flush=True)
    done = next((r for r in rows.values() if "error" not in r), {})
    payload = {
        "benchmark": "memory",
        "date": datetime.date.today().isoformat(),
        "machine": machine("cpu", 8),
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
    write_results(args.out, "memory", payload, markdown, plot)
    return payload


if __name__ == "__main__":
    main()
