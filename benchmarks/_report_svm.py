"""The Markdown tables and the PNG of `single_vs_mirrored.py`'s results."""

import pathlib
import re

from _runs import fmt, pyplot, targets_table

NAMES = {
    "A": "Keras fit, 1 device",
    "B": "keras_dist MirroredStrategy fit",
    "B32": "keras_dist fit, steps_per_execution=32",
    "BU": "keras_dist fit, pacing off (what the pacer costs)",
    "B32U": "keras_dist fit, steps_per_execution=32, pacing off",
    "BH": "keras_dist fit, host path (batches copied during the epoch)",
    "BH32": "keras_dist fit, host path, steps_per_execution=32",
    "BN": "keras_dist fit of a step that does no work (Keras's loop's floor)",
    "BN32": "keras_dist fit of a step that does no work, steps_per_execution=32",
    "BS": "keras_dist fit, shuffle=True (rows gathered, not sliced)",
    "BR": "keras_dist fit, shuffle=True, split by rows (budget under a copy)",
    "C": "Keras DataParallel, fit in the scope (as documented)",
    "CS": "Keras DataParallel, shuffle=True (as documented)",
    "C0": "Keras DataParallel, fit outside the scope (pitfall; keras_dist "
    "models remember their strategy)",
    "D": "tf.distribute.MirroredStrategy (TF backend)",
    "E": "hand-written jax.jit + optax (limit)",
    "E32": "hand-written, 32 steps per dispatch (lax.scan; limit of B32)",
    "EK": "hand-written jax.jit + Keras's Adam (limit for Keras's step math)",
    "EK32": "hand-written, 32 steps per dispatch, Keras's Adam",
    "EKU": "EK with no bound on the programs in flight",
    "EK32U": "EK32 with no bound on the programs in flight",
    "EKH": "hand-written, Keras's Adam, host path (copy one step ahead)",
    "EKH32": "hand-written, 32 steps per dispatch, host path (one copy each)",
    "F": "keras_dist custom loop (strategy.run)",
}


def _header(payload: dict) -> list:
    steps = ", ".join(f"{m} {n}" for m, n in payload["steps"].items())
    load = " to ".join(f"{v:.1f}" for v in payload["load_average"])
    out = [
        f"Measured {payload['date']} on {payload['machine']} "
        f"({payload['minutes']:.0f} min; 1-minute load average {load}"
        + (f"; {payload['note']}" if payload["note"] else "")
        + ").",
        "",
        f"`{payload['command']}`: steps per epoch {steps}; "
        f"{payload['epochs']} timed epochs per run after one compiling epoch; "
        f"{payload['repeats']} runs per configuration, each a fresh process, "
        "alternating configurations; a run's sample is the median ms/step of "
        "its timed epochs; median and min-max over the runs. Host CPU: the "
        "main thread's CPU time per step (`time.thread_time`; the Python loop "
        "and the dispatches, not XLA's threads nor an input thread), median "
        "over the runs.",
    ]
    crashed = [
        f"{r['model']} {r['config']} x{r['crashed_runs']}"
        for r in payload["rows"] + payload["scaling_rows"]
        if r.get("crashed_runs")
    ]
    if crashed:
        said = sorted(
            {_gist(e) for r in payload["rows"] for e in r.get("crash_errors", [])}
        )
        out.append(
            "Runs that crashed and were run again: "
            + ", ".join(crashed)
            + "."
            + (" What they said: " + "; ".join(said) + "." if said else "")
        )
    failed = [
        f"{r['model']} {r['config']} {r['failed_runs']} of {payload['repeats']}"
        for r in payload["rows"] + payload["scaling_rows"]
        if r.get("failed_runs") and "error" not in r
    ]
    if failed:
        out.append(
            "Runs that crashed twice, left out of their row's median and "
            "min-max: " + ", ".join(failed) + "."
        )
    if payload.get("indicative"):
        out.append(f"Indicative only, not figures to quote: {payload['indicative']}.")
    return [*out, ""]


