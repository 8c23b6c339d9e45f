"""benchmarks/memory.py runs every configuration and writes what it promises.

The quick mode on a tiny GPT-2 (hidden 16, one layer), 2 steps per
configuration, two configurations at a time, each job slot's runs in
one process (`--shared-process`): the JSON's numbers, not speed.
"""

import json

import pytest

from tests._docs import run

SHARED_PROCESS = "configurations sharing a process (--shared-process)"
CONFIGS = ["one_device", "mirrored", "zero1", "fsdp", "ps", "central_storage"]


@pytest.mark.slow
@pytest.mark.benchmarks
def test_memory_benchmark_quick_mode(tmp_path):
    args = ["--quick", "--model", "tiny", "--steps", "2", "--repeats", "1"]
    args += ["--jobs", "2", "--shared-process"]  # 2 processes for the 6 runs.
    out = run(["benchmarks/memory.py", *args, "--out", str(tmp_path)])
    payload = json.loads((tmp_path / "memory.json").read_text())
    assert payload["indicative"] == SHARED_PROCESS
    assert f"Indicative only: {SHARED_PROCESS}." in (tmp_path / "memory.md").read_text()
    rows = payload["rows"]
    assert list(rows) == CONFIGS
    for row in rows.values():
        assert "error" not in row, row
        assert len(row["ms_per_step"]) == 1 and row["ms_median"] > 0
    # The same weights, data and Adam in every configuration: the same loss.
    losses = [row["final_loss"] for row in rows.values()]
    assert max(losses) - min(losses) <= 1e-4 * max(losses)
    assert payload["analysis"]["max_loss_rel_diff"] <= 1e-4
    mirrored = rows["mirrored"]
    assert mirrored["state_bytes_per_device"] == mirrored["state_bytes"]
    assert rows["fsdp"]["state_bytes_per_device"] < mirrored["state_bytes_per_device"]
    assert rows["ps"]["state_bytes_per_device"] < mirrored["state_bytes_per_device"]
    zero1 = rows["zero1"]
    assert zero1["weight_bytes_per_device"] == mirrored["weight_bytes_per_device"]
    assert zero1["optimizer_bytes_per_device"] < mirrored["optimizer_bytes_per_device"]
    central = rows["central_storage"]
    assert central["state_bytes_per_device"] == 0
    assert central["host_bytes_per_device"] == mirrored["state_bytes"]
    assert all(isinstance(t["pass"], bool) for t in payload["analysis"]["targets"])
    assert "| target | value | result |" in out
    assert (tmp_path / "memory.md").read_text().count("| central_storage |") == 1
    assert (tmp_path / "memory.png").stat().st_size > 10_000


@pytest.mark.slow
@pytest.mark.benchmarks
def test_model_parallel_benchmark_quick_mode(tmp_path):
    configs = "one_device,mirrored_8x1,auto_2x4,hub_2x4"
    args = ["--quick", "--model", "tiny", "--configs", configs]
    args += ["--steps", "1", "--repeats", "1", "--shared-process"]
    out = run(["benchmarks/model_parallel.py", *args, "--out", str(tmp_path)])
    assert f"{SHARED_PROCESS}: indicative only, not figures to quote." in out
    payload = json.loads((tmp_path / "model_parallel_quick.json").read_text())
    assert payload["indicative"] == SHARED_PROCESS
    rows = payload["rows"]
    assert list(rows) == configs.split(",")
    for row in rows.values():
        assert "error" not in row, row
        assert row["model_flops_per_step"] > 0
    assert payload["analysis"]["max_loss_rel_diff"] <= 1e-4
    assert rows["one_device"]["communicated_bytes"] == 0
    mirrored, two_d = rows["mirrored_8x1"], rows["auto_2x4"]
    # Data parallelism all-reduces every float32 gradient once a step.
    assert mirrored["collective_bytes"]["all-reduce"] >= mirrored["weight_bytes"]
    assert two_d["mesh"] == {"batch": 2, "model": 4}
    ratio = two_d["weight_bytes_per_device"] / mirrored["weight_bytes_per_device"]
    assert 0.25 <= ratio <= 0.25 * 1.05
    assert all(t["pass"] for t in payload["analysis"]["targets"])
    assert "| hub_2x4 | (2, 4) |" in out
    assert (tmp_path / "model_parallel_quick.png").stat().st_size > 10_000
