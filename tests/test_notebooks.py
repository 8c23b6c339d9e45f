"""The notebooks run in a real Jupyter kernel and show what they promise.

Each notebook is executed with nbclient in an IPython kernel of this
interpreter (ipykernel's own kernel spec, whatever kernels the machine has
registered), offline and with few epochs (`KD_NOTEBOOK_EPOCHS`), in a fresh
directory; the tests read the cells' outputs. The committed notebooks carry
the outputs of a full run, which the fast tests below check are there, and
open in Colab, where their first cell installs keras_dist.

To store a full run again (default epochs, offline, local paths scrubbed):
`python -m tests.test_notebooks [NAME.ipynb ...]` from the repository root.
"""

import ast
import glob
import importlib.metadata
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib

import nbformat
import pytest
from jupyter_client import KernelManager
from jupyter_client.kernelspec import KernelSpecManager
from nbclient import NotebookClient

from keras_dist.tpu._mesh import tpu_device_order
from tests._tpu_fakes import fake_tpu_devices
from tests.as_installed.sitecustomize import installed as brought_by

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
NAMES = [
    "custom_training_loop.ipynb",
    "digits_mirrored.ipynb",
    "finetune_llm.ipynb",
    "multi_worker.ipynb",
    "tpu_colab.ipynb",
]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
REPOSITORY = PROJECT["urls"]["Source"]  # https://github.com/OWNER/NAME
CELL_TIMEOUT = 240
# An absolute path of the machine that ran a notebook.
LOCAL_PATH = re.compile(r"/(?:work|tmp|home|Users|root)/")
ALREADY_INSTALLED = "keras_dist is already installed: nothing to install.\n"


def _colab_url(name: str) -> str:
    github = REPOSITORY.removeprefix("https://github.com/")
    return (
        f"https://colab.research.google.com/github/{github}/blob/main/notebooks/{name}"
    )


def _kernel_env(**overrides: str) -> dict[str, str]:
    """This environment for a kernel: the keras_dist of this tree, offline."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "KERAS_BACKEND")
    }
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), env.get("PYTHONPATH")) if p
    )
    env.update(KD_NOTEBOOK_OFFLINE="1", TF_CPP_MIN_LOG_LEVEL="3", **overrides)
    return env


def _run(nb, workdir: pathlib.Path, env: dict[str, str]) -> None:
    """Executes `nb` in place, in a fresh kernel of this interpreter in `workdir`."""
    # kernel_dirs=[]: ipykernel's native spec, whose argv is sys.executable.
    kernel = KernelManager(
        kernel_name="python3", kernel_spec_manager=KernelSpecManager(kernel_dirs=[])
    )
    client = NotebookClient(
        nb,
        km=kernel,
        timeout=CELL_TIMEOUT,
        resources={"metadata": {"path": str(workdir)}},
    )
    try:
        client.execute(env=env)
    finally:  # nbclient leaves a kernel it was given running.
        if kernel.has_kernel:
            kernel.shutdown_kernel(now=True)


def _execute(name: str, workdir: pathlib.Path, epochs: int, **env: str):
    """Runs notebooks/`name` in `workdir` (with `env` too); returns (stdout
    text, outputs)."""
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell("import sys; print(sys.executable)"))
    _run(nb, workdir, _kernel_env(KD_NOTEBOOK_EPOCHS=str(epochs), **env))
    outputs = [o for cell in nb.cells for o in cell.get("outputs", [])]
    text = "".join(o.get("text", "") for o in outputs if o.get("name") == "stdout")
    assert text.strip().splitlines()[-1] == sys.executable, "kernel of another Python"
    return text, outputs


def _count_png(outputs) -> int:
    return sum("image/png" in o.get("data", {}) for o in outputs)


def _texts(output):
    """The text fields of a stored output (not its images), as (key, text)."""
    if "text" in output:
        yield "text", output["text"]
    for mime, value in output.get("data", {}).items():
        if mime.startswith("text/") or mime.endswith("json"):
            yield mime, value if isinstance(value, str) else repr(value)
    if output.get("output_type") == "error":
        yield "error", "\n".join([output["evalue"], *output["traceback"]])


def _scrub(text: str, workdir: pathlib.Path) -> str:
    """`text` without this machine's paths."""
    text = text.replace(str(workdir) + "/", "").replace(str(workdir), ".")
    text = text.replace(str(ROOT) + "/", "")
    text = re.sub(r"/tmp/ipykernel_\d+/\d+\.py", "<ipython-input>", text)
    text = re.sub(r"/[^\s\"':]*/site-packages/", "<site-packages>/", text)
    return re.sub(r"/tmp/", "<tmp>/", text)


