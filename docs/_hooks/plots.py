"""mkdocs hook: serves the benchmark plots of benchmarks/results/ as plots/*.png.

mkdocs serves only files under docs/; the plots stay where the benchmarks
write them (re-measured there) and are added to the site at build time.
"""

import pathlib

from mkdocs.structure.files import File

_RESULTS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def on_files(files, config):
    for png in sorted(_RESULTS.glob("*.png")):
        files.append(File.generated(config, f"plots/{png.name}", abs_src_path=str(png)))
    return files