def _gist(error: str) -> str:
    """A crash's fatal line without its log prefix, ids and keys."""
    text = error.split("] ", 1)[-1]
    text = re.sub(r"\[id=\d+\] | ?RendezvousKey\{[^}]*\}|`", "", text)
    return '"' + text[:220] + '"'


def _rows(payload: dict) -> list:
    out = [
        "| model | config | ms/step (median) | min-max | steps/s | examples/s "
        "| host CPU µs/step | peak RSS MB |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in payload["rows"]:
        name = f"{r['config']} {NAMES[r['config']]}"
        if "error" in r:
            out.append(f"| {r['model']} | {name} | failed: {r['error']} | | | | | |")
            continue
        out.append(
            f"| {r['model']} | {name} | {r['ms_median']:.2f} | "
            f"{r['ms_min']:.2f}-{r['ms_max']:.2f} | {r['steps_per_s']:.1f} | "
            f"{r['examples_per_s']:.0f} | {fmt(_us(r.get('host_cpu_ms')), 1)} | "
            f"{r['peak_rss_mb']:.0f} |"
        )
    return out


def _us(ms):
    return None if ms is None else ms * 1e3


def markdown(payload: dict) -> str:
    analysis = payload["analysis"]
    out = _header(payload) + _rows(payload)
    names = list(next(iter(analysis["ratios"].values())))
    out += ["", "| model | " + " | ".join(names) + " |"]
    out.append("|---|" + "---:|" * len(names))
    for model, ratios in analysis["ratios"].items():
        out.append(f"| {model} | " + " | ".join(fmt(v) for v in ratios.values()) + " |")
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
            out.append(f"| {n} | {ms:.2f} | {fmt(speedup)} | {fmt(eff)} |")
    out += targets_table(analysis["targets"])
    return "\n".join(out) + "\n"


def plot(payload: dict, path: pathlib.Path) -> bool:
    """Horizontal bars of ms/step (median, min-max whiskers), one panel a
    model, each configuration named in words (keras_dist's in blue); the
    scaling curve of B when measured. False without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    rows = [r for r in payload["rows"] if "error" not in r]
    models = list(dict.fromkeys(r["model"] for r in rows))
    # Device counts are keys: strings once read back from the JSON.
    curve = {int(n): ms for n, ms in payload["analysis"]["scaling"].items()}
    counts = [sum(r["model"] == m for r in rows) for m in models]
    heights = counts + ([4] if curve else [])
    fig, axes = plt.subplots(
        len(heights),
        1,
        figsize=(10, 1.2 + 0.32 * sum(heights) + 0.6 * len(heights)),
        gridspec_kw={"height_ratios": heights},
        squeeze=False,
    )
    for ax, model in zip(axes[:, 0], models, strict=False):
        mine = [r for r in rows if r["model"] == model][::-1]
        ms = [r["ms_median"] for r in mine]
        spread = [
            [m - r["ms_min"] for m, r in zip(ms, mine, strict=True)],
            [r["ms_max"] - m for m, r in zip(ms, mine, strict=True)],
        ]
        colors = ["tab:blue" if r["config"][0] in "BF" else "tab:gray" for r in mine]
        ax.barh(range(len(mine)), ms, xerr=spread, capsize=2, color=colors)
        # The name up to its first parenthesis (the tables have the rest).
        labels = [f"{NAMES[r['config']].split(' (')[0]} ({r['config']})" for r in mine]
        ax.set_yticks(range(len(mine)), labels, fontsize=8)
        ax.set_xscale("log")
        ax.set_xlabel("ms / step (median, min-max over runs; log scale)")
        ax.set_title(f"model: {model}", fontsize=10)
    if curve:
        ax = axes[-1, 0]
        ns = sorted(curve)
        ax.plot(ns, [curve[n] for n in ns], marker="o", label="keras_dist fit (B)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("devices (same global batch)")
        ax.set_ylabel("ms / step")
        ax.set_title(f"scaling, {payload['scaling_model']}", fontsize=10)
        ax.legend()
    fig.suptitle(f"{payload['date']}, {payload['machine']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