def _outputs(nb):
    return [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]


def save_full_run(name: str) -> None:
    """Executes notebooks/`name` with its default epochs, offline; stores it."""
    path = NOTEBOOKS / name
    nb = nbformat.read(path, as_version=4)
    env = _kernel_env()
    env.pop("KD_NOTEBOOK_EPOCHS", None)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = pathlib.Path(tmp).resolve()
        _run(nb, workdir, env)
        for cell in nb.cells:
            for output in cell.get("outputs", []):
                if "text" in output:
                    output["text"] = _scrub(output["text"], workdir)
                for mime, value in output.get("data", {}).items():
                    if mime.startswith("text/") and isinstance(value, str):
                        output["data"][mime] = _scrub(value, workdir)
    left = [t for o in _outputs(nb) for _, t in _texts(o) if LOCAL_PATH.search(t)]
    assert not left, f"{name}: local paths left in the outputs: {left}"
    nbformat.validate(nb)
    nbformat.write(nb, path)


@pytest.mark.examples
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_digits_mirrored_notebook(tmp_path):
    out, _ = _execute("digits_mirrored.ipynb", tmp_path, epochs=1)
    assert "Number of devices: 8" in out
    assert "1437 training images; global batch 128" in out
    assert re.search(r"test accuracy 0\.\d{4}", out)
    assert "kernel sharding: P(None, None, None, None) on 8 devices" in out


@pytest.mark.examples
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_custom_training_loop_notebook_equals_one_device(tmp_path):
    out, outputs = _execute("custom_training_loop.ipynb", tmp_path, epochs=2)
    assert "Number of devices: 8" in out
    assert "global batch 64; last training batch: 29 images" in out
    epochs = re.findall(r"^Epoch (\d), Loss: (\d\.\d{4}), .*$", out, re.M)
    # Twice two epochs (8 replicas, then one device), the same losses.
    assert [e for e, _ in epochs] == ["1", "2", "1", "2"]
    assert epochs[:2] == epochs[2:]
    assert float(epochs[1][1]) < float(epochs[0][1])
    difference = re.search(r"max \|weight difference\| (\S+)", out)
    assert difference and float(difference[1]) < 1e-5
    assert "equal to one device: True" in out
    assert _count_png(outputs) == 1


@pytest.mark.slow
@pytest.mark.processes
@pytest.mark.timeout(300)
def test_multi_worker_notebook_two_processes_equal_one(tmp_path):
    out, _ = _execute("multi_worker.ipynb", tmp_path, epochs=1)
    assert "$ keras-dist-run -n 2 --devices-per-process 4 mw_train.py" in out
    # The chief prints the progress and PrintLR; the other process does not.
    assert "[0] Learning rate for epoch 1 is 0.003" in out
    assert re.search(r"^\[0\] 11/11 - .* val_accuracy", out, re.M)
    assert not re.search(r"^\[1\] (11/11|Learning rate)", out, re.M)
    accuracies = re.findall(r"^\[(\d)\] process \1: test accuracy (\S+)$", out, re.M)
    assert sorted(rank for rank, _ in accuracies) == ["0", "1"]
    assert accuracies[0][1] == accuracies[1][1]
    assert "checkpoints: ['checkpoint', 'ckpt_1.weights.h5']" in out
    run = tmp_path / "run_2_processes"
    assert sorted(os.listdir(run)) == [
        "checkpoints",
        "final_weights_process0.npz",
        "final_weights_process1.npz",
    ]
    assert sorted(os.listdir(run / "checkpoints")) == [
        "checkpoint",
        "ckpt_1.weights.h5",
    ]
    assert "process 0 and process 1 weights identical: True" in out
    assert "latest checkpoint = process 0's weights: True" in out
    assert "equal to one process: True" in out


