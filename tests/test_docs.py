"""The Python examples of README.md and docs/ run, and print what they promise.

README.md keeps the two commands and the Quickstart; the guides moved to
docs/ (tests/test_docs_site.py runs their other examples and builds the site).
"""

import os
import re
import tomllib

import pytest

from tests._docs import ROOT, as_installed, assert_quiet, python_blocks, run_with_stderr
from tests._docs import run as _run

PROJECT_EXTRAS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
    "optional-dependencies"
]
GUIDES = ROOT / "docs" / "guides"


@pytest.mark.parametrize(
    "page, found",
    [
        ("README.md", "tensorflow False, sklearn True, keras_hub False, grain False"),
        (
            "docs/guides/custom-training-loops.md",
            "tensorflow True, sklearn False, keras_hub False, grain False",
        ),
        (
            "docs/guides/large-models.md",
            "tensorflow False, sklearn False, keras_hub True, grain True",
        ),
    ],
)
def test_a_page_runs_on_exactly_the_install_it_names(page, found):
    """README's demo install has scikit-learn and no TensorFlow; the custom
    loops' `.[tf]`, TensorFlow; the large models', keras-hub and Grain."""
    code = (
        "import importlib.util as u, keras_dist\n"
        "names = ['tensorflow', 'sklearn', 'keras_hub', 'grain']\n"
        "print(', '.join(f'{n} {u.find_spec(n) is not None}' for n in names))"
    )
    out = _run(["-c", code], as_installed(ROOT / page))
    assert out.strip() == found


@pytest.mark.source_checks
def test_no_text_installs_keras_dist_from_the_package_index():
    """The index does not serve keras-dist: every `pip install` of it a user
    reads (docs, README, examples, notebooks, error messages) is from a
    checkout (`-e`) or the repository (`@ git+`); keras-dist's `tpu` extra
    is named by the JAX it installs, in pyproject's range."""
    tpu = PROJECT_EXTRAS["tpu"][0]
    places = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]
    places += [*(ROOT / "examples").glob("*.py"), *(ROOT / "notebooks").glob("*.ipynb")]
    places += [*(ROOT / "keras_dist").rglob("*.py")]
    found = []
    for path in places:
        for match in re.finditer(
            r"keras-dist\[[\w,]*\][^\n`\\]{0,3}", path.read_text()
        ):
            text = path.read_text()[match.start() : match.end() + 40]
            if "@ git+" not in text and "@ {" not in text and "@ file" not in text:
                found.append((path.relative_to(ROOT).as_posix(), text.split("\n")[0]))
    assert found == []
    from keras_dist.cluster._tpu_devices import _INSTALL

    assert f'pip install "{tpu}"' == _INSTALL


def test_readme_has_exactly_two_commands_at_the_top():
    text = (ROOT / "README.md").read_text()
    top = text.split("\n## ", 1)[0]
    commands = re.findall(r"```bash\n(.*?)```", top, flags=re.S)
    assert len(commands) == 2
    assert all(len(c.strip().splitlines()) == 1 for c in commands)
    assert "examples/digits_cnn.py" in commands[0]
    assert commands[1].strip().endswith("python -m pytest")


def test_ci_runs_the_readme_test_command():
    text = (ROOT / "README.md").read_text()
    test_command = re.findall(r"```bash\n(.*?)```", text, flags=re.S)[1].strip()
    ci = (ROOT / ".ci" / "run").read_text()
    assert f"TEST_COMMAND='{test_command}'" in ci, "CI must run the README command"
    assert 'grep -qxF "${TEST_COMMAND}" README.md' in ci
    assert test_command.startswith("python3 -m venv .venv")
    assert test_command.endswith("python -m pytest")


def _figures(text: str) -> list[str]:
    """The figures with a unit (ms, MB) in `text`, as written."""
    return re.findall(r"(\d+(?:\.\d+)?) ?(?:ms|MB)\b", text)


def _quotable_results() -> list[float]:
    """Every number in benchmarks/results/ tables not marked indicative."""
    numbers = []
    for path in (ROOT / "benchmarks" / "results").rglob("*.md"):
        text = path.read_text()
        if "indicative" not in text.lower():
            numbers += [float(n) for n in re.findall(r"\d+\.\d+|\d+", text)]
    return numbers


@pytest.mark.source_checks
def test_readme_and_the_benchmarks_headline_quote_only_repeated_results():
    """README quotes no figure (it links the page); the page's headline only
    figures of a results table not marked indicative (>= 3 runs, and epochs
    of >= 50 steps on an accelerator), to the digits it quotes."""
    readme = (ROOT / "README.md").read_text()
    assert _figures(readme) == []
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    headline = page.split("**In short.**", 1)[1].split("\n\n", 1)[0]
    results = _quotable_results()
    quoted = _figures(headline)
    assert len(quoted) >= 5, quoted
    for figure in quoted:
        digits = len(figure.partition(".")[2])
        assert any(round(n, digits) == float(figure) for n in results), figure
    assert "indicative" in headline


