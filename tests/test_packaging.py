"""The wheel and sdist as a user gets them (built here with setuptools' hooks).

- `py.typed` in the wheel (PEP 561), for keras_dist and the launcher;
- one version (keras_dist/_version.py) in the metadata;
- the licence as an SPDX expression, the file beside it;
- core requirements: exactly what keras_dist imports (the rest in extras);
- the sdist holds the package, not tests that cannot run without the repo.
"""

import email
import pathlib
import shutil
import subprocess
import sys
import tarfile
import zipfile

import pytest

import keras_dist as kd

ROOT = pathlib.Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.source_checks]

# A requirement's name -> the module keras_dist imports for it.
CORE = {
    "keras": "keras",
    "jax": "jax",
    "orbax-checkpoint": "orbax.checkpoint",  # The checkpoint callbacks.
    "etils": "etils.epath",  # Their path layer (`_checkpoint/storage.py`).
    "numpy": "numpy",
    "python-hostlist": "hostlist",
}


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[pathlib.Path, pathlib.Path]:
    out = tmp_path_factory.mktemp("dist")
    # A copy of what the build reads: the build writes beside its sources.
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md", "LICENSE", "MANIFEST.in"):
        shutil.copy(ROOT / name, source / name)
    for name in ("keras_dist", "keras_dist_run", "tests"):
        shutil.copytree(
            ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__")
        )
    built = []
    for hook in ("build_wheel", "build_sdist"):  # One process each: setuptools
        # keeps the first build's output folder for the second otherwise.
        code = (
            "import sys; from setuptools import build_meta as b; "
            f"print('BUILT', b.{hook}(sys.argv[1]))"
        )
        done = subprocess.run(
            [sys.executable, "-c", code, str(out)],
            cwd=source, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        built.append(done.stdout.strip().splitlines()[-1].split()[-1])
    wheel, sdist = built
    return out / wheel, out / sdist


def _metadata(wheel: pathlib.Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        return email.message_from_bytes(archive.read(name))


def test_the_wheel_is_typed_versioned_and_licensed(built):
    wheel, _ = built
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    assert {"keras_dist/py.typed", "keras_dist_run/py.typed"} <= names
    assert not any(n.startswith(("tests/", "benchmarks/")) for n in names)
    metadata = _metadata(wheel)
    assert metadata["Version"] == kd.__version__
    assert metadata["License-Expression"] == "Apache-2.0"
    assert metadata["License"] is None  # Not the whole text (deprecated form).
    assert any(n.endswith("licenses/LICENSE") for n in names)
    assert "Programming Language :: Python :: 3.11" in metadata.get_all("Classifier")
    urls = dict(u.split(", ", 1) for u in metadata.get_all("Project-URL"))
    assert {"Documentation", "Source", "Issues"} <= set(urls)


def test_core_requirements_are_what_keras_dist_imports(built):
    wheel, _ = built
    requirements = [
        r for r in _metadata(wheel).get_all("Requires-Dist") if "extra ==" not in r
    ]
    names = {
        r.split(">")[0].split("<")[0].split("=")[0].split("[")[0].strip()
        for r in requirements
    }
    assert names == set(CORE)
    # Each is imported: at `import keras_dist`, or (Orbax) by the checkpoint
    # callbacks when they save.
    code = "import sys, keras_dist; print(' '.join(sorted(sys.modules)))"
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    ).stdout.split()
    assert {"keras", "jax", "numpy", "hostlist"} <= set(loaded)
    assert "tensorflow_datasets" not in loaded and "optax" not in loaded
    sources = "".join(p.read_text() for p in (ROOT / "keras_dist").rglob("*.py"))
    assert "import orbax.checkpoint" in sources
    assert "from etils.epath import" in sources


def test_the_sdist_holds_the_package_not_the_repository_tests(built):
    _, sdist = built
    with tarfile.open(sdist) as archive:
        names = [n.split("/", 1)[1] for n in archive.getnames() if "/" in n]
    assert "keras_dist/__init__.py" in names and "pyproject.toml" in names
    assert "keras_dist/py.typed" in names and "LICENSE" in names
    assert not any(n.startswith(("tests/", "benchmarks/", "notebooks/")) for n in names)


def test_the_changelog_says_what_this_version_changed():
    """CHANGELOG.md (Keep a Changelog) has this version's section, dated,
    linked, and names the checkpoint format it writes."""
    import re

    from keras_dist._checkpoint.orbax_store import FORMAT

    text = (pathlib.Path(__file__).resolve().parent.parent / "CHANGELOG.md").read_text()
    versions = re.findall(r"^## \[(\d+\.\d+\.\d+)\] - (\d{4}-\d{2}-\d{2})$", text, re.M)
    assert versions and versions[0][0] == kd.__version__, versions
    assert "## [Unreleased]" in text.split(f"## [{kd.__version__}]")[0]
    assert f"\n[{kd.__version__}]: https://" in text
    section = text.split(f"## [{kd.__version__}]")[1].split("\n## [")[0]
    assert f"`{FORMAT}`" in section