@pytest.mark.examples
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tpu_notebook_falls_back_to_mirrored_on_cpu(tmp_path):
    """Its checkpoints on a bucket (`KD_CHECKPOINT_DIR`, as on a TPU VM, on
    the local fake-gcs-server): nothing of them on the local disk."""
    from tests import _storage

    url = _storage.bucket("gs") + "/mnist"
    out, outputs = _execute(
        "tpu_colab.ipynb",
        tmp_path,
        epochs=2,
        KD_CHECKPOINT_DIR=url,
        **_storage.emulators(),
    )
    assert _storage.listing(url) == [
        "checkpoint",
        "ckpt_1.weights.h5",
        "ckpt_2.weights.h5",
    ]
    assert not (tmp_path / "training_checkpoints").exists()
    assert re.search(r"^No TPU \(\w+\): falling back to MirroredStrategy$", out, re.M)
    assert (
        "MirroredStrategy(devices=[cpu:0, cpu:1, ..., cpu:7], num_replicas_in_sync=8)"
        in out
    )
    assert "Number of devices: 8" in out
    assert "policy: float32\nsteps_per_execution: 1" in out
    assert "Offline: MNIST replaced by scikit-learn's digits" in out
    assert "1437 training and 360 test images of shape (28, 28, 1)" in out
    for epoch in (1, 2):
        assert f"Learning rate for epoch {epoch} is 0.001" in out
    assert (
        "checkpoints: ['checkpoint', 'ckpt_1.weights.h5', 'ckpt_2.weights.h5']" in out
    )
    accuracy = re.search(r"^Eval loss: \S+, Eval accuracy: (\S+)$", out, re.M)
    assert accuracy and float(accuracy[1]) > 0.8
    assert "reloaded model evaluates equal: True" in out
    assert re.search(r"time per epoch: [\d.]+ s for the first", out)
    assert (tmp_path / "mnist_cnn.keras").is_file()
    assert _count_png(outputs) == 1


@pytest.mark.examples
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_finetune_llm_notebook_trains_lora_on_a_2d_mesh_and_generates(tmp_path):
    out, _ = _execute("finetune_llm.ipynb", tmp_path, epochs=40)
    assert "No TPU (TPUNotFoundError): MirroredStrategy" in out
    assert "mesh: {'batch': 2, 'model': 4} replicas: 2" in out
    assert "80,960 parameters, 2,816 trainable (LoRA)" in out
    assert "embeddings: (128, 64) P('model', 'batch')" in out
    losses = [float(v) for v in re.findall(r"^epoch \d+: loss (\S+),", out, re.M)]
    assert len(losses) == 3 and losses[-1] < losses[0] - 1.5
    # It learned to count: the prompt 10 11 12 13 goes on 14 15 16 ...
    generated = re.search(r"^generated: \[([\d, ]+)\]$", out, re.M)
    assert generated and generated[1].startswith("10, 11, 12, 13, 14, 15, 16")
    assert "one device generates the same tokens: True" in out
    assert (tmp_path / "finetuned.keras").is_file()
    # Text: 3 string prompts through a preprocessor on the 2 replicas.
    texts = re.findall(r"^generated text: (.*)$", out, re.M)
    assert len(texts) == 3 and texts[0].startswith("10 11 12 13 14 15 16")
    assert "one device generates the same text: True" in out


def _install_cell(nb) -> str:
    return next(c.source for c in nb.cells if c.cell_type == "code")


def _install_namespace(source: str) -> dict:
    """The install cell's definitions (REPOSITORY, EXTRAS, ..., kept): all
    but its last statement, the install."""
    tree = ast.parse(source)
    keep = [n for n in tree.body if not isinstance(n, ast.If)]
    keep = [n for n in keep if not (isinstance(n, ast.Assign) and _is_commands(n))]
    namespace: dict = {}
    exec(
        compile(ast.Module(keep, type_ignores=[]), "<install cell>", "exec"), namespace
    )
    return namespace