# A measured figure: milliseconds, bytes in MB or GB, a share in %, or
# seconds with a decimal or as a range (a whole number of seconds is a
# setting in these pages: a timeout, an interval).
_MEASURED = re.compile(
    r"(?<![\w.])\d[\d,]*(?:\.\d+)?(?:[\u2013-]\d[\d,]*(?:\.\d+)?)?"
    r" ?(?:ms|MB|GB|%)(?!\w)"
    r"|(?<![\w.])\d+(?:\.\d+|[\u2013-]\d+(?:\.\d+)?) ?s\b"
)
# Figures that are no measurement, each with why.
_NOT_MEASURED = {
    ("mixed-precision.md", "0.4%"): "bfloat16's unit in the last place, 2**-8",
}


@pytest.mark.source_checks
def test_the_guides_date_every_measured_figure():
    """A figure measured on some machine (a time, a size, a share) is dated
    in its paragraph, or is not in the guides: a newcomer must tell today's
    numbers from an old run's (issue 74 found the checkpoints guide quoting
    undated H200 and CPU figures)."""
    undated = []
    for page in (ROOT / "docs").rglob("*.md"):
        if page.name == "benchmarks.md":  # Each table with its date and command.
            continue
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for paragraph in re.split(r"\n\s*\n", text):
            if re.search(r"20\d\d-\d\d-\d\d", paragraph):
                continue
            for figure in _MEASURED.findall(paragraph):
                if (page.name, figure) not in _NOT_MEASURED:
                    undated.append(f"{page.relative_to(ROOT)}: {figure}")
    assert undated == []


@pytest.mark.examples
def test_readme_quickstart_runs():
    blocks = python_blocks(ROOT / "README.md")
    assert blocks, "README has no python example"
    out = _run(["-c", blocks[0]], as_installed(ROOT / "README.md"))
    lines = out.strip().splitlines()
    assert lines[0] == "8"
    assert lines[-1] == "(5, 2)"
    assert "Epoch 3/3" in out


@pytest.mark.examples
def test_custom_training_loop_guide_runs():
    blocks = python_blocks(GUIDES / "custom-training-loops.md")
    assert blocks, "the custom-loop guide has no python example"
    out = _run(["-c", blocks[0]], as_installed(GUIDES / "custom-training-loops.md"))
    losses = [float(v) for v in re.findall(r"^Epoch \d, Loss: (\d\.\d{4})$", out, re.M)]
    assert len(losses) == 5
    assert losses[-1] < losses[0]
    assert out.strip().splitlines()[-1] == "True"


@pytest.mark.examples
def test_multi_host_guide_example_runs_in_one_process():
    blocks = [b for b in python_blocks(GUIDES / "multi-host.md") if "MultiWorker" in b]
    assert blocks, "the multi-host guide has no MultiWorkerMirroredStrategy example"
    out = _run(["-c", blocks[0]], as_installed(GUIDES / "multi-host.md"))
    assert out.strip().splitlines()[-1] == "1 (100, 3)"
    # Probabilities into the probability loss: about ln 3 on 3 classes, a
    # batch's up to 1.6 from the random start (logits read as probabilities
    # gave 5.87 rising to 6.32).
    losses = [float(v) for v in re.findall(r"loss: ([\d.]+)", out)]
    assert losses and all(loss < 2.5 for loss in losses), losses


@pytest.mark.slow
@pytest.mark.processes
def test_multi_host_guide_keras_dist_run_command_trains_on_two_processes(tmp_path):
    text = (GUIDES / "multi-host.md").read_text()
    command = next(
        line for line in text.splitlines() if line.startswith("keras-dist-run -n 2")
    )
    assert command == (
        "keras-dist-run -n 2 --devices-per-process 4 "
        "examples/multi_worker_digits.py --epochs 3"
    )
    args = [*command.split()[1:], "--epochs", "1", "--workdir", str(tmp_path)]
    out, err = run_with_stderr(
        ["-m", "keras_dist_run", *args], as_installed(GUIDES / "multi-host.md")
    )
    assert_quiet(out + err)  # The launcher's default output.
    # The chief prints the progress (11 steps of 128) and PrintLR; nobody else.
    assert re.search(r"^\[0\] 11/11 - .* val_accuracy", out, re.M)
    assert "[0] Learning rate for epoch 1 is 0.003" in out
    assert not re.search(r"^\[1\] (11/11|Learning rate)", out, re.M)
    accuracies = re.findall(r"^\[(\d)\] process \d: test accuracy (\S+);", out, re.M)
    assert sorted(rank for rank, _ in accuracies) == ["0", "1"]
    assert accuracies[0][1] == accuracies[1][1]  # Same model on both processes.
    assert "predict returned all 360 rows" in out
    assert sorted(os.listdir(tmp_path / "checkpoints")) == [
        "checkpoint",
        "ckpt_1.weights.h5",
    ]


