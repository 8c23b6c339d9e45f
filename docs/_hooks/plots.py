"""mkdocs hook: serves the benchmark plots of benchmarks/results/ as plots/*.png.

mkdocs serves only files under docs/; the plots stay where the benchmarks
write them (re-measured there) and are added to the site at build time.
`single_vs_mirrored.png` labels its bars with the configurations' letters
(A, B32, EK32): for the site it is drawn again from the run's JSON, each bar
named in words (the names `benchmarks/_report_svm.py` prints in its tables),
the letter after the name. Without matplotlib the script's own plot is
served.
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
        if png.name == "single_vs_mirrored.png":
            source = _named_single_vs_mirrored(png.with_suffix(".json")) or png
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