def _is_commands(node: ast.Assign) -> bool:
    return any(isinstance(t, ast.Name) and t.id == "commands" for t in node.targets)


def _pattern(source: str) -> str:
    """The install cell without what it installs."""
    for name in ("EXTRAS", "NEEDS", "NO_DEPS"):
        source = re.sub(
            rf"^{name} = (\[.*?\]|\{{.*?\}})  #",
            f"{name} = ... #",
            source,
            flags=re.M | re.S,
        )
    return source


def _distribution(requirement: str) -> str:
    name = re.match(r"[A-Za-z0-9._-]+", requirement.strip())[0]
    return re.sub(r"[-_.]+", "-", name).lower()


def _imported_modules(nb) -> set[str]:
    """Top-level modules the code cells import, less the stdlib and its own files."""
    modules, written = set(), set()
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        source = cell.source
        if source.startswith("%%writefile "):
            written.add(source.split("\n", 1)[0].split()[-1].removesuffix(".py"))
            source = source.split("\n", 1)[1]
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                modules |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                modules.add(node.module.split(".")[0])
    return modules - set(sys.stdlib_module_names) - written - {"keras_dist"}


@pytest.mark.source_checks
@pytest.mark.parametrize("name", NAMES)
def test_notebook_opens_in_colab_from_its_badge(name):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    assert REPOSITORY.startswith("https://github.com/"), REPOSITORY
    badge = (
        "[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]"
        f"({_colab_url(name)})"
    )
    assert nb.cells[0].cell_type == "markdown"
    assert nb.cells[0].source.splitlines()[0] == badge


@pytest.mark.source_checks
def test_the_tpu_notebook_imports_tensorflow_after_jax_has_the_tpu():
    """Colab's full TensorFlow claims the TPU when imported before JAX gets
    it (the TPU guide): no cell before the strategy's imports it."""
    cells = nbformat.read(NOTEBOOKS / "tpu_colab.ipynb", as_version=4).cells
    code = [c.source for c in cells if c.cell_type == "code"]
    strategy = next(i for i, s in enumerate(code) if "TPUClusterResolver()" in s)
    imports = [
        i
        for i, source in enumerate(code)
        if any(
            alias.name.split(".")[0] == "tensorflow"
            for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Import)
            for alias in node.names
        )
    ]
    assert imports and min(imports) > strategy, (strategy, imports)


@pytest.mark.source_checks
@pytest.mark.parametrize("name", NAMES)
def test_install_cell_is_the_same_in_every_notebook_but_what_it_installs(name):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    source = _install_cell(nb)
    # Looked up without importing it (Keras must not start before the
    # notebook sets KERAS_BACKEND and XLA_FLAGS in the next cell).
    assert "import keras" not in source and "import jax" not in source
    assert not re.search(r"^\s*[%!]", source, re.M), "no IPython magics"
    namespace = _install_namespace(source)
    assert namespace["REPOSITORY"] == REPOSITORY
    jax = next(d for d in PROJECT["dependencies"] if d.startswith("jax"))
    (low, high) = namespace["JAX_SUPPORTED"]
    assert jax == f"jax>={low[0]}.{low[1]},<{high[0]}.{high[1]}"
    assert set(namespace["EXTRAS"]) <= set(PROJECT["optional-dependencies"])
    assert "tpu" not in namespace["EXTRAS"]  # Only on a TPU runtime.
    first = _install_cell(nbformat.read(NOTEBOOKS / NAMES[0], as_version=4))
    assert _pattern(source) == _pattern(first)


@pytest.mark.source_checks
@pytest.mark.parametrize("name", NAMES)
def test_install_cell_brings_every_package_the_notebook_imports(name):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    namespace = _install_namespace(_install_cell(nb))
    installed = brought_by(
        namespace["EXTRAS"],
        also=[_distribution(r) for r in namespace["NEEDS"].values()],
        alone=[_distribution(r) for r in namespace["NO_DEPS"].values()],
    )
    modules = importlib.metadata.packages_distributions()
    missing = {
        module: modules.get(module)
        for module in _imported_modules(nb)
        if not {_distribution(d) for d in modules.get(module, [])} & installed
    }
    assert not missing, f"{name} imports modules its install cell does not bring"
    # keras-hub, installed alone: the `hub` extra brings what it imports.
    if "keras_hub" in namespace["NO_DEPS"]:
        assert "hub" in namespace["EXTRAS"]


