"""mkdocs hook: serves the benchmark plots of benchmarks/results/ as plots/*.png.

mkdocs serves only files under docs/; the plots stay where the benchmarks
write them (re-measured there) and are added to the site at build time.
`single_vs_mirrored.png` labels its bars with the configurations' letters
(A, B32, EK32): for the site it is drawn again from the run's JSON, each bar
named in words (the names `benchmarks/_report_svm.py` prints in its tables),
the letter after the name. `checkpointing.png` is drawn again likewise,
each checkpoint callback named (`bar_async` is `BackupAndRestore`), with the
time a save adds beside the device -> host copy (the CPU target's terms).
Without matplotlib the script's own plot is served.
"""

import importlib.util
import json
import pathlib
import sys
import tempfile

from mkdocs.structure.files import File

_BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
_RESULTS = _BENCHMARKS / "results"
_DRAWN = pathlib.Path(tempfile.mkdtemp(prefix="keras_dist_plots_"))


def on_files(files, config):
    for png in sorted(_RESULTS.glob("*.png")):
        source = png
        draw = _REDRAWN.get(png.name)
        if draw is not None:
            source = draw(png.with_suffix(".json")) or png
        name = f"plots/{png.name}"
        files.append(File.generated(config, name, abs_src_path=str(source)))
    return files


def _config_names() -> dict:
    """The configurations' names, as the benchmark's tables print them."""
    path = _BENCHMARKS / "_report_svm.py"
    sys.path.insert(0, str(_BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location("_report_svm_for_docs", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return dict(module.NAMES)
    except Exception:  # The letters, then.
        return {}
    finally:
        sys.path.remove(str(_BENCHMARKS))


def _named_single_vs_mirrored(results: pathlib.Path) -> pathlib.Path | None:
    """Horizontal bars of ms/step (median, min-max), one panel a model, each
    configuration named in words; None without matplotlib or the JSON."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        payload = json.loads(results.read_text())
    except (ImportError, OSError, ValueError):
        return None
    names = _config_names()
    rows = [r for r in payload.get("rows", []) if "ms_median" in r]
    models = list(dict.fromkeys(r["model"] for r in rows))
    if not models:
        return None
    counts = [sum(r["model"] == m for r in rows) for m in models]
    fig, axes = plt.subplots(
        len(models),
        1,
        figsize=(10, 1.2 + 0.32 * sum(counts) + 0.6 * len(models)),
        gridspec_kw={"height_ratios": counts},
        squeeze=False,
    )
    for ax, model in zip(axes[:, 0], models, strict=True):
        mine = [r for r in rows if r["model"] == model][::-1]
        ms = [r["ms_median"] for r in mine]
        spread = [
            [m - r.get("ms_min", m) for m, r in zip(ms, mine, strict=True)],
            [r.get("ms_max", m) - m for m, r in zip(ms, mine, strict=True)],
        ]
        ours = [r["config"].startswith("B") or r["config"] == "F" for r in mine]
        colors = ["tab:blue" if mine_ else "tab:gray" for mine_ in ours]
        ax.barh(range(len(mine)), ms, xerr=spread, capsize=2, color=colors)
        # The name up to its first parenthesis (the tables have the rest).
        short = {c: names.get(c, c).split(" (")[0] for c in (r["config"] for r in mine)}
        labels = [f"{short[c]} ({c})" for c in (r["config"] for r in mine)]
        ax.set_yticks(range(len(mine)), labels, fontsize=8)
        ax.set_xscale("log")
        ax.set_xlabel("ms / step (median, min-max over runs; log scale)")
        ax.set_title(f"model: {model}", fontsize=10)
    fig.suptitle(
        f"{payload.get('date', '')}, {payload.get('machine', '')}; keras_dist in blue",
        fontsize=10,
    )
    fig.tight_layout()
    out = _DRAWN / results.with_suffix(".png").name
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


_CHECKPOINTS = {
    "nosave": "no saving",
    "bar_sync": "BackupAndRestore, synchronous",
    "bar_async": "BackupAndRestore",
    "mc_sync": "ModelCheckpoint .weights.h5, synchronous",
    "mc_async": "ModelCheckpoint .weights.h5",
    "mc_sharded": "ModelCheckpoint, sharded=True",
    "keras_orbax": "Keras's OrbaxCheckpoint",
}

_LAYOUTS = {"fsdp": "FSDP", "mirrored": "Mirrored"}


def _named_checkpointing(results: pathlib.Path) -> pathlib.Path | None:
    """Horizontal bars: the time a save adds (paired in its process) and the
    device -> host copy, per layout and callback, named; None without
    matplotlib, the JSON or paired times."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        payload = json.loads(results.read_text())
    except (ImportError, OSError, ValueError):
        return None
    rows = [
        r
        for r in payload.get("rows", [])
        if r.get("config") != "nosave" and r.get("paired_added_ms_per_save") is not None
    ][::-1]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(10, 1.4 + 0.45 * len(rows)))
    ys = range(len(rows))
    added = [r["paired_added_ms_per_save"] for r in rows]
    copy = [r.get("host_copy_ms") or 0.0 for r in rows]
    ax.barh([y + 0.2 for y in ys], added, height=0.4, label="time a save adds")
    ax.barh(
        [y - 0.2 for y in ys],
        copy,
        height=0.4,
        color="tab:gray",
        label="device -> host copy",
    )
    ax.axvline(0, color="black", linewidth=0.8)
    labels = [
        f"{_CHECKPOINTS.get(r['config'], r['config'])}, "
        f"{_LAYOUTS.get(r.get('layout'), r.get('layout', ''))}"
        for r in rows
    ]
    ax.set_yticks(list(ys), labels, fontsize=8)
    ax.set_xlabel("ms per save (target: adds <= 1.2x the copy)")
    ax.set_title(
        f"{payload.get('date', '')}, {payload.get('machine', '')}", fontsize=10
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = _DRAWN / results.with_suffix(".png").name
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


_REDRAWN = {
    "single_vs_mirrored.png": _named_single_vs_mirrored,
    "checkpointing.png": _named_checkpointing,
}
