"""The docs site builds, documents every public name, and its examples run.

`mkdocs build --strict` fails on a broken link, a page missing from the nav
or a docstring mkdocstrings cannot parse. The API pages are checked against
the code: every name of every public `__all__` is on its module's page with
its signature, and its docstring has an example. Every ```python block of
docs/ runs in a fresh process (```py marks the fragments that only show a
few lines).
"""

import enum
import html
import importlib
import inspect
import os
import pathlib
import pkgutil
import re
import subprocess
import sys
import types

import pytest

import keras_dist
from tests._docs import (
    ROOT,
    as_installed,
    assert_quiet,
    python_blocks,
    run_with_stderr,
)

DOCS = ROOT / "docs"
BUILD_TIMEOUT = 300
EIGHT_DEVICES = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}

# Blocks another test runs and whose output it checks: run once, there. The
# second item must be in the block (the map fails loudly when it goes stale).
CHECKED_ELSEWHERE = {
    ("index.md", 0): ("kd.MirroredStrategy()", "test_docs.py (README's Quickstart)"),
    ("guides/custom-training-loops.md", 0): (
        "distributed_train_step",
        "test_docs.py::test_custom_training_loop_guide_runs",
    ),
    ("guides/mixed-precision.md", 0): (
        "mixed_float16",
        "test_docs.py::test_mixed_precision_guide_fit_runs",
    ),
    ("guides/mixed-precision.md", 1): (
        "all_finite",
        "test_docs.py::test_mixed_precision_guide_custom_loop_skips_on_every_replica",
    ),
    ("guides/multi-host.md", 0): (
        "MultiWorkerMirroredStrategy()",
        "test_docs.py::test_multi_host_guide_example_runs_in_one_process",
    ),
    ("guides/tpu.md", 0): (
        "TPUStrategy(resolver)",
        "strategies/test_tpu.py::test_tpu_guide_example_falls_back_without_a_tpu",
    ),
    ("guides/checkpoints.md", 1): (
        "gs://my-bucket",
        "callbacks/test_remote_storage.py::"
        "test_the_checkpoints_guide_example_writes_to_a_bucket (on an emulator)",
    ),
    ("guides/failures.md", 0): (
        "local_dir=",
        "test_docs.py::test_failures_guide_local_tier_example_makes_the_callback",
    ),
    ("guides/large-models.md", 1): (
        "model_parallel=4",
        "test_docs.py::test_large_models_guide_model_parallel_example_runs",
    ),
}


def _public_modules() -> list[str]:
    """keras_dist and each submodule whose name has no leading underscore."""
    names = [
        f"keras_dist.{info.name}"
        for info in pkgutil.iter_modules(keras_dist.__path__)
        if not info.name.startswith("_")
    ]
    return ["keras_dist", *sorted(names)]


def _page(module: str) -> str:
    return "keras_dist" if module == "keras_dist" else module.split(".", 1)[1]


def _section(page_html: str, ident: str) -> str:
    """The text of the object `ident`, up to the next object of its level."""
    start = page_html.find(f'id="{ident}"')
    assert start >= 0, f"{ident} is not on its API page"
    end = page_html.find("<h2 id=", start + 1)
    return page_html[start : end if end > 0 else len(page_html)]


def _text(fragment: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", fragment))


def _check_documented(module: str, name: str, obj, page_html: str) -> None:
    ident = f"{module}.{name}"
    if isinstance(obj, types.ModuleType):  # A submodule: its own page, linked.
        assert f'href="{_page(obj.__name__)}.html"' in page_html, ident
        return
    section = _section(page_html, ident)
    text = _text(section)
    if not callable(obj):  # A constant: its value.
        assert f"{name} = {obj!r}" in text, (ident, text[:300])
        return
    doc = inspect.getdoc(obj) or ""
    assert "Example" in doc, f"{ident}'s docstring has no Example section"
    if isinstance(obj, type) and issubclass(obj, enum.Enum):
        for member in obj:  # An enum: its members (no call signature).
            assert member.name in text, (ident, member.name)
        return
    if isinstance(obj, type) and issubclass(obj, BaseException):
        bases = re.search(r"Bases:([^\n]*)", text)  # An error: what it is.
        assert bases and obj.__bases__[0].__name__ in bases.group(1), ident
        return
    parameters = inspect.signature(obj).parameters
    signature = re.search(r'class="doc-signature highlight">(.*?)</div>', section, re.S)
    if not parameters and not signature:  # `PrintLR()`: mkdocstrings shows none.
        return
    assert signature, f"{ident} has no signature on its page"
    shown = _text(signature.group(1))
    assert re.search(rf"\b{re.escape(name)}\(", shown), (ident, shown)
    for parameter in parameters:
        assert re.search(rf"\b{parameter}\b", shown), (ident, parameter, shown)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("docs") / "site"
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p
    )
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT,
        cwd=ROOT,
        env=env,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out


@pytest.mark.source_checks
def test_the_site_builds_strict_and_offline(site):
    index = (site / "index.html").read_text()
    assert 'href="guides/tpu.html"' in index  # use_directory_urls: false
    assert "fonts.googleapis.com" not in index  # theme.font: false
    for page in site.rglob("*.html"):  # Scripts, styles, images: all local.
        assert not re.search(r'src="https?://', page.read_text()), page
    for plot in (ROOT / "benchmarks" / "results").glob("*.png"):
        assert (site / "plots" / plot.name).is_file(), plot.name
    assert 'src="plots/memory.png"' in (site / "benchmarks.html").read_text()


@pytest.mark.source_checks
@pytest.mark.parametrize("module", _public_modules())
def test_every_public_name_is_in_the_api_reference(site, module):
    mod = importlib.import_module(module)
    assert hasattr(mod, "__all__"), f"{module} has no __all__"
    page = site / "api" / f"{_page(module)}.html"
    assert page.is_file(), f"{module} has no API page (docs/api/, mkdocs.yml)"
    page_html = page.read_text()
    for name in mod.__all__:
        _check_documented(module, name, getattr(mod, name), page_html)


def _doc_blocks() -> list[tuple[str, int, str]]:
    blocks = []
    for path in sorted(DOCS.rglob("*.md")):
        page = path.relative_to(DOCS).as_posix()
        blocks += [(page, i, b) for i, b in enumerate(python_blocks(path))]
    return blocks


@pytest.mark.source_checks
def test_the_examples_checked_elsewhere_are_those_blocks():
    blocks = {(page, i): block for page, i, block in _doc_blocks()}
    for key, (marker, _) in CHECKED_ELSEWHERE.items():
        assert key in blocks and marker in blocks[key], f"stale: {key}"


# The blocks another test runs and checks (CHECKED_ELSEWHERE, kept exact by
# the test above) are left out here: each block runs once.
@pytest.mark.examples
@pytest.mark.parametrize(
    "page, index, block",
    [
        pytest.param(*b, id=f"{b[0]}:{b[1]}")
        for b in _doc_blocks()
        if (b[0], b[1]) not in CHECKED_ELSEWHERE
    ],
)
def test_docs_python_block_runs(page, index, block):
    """On exactly the install its page names (`as_installed`), quietly."""
    _, err = run_with_stderr(
        ["-c", block], env_extra={**EIGHT_DEVICES, **as_installed(DOCS / page)}
    )
    assert_quiet(err)