@pytest.mark.source_checks
@pytest.mark.parametrize("name", NAMES)
def test_install_cell_does_nothing_where_keras_dist_is_installed(name, tmp_path):
    """Run alone in a fresh kernel, where keras_dist imports: one line, no pip."""
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nb.cells = [nbformat.v4.new_code_cell(_install_cell(nb))]
    _run(nb, tmp_path, _kernel_env())
    assert [
        (o.output_type, o.get("name"), o.get("text")) for o in nb.cells[0].outputs
    ] == [("stream", "stdout", ALREADY_INSTALLED)]


def _python_312() -> str:
    """Colab's Python (3.12) where this machine has it (CI's does: stage 2
    runs on it), found as .ci/run finds it; else this one."""
    pyenv = os.path.expanduser("~/.pyenv/versions/3.12*/bin/python")
    for candidate in [shutil.which("python3.12"), *sorted(glob.glob(pyenv))]:
        if candidate and subprocess.run([candidate, "-c", ""]).returncode == 0:
            return candidate
    return sys.executable


# What a Colab runtime has installed (2026), as distribution: (module, version).
COLAB = {
    "jax": ("jax", "0.12.0.1"),
    "jaxlib": ("jaxlib", "0.12.0.1"),
    "tensorflow": ("tensorflow", "2.19.0"),
    "tensorflow-datasets": ("tensorflow_datasets", "4.9.9"),
    "importlib_resources": ("importlib_resources", "6.5.2"),
    "matplotlib": ("matplotlib", "3.10.0"),
    "scikit-learn": ("sklearn", "1.6.1"),
}


def _simulated_runtime(tmp_path, packages: dict) -> str:
    """A folder of stand-ins for `packages` (a module and its metadata each)."""
    site = tmp_path / "site"
    for dist, (module, version) in packages.items():
        (site / module).mkdir(parents=True, exist_ok=True)
        (site / module / "__init__.py").write_text(f"__version__ = {version!r}\n")
        info = site / f"{dist.replace('-', '_')}-{version}.dist-info"  # As pip.
        info.mkdir()
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n"
        )
    return str(site)


GIT = "git+https://github.com/keras-dist/keras-dist"
PIP = "$ python -m pip install --quiet"
KEPT = "kept as installed: tensorflow==2.19.0, jax==0.12.0.1, jaxlib==0.12.0.1"