# What TensorFlow prints when it is imported (its C++ start-up lines).
TENSORFLOW_START_UP = (
    "oneDNN custom operations",
    "absl::InitializeLog",
    "cpu_feature_guard",
    "TensorFlow binary is optimized",
)


@pytest.mark.slow
@pytest.mark.processes
def test_the_multi_host_example_by_tf_config_imports_no_tensorflow(tmp_path):
    """As on real hosts (TF_CONFIG, `python` on each, no launcher), on a
    machine with TensorFlow installed: the example never imports it (the
    processes agree on a seed without it), so none of its start-up lines."""
    from tests._processes import by_hand

    results = by_hand(
        ROOT / "examples" / "multi_worker_digits.py",
        args=("--epochs", "1", "--workdir", tmp_path),
        env={"TF_CPP_MIN_LOG_LEVEL": "0", "PYTHONPATH": str(ROOT / "examples")},
        timeout=240,
    )
    for rank, (code, out, err) in enumerate(results):
        assert code == 0, out[-2000:] + err[-3000:]
        assert f"process {rank}: test accuracy" in out
        said = [
            line
            for line in err.splitlines()
            if any(s in line for s in TENSORFLOW_START_UP)
        ]
        assert said == [], said


def _mixed_precision_blocks() -> list[str]:
    return python_blocks(GUIDES / "mixed-precision.md")


MIXED_PRECISION_INSTALL = as_installed(GUIDES / "mixed-precision.md")


@pytest.mark.examples
def test_mixed_precision_guide_fit_runs():
    out = _run(["-c", _mixed_precision_blocks()[0]], MIXED_PRECISION_INSTALL)
    assert out.strip().splitlines()[-1] == "LossScaleOptimizer 32768.0"


@pytest.mark.examples
def test_mixed_precision_guide_custom_loop_skips_on_every_replica():
    out = _run(["-c", _mixed_precision_blocks()[1]], MIXED_PRECISION_INSTALL)
    assert out.strip().splitlines()[-3:] == [
        "finite True, loss scale 32768.0",
        "finite False, loss scale 16384.0",
        "finite True, loss scale 16384.0",
    ]


@pytest.mark.examples
def test_large_models_guide_model_parallel_example_runs():
    text = (GUIDES / "large-models.md").read_text()
    section = text.split("\n## A second mesh axis:", 1)[1].split("\n## ", 1)[0]
    block = re.findall(r"```python\n(.*?)```", section, flags=re.S)[0]
    install = as_installed(GUIDES / "large-models.md")
    out = _run(["-c", block], install).strip().splitlines()
    assert out[0] == "2 {'batch': 2, 'model': 4}"
    assert out[1] == "(37, 12)"
    assert out[2] == "P('model', 'batch')"


def test_failures_guide_flags_are_the_launchers_with_their_defaults():
    from keras_dist_run import _parser

    text = (GUIDES / "failures.md").read_text()
    rows = re.findall(r"^\| `(--[a-z-]+) [A-Z]+` \| ([^|]+) \|", text, re.MULTILINE)
    assert {flag for flag, _ in rows} == {
        "--max-restarts",
        "--heartbeat-timeout",
        "--hang-timeout",
        "--compilation-cache",
        "--goodput",
    }
    defaults = {
        a.option_strings[0]: a.default for a in _parser()._actions if a.option_strings
    }
    for flag, documented in rows:
        default = defaults[flag]
        if documented.strip() == "off":
            assert default is None, flag
        elif documented.strip() != "see above":
            assert float(documented) == default, flag


def test_failures_guide_local_tier_example_makes_the_callback(tmp_path):
    # The guide's `BackupAndRestore` with a local tier, on this machine's paths.
    text = (GUIDES / "failures.md").read_text()
    (code,) = [
        block
        for block in re.findall(r"```python\n(.*?)```", text, re.DOTALL)
        if "local_dir" in block
    ]
    code = code.replace("/shared/run1", str(tmp_path / "shared"))
    code = code.replace("/dev/shm/run1", str(tmp_path / "local"))
    import keras_dist as kd

    scope: dict = {"kd": kd}
    exec(code, scope)
    backup = scope["backup"]
    assert backup.local_save_freq == 50 and backup.save_freq == "epoch"
    assert backup.local_dir == str(tmp_path / "local")
    assert (tmp_path / "shared" / "backup").is_dir()
