"""mkdocs hook: serves the benchmark plots of benchmarks/results/ as plots/*.png.

mkdocs serves only files under docs/; the plots stay where the benchmarks
write them (re-measured there) and are added to the site at build time.
`single_vs_mirrored.png` names each configuration in words itself.
`checkpointing.png` is drawn again for the site from the run's JSON, each
checkpoint callback named (`bar_async` is `BackupAndRestore`), with the
time a save adds beside the device -> host copy (the CPU target's terms).
Without matplotlib the script's own plot is served.
"""

import json
import pathlib
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
    "checkpointing.png": _named_checkpointing,
}