@pytest.mark.parametrize(
    "name, runtime, printed",
    [
        # Colab's CPU or GPU runtime: keras_dist from its repository, and
        # nothing Colab has (its full TensorFlow is not joined by -cpu).
        ("digits_mirrored.ipynb", {}, [f"{PIP} 'keras-dist[demo] @ {GIT}'", KEPT]),
        ("custom_training_loop.ipynb", {}, [f"{PIP} 'keras-dist[demo] @ {GIT}'", KEPT]),
        ("multi_worker.ipynb", {}, [f"{PIP} 'keras-dist[demo] @ {GIT}'", KEPT]),
        ("tpu_colab.ipynb", {}, [f"{PIP} 'keras-dist[demo] @ {GIT}'", KEPT]),
        (
            "finetune_llm.ipynb",
            {},
            [
                f"{PIP} 'keras-dist[hub] @ {GIT}'",
                f"{PIP} --no-deps keras-hub==0.32.0",
                KEPT,
            ],
        ),
        # A TPU runtime without libtpu: JAX for TPUs; with it: kept.
        (
            "tpu_colab.ipynb",
            {"tpu": True},
            [f"{PIP} 'keras-dist[demo,tpu] @ {GIT}'", KEPT],
        ),
        (
            "finetune_llm.ipynb",
            {"tpu": True, "libtpu": True},
            [
                f"{PIP} 'keras-dist[hub] @ {GIT}'",
                f"{PIP} --no-deps keras-hub==0.32.0",
                KEPT + ", libtpu==0.0.30",
            ],
        ),
        # No TensorFlow nor matplotlib: the notebook's own, -cpu; a JAX
        # keras_dist does not support is not kept.
        (
            "custom_training_loop.ipynb",
            {"bare": True, "jax": "0.4.33"},
            [
                f"{PIP} 'keras-dist[demo] @ {GIT}' 'tensorflow-cpu>=2.18' "
                "'matplotlib>=3.8'",
                "kept as installed: nothing",
            ],
        ),
        # An older keras-hub on the image: the pinned one replaces it.
        (
            "finetune_llm.ipynb",
            {"keras-hub": "0.21.1"},
            [
                f"{PIP} 'keras-dist[hub] @ {GIT}'",
                f"{PIP} --no-deps keras-hub==0.32.0",
                KEPT,
            ],
        ),
        # KD_INSTALL_FROM a checkout's path: installed from its file URL.
        (
            "digits_mirrored.ipynb",
            {"install_from": "checkout"},
            [f"{PIP} 'keras-dist[demo] @ file://{{tmp_path}}/checkout'", KEPT],
        ),
    ],
    ids=[
        "colab-digits",
        "colab-custom-loop",
        "colab-multi-worker",
        "colab-tpu-notebook",
        "colab-llm",
        "tpu-runtime-without-libtpu",
        "tpu-runtime-with-libtpu",
        "bare-old-jax",
        "older-keras-hub",
        "install-from-a-path",
    ],
)
def test_install_cell_on_a_simulated_colab(name, runtime, printed, tmp_path):
    """The cell's dry run (KD_INSTALL_DRY_RUN=1) on Colab's Python 3.12 with
    only stand-ins of a runtime's packages on its path (`-S`: no site
    packages): what it would install, and what it keeps."""
    packages = dict(COLAB)
    if runtime.get("bare"):
        packages = {d: packages[d] for d in ("jax", "jaxlib")}
    if "jax" in runtime:
        packages["jax"] = packages["jaxlib"] = None
        packages = {d: v for d, v in packages.items() if v}
        packages["jax"] = ("jax", runtime["jax"])
        packages["jaxlib"] = ("jaxlib", runtime["jax"])
    if runtime.get("libtpu"):
        packages["libtpu"] = ("libtpu", "0.0.30")
    if "keras-hub" in runtime:
        packages["keras-hub"] = ("keras_hub", runtime["keras-hub"])
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PYTHON", "KD_", "TPU_", "COLAB_", "PIP_"))
    }
    env.update(
        PYTHONPATH=_simulated_runtime(tmp_path, packages),
        KD_INSTALL_DRY_RUN="1",
        **({"TPU_ACCELERATOR_TYPE": "v5litepod-1"} if runtime.get("tpu") else {}),
    )
    if "install_from" in runtime:  # A relative path, as a user types it.
        (tmp_path / runtime["install_from"]).mkdir()
        env["KD_INSTALL_FROM"] = runtime["install_from"]
    source = _install_cell(nbformat.read(NOTEBOOKS / name, as_version=4))
    result = subprocess.run(
        [_python_312(), "-S", "-c", source],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        line.replace("{tmp_path}", str(tmp_path)) for line in printed
    ]
    assert "ERROR" not in result.stdout + result.stderr


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory):
    """A new virtual environment's Python: pip, and no keras_dist."""
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    return str(venv / "bin" / "python")


