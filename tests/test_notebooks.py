"""The notebooks run in a real Jupyter kernel and show what they promise.

Each notebook is executed with nbclient in an IPython kernel of this
interpreter (ipykernel's own kernel spec, whatever kernels the machine has
registered), offline and with few epochs (`KD_NOTEBOOK_EPOCHS`), in a fresh
directory; the tests read the cells' outputs. The committed notebooks carry
the outputs of a full run, which the fast test below checks are there.
"""

import os
import pathlib
import re
import sys

import nbformat
import pytest
from jupyter_client import KernelManager
from jupyter_client.kernelspec import KernelSpecManager
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
CELL_TIMEOUT = 240
COLAB_URL = (
    "https://colab.research.google.com/github/keras-dist/keras-dist/blob/main/"
    "notebooks/tpu_colab.ipynb"
)


def _execute(name: str, workdir: pathlib.Path, epochs: int):
    """Runs notebooks/`name` in `workdir`; returns (stdout text, outputs)."""
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell("import sys; print(sys.executable)"))
    env = {
        k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "KERAS_BACKEND")
    }
    env.update(
        KD_NOTEBOOK_EPOCHS=str(epochs),
        KD_NOTEBOOK_OFFLINE="1",
        TF_CPP_MIN_LOG_LEVEL="3",
    )
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
    client.execute(env=env)
    outputs = [o for cell in nb.cells for o in cell.get("outputs", [])]
    text = "".join(o.get("text", "") for o in outputs if o.get("name") == "stdout")
    assert text.strip().splitlines()[-1] == sys.executable, "kernel of another Python"
    return text, outputs


def _count_png(outputs) -> int:
    return sum("image/png" in o.get("data", {}) for o in outputs)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_digits_mirrored_notebook(tmp_path):
    out, _ = _execute("digits_mirrored.ipynb", tmp_path, epochs=1)
    assert "Number of devices: 8" in out
    assert "1437 training images; global batch 128" in out
    assert re.search(r"test accuracy 0\.\d{4}", out)
    assert "kernel sharding: P(None, None, None, None) on 8 devices" in out


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


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tpu_notebook_falls_back_to_mirrored_on_cpu(tmp_path):
    out, outputs = _execute("tpu_colab.ipynb", tmp_path, epochs=2)
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


def test_committed_notebooks_carry_a_full_run():
    """Every code cell ran, without error; the plots are saved as PNG."""
    names = sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))
    assert names == [
        "custom_training_loop.ipynb",
        "digits_mirrored.ipynb",
        "finetune_llm.ipynb",
        "multi_worker.ipynb",
        "tpu_colab.ipynb",
    ]
    for name in names:
        nb = nbformat.read(NOTEBOOKS / name, as_version=4)
        nbformat.validate(nb)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), name
        outputs = [o for c in code for o in c.outputs]
        assert not [o for o in outputs if o.output_type == "error"], name
        assert "KD_NOTEBOOK_EPOCHS" in code[0].source + code[1].source, name
        if name in ("custom_training_loop.ipynb", "tpu_colab.ipynb"):
            assert _count_png(outputs) == 1, name


def test_tpu_notebook_opens_in_colab_and_installs_only_there():
    nb = nbformat.read(NOTEBOOKS / "tpu_colab.ipynb", as_version=4)
    assert COLAB_URL in nb.cells[0].source
    code = [c.source for c in nb.cells if c.cell_type == "code"]
    install = next(source for source in code if "%pip install" in source)
    assert "import google.colab" in install
    assert re.search(r"^if IN_COLAB:\n    %pip install", install, re.M)
    assert '"keras-dist[tpu]"' in install
    keras_backend = next(i for i, s in enumerate(code) if "KERAS_BACKEND" in s)
    assert keras_backend < next(i for i, s in enumerate(code) if "import keras" in s)
    strategy = next(source for source in code if "TPUClusterResolver()" in source)
    assert "except ValueError" in strategy and "kd.MirroredStrategy()" in strategy