@pytest.mark.source_checks
def test_install_cell_that_cannot_install_says_so(bare_python, tmp_path):
    """Where keras_dist is missing, offline: one pip command, from the
    repository (the index, which does not serve it, is not tried); pip's
    messages, then an error naming what it could not install."""
    nb = nbformat.read(NOTEBOOKS / "digits_mirrored.ipynb", as_version=4)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON"))}
    env.update(
        PIP_NO_INDEX="1",
        PIP_CONFIG_FILE=os.devnull,
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        GIT_ALLOW_PROTOCOL="file",
    )
    result = subprocess.run(
        [bare_python, "-c", _install_cell(nb)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    assert [line for line in result.stdout.splitlines() if line.startswith("$ ")] == [
        f"{PIP} 'keras-dist[demo] @ {GIT}'"
    ]
    assert "fatal: transport 'https' not allowed" in result.stdout
    assert "No matching distribution found for keras-dist" not in result.stdout
    assert result.stderr.strip().splitlines()[-1] == (
        "RuntimeError: pip could not install ['keras-dist[demo] @ "
        f"{GIT}']: its messages are above."
    )


@pytest.mark.source_checks
@pytest.mark.parametrize("name", NAMES)
def test_stored_outputs_hold_no_local_path(name):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    found = [
        (i, key, match[0])
        for i, cell in enumerate(nb.cells)
        if cell.cell_type == "code"
        for output in cell.outputs
        for key, text in _texts(output)
        for match in [LOCAL_PATH.search(text)]
        if match
    ]
    assert not found, f"{name}: (cell, output, path) {found}"


@pytest.mark.source_checks
def test_committed_notebooks_carry_a_full_run():
    """Every code cell ran, in order, without error; the plots are saved as PNG."""
    assert sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")) == NAMES
    for name in NAMES:
        nb = nbformat.read(NOTEBOOKS / name, as_version=4)
        nbformat.validate(nb)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), name
        outputs = [o for c in code for o in c.outputs]
        assert not [o for o in outputs if o.output_type == "error"], name
        # The install cell ran where keras_dist was installed.
        assert [o.get("text") for o in code[0].outputs] == [ALREADY_INSTALLED], name
        assert any("KD_NOTEBOOK_EPOCHS" in c.source for c in code[1:3]), name
        if name in ("custom_training_loop.ipynb", "tpu_colab.ipynb"):
            assert _count_png(outputs) == 1, name


@pytest.mark.source_checks
def test_tpu_notebook_says_which_colab_runtime_and_what_it_prints():
    nb = nbformat.read(NOTEBOOKS / "tpu_colab.ipynb", as_version=4)
    markdown = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    assert "**Runtime → Change runtime type → TPU**" in markdown
    # One replica per TPU device: 1 on a single-chip v5e-1, 8 on a v2-8's cores,
    # in the order TPUStrategy gives them (devices as JAX reports them there).
    for runtime, devices in (
        ("v5e-1", fake_tpu_devices(1, 1, 1, "TPU v5 lite")),
        ("v2-8", fake_tpu_devices(2, 2, 1, "TPU v2", cores_per_chip=2)),
    ):
        replicas = len(devices)
        # One host: a device's index among the local ones is its id.
        names = [f"tpu:{d.id}" for d in tpu_device_order(devices)]
        if len(names) > 4:  # As Strategy.__repr__ shortens them.
            names = [*names[:2], "...", names[-1]]
        strategy = (
            f"TPUStrategy(devices=[{', '.join(names)}], "
            f"num_replicas_in_sync={replicas})"
        )
        assert runtime in markdown
        assert strategy in markdown
        assert f"Number of devices: {replicas}\n" in markdown
        assert f"`global batch: {64 * replicas}`" in markdown
    code = [c.source for c in nb.cells if c.cell_type == "code"]
    keras_backend = next(i for i, s in enumerate(code) if "KERAS_BACKEND" in s)
    assert keras_backend < next(i for i, s in enumerate(code) if "import keras" in s)
    strategy = next(source for source in code if "TPUClusterResolver()" in source)
    assert "except ValueError" in strategy and "kd.MirroredStrategy()" in strategy
    assert "print(strategy)" in strategy
    assert 'print(f"Number of devices: {strategy.num_replicas_in_sync}")' in strategy
    assert '"global batch:", BATCH_SIZE' in "\n".join(code)
    assert "BATCH_SIZE_PER_REPLICA = 64 if ONLINE" in "\n".join(code)


if __name__ == "__main__":
    for name in sys.argv[1:] or NAMES:
        print("executing", name, flush=True)
        save_full_run(name)
