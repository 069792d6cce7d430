"""benchmarks/bench_speed.py on small synthetic data: every part measured, the lab's runs with their exact
counts, efficiency = floor / measured, the JSON written; and its one-line refusal."""

import json

import pytest

from conftest import assert_one_line_error, run_python
from tools import synthetic_data


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bench-speed")
    # 80 train images: 40 per rank, 4 micro-batches of 10, one window of the documented 4; 20 validation images,
    # one batch per rank (the benchmark's own lines and its floor at micro-batches of 10, not the documented 50).
    synthetic_data.write_dataset(folder / "data", "image-folders", 100, 20)
    output = folder / "speed.json"
    options = ["--data-dir", folder / "data", "--windows", "1", "--repeats", "1", "--device", "cpu", "--output", output]
    options += ["--batch-size", "10"]
    result = run_python("benchmarks/bench_speed.py", *options, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    return result, json.loads(output.read_text()), folder


@pytest.mark.torchrun
def test_the_lab_runs_of_both_loaders_are_real_one_epoch_runs(bench):
    _, record, _ = bench
    assert set(record["lab_runs"]) == {"tensor", "pil"}
    for run in record["lab_runs"].values():
        assert (run["optimizer_steps"], run["gradient_syncs"]) == (1, 1)  # no_sync: one sync per window
        assert (run["train_micro_batches_per_rank"], run["validation_batches_per_rank"]) == (4, 1)
        assert (run["device"], run["world_size"]) == ("cpu", 2)
        assert run["train_seconds_per_micro_batch"] == pytest.approx(run["epoch_seconds"] / 4)
    assert record["settings"]["batch_size"] == 10


@pytest.mark.torchrun
def test_the_table_is_floor_over_measured(bench):
    result, record, _ = bench
    floor = record["floor_seconds_per_micro_batch"]
    assert set(floor) == {"train", "evaluate", "document loop", "lab loop", "lab loop without the checklist"}
    # Each part measured (what it measures is the benchmark's to print, not a test's to judge).
    assert min(floor.values()) > 0 and record["checklist_hook_seconds_per_micro_batch"] > 0
    assert record["checklist_collective_seconds_per_micro_batch"] > 0
    rows = {row["part"]: row for row in record["rows"]}
    tensor_training = rows["training, no_sync, tensor loader"]
    assert tensor_training["floor_seconds"] == floor["train"]
    assert tensor_training["measured_seconds"] == record["lab_runs"]["tensor"]["train_seconds_per_micro_batch"]
    assert rows["validation, pil loader"]["floor_seconds"] == floor["evaluate"]
    for row in record["rows"]:
        assert row["efficiency"] == pytest.approx(row["floor_seconds"] / row["measured_seconds"])
        assert f"| {row['part']} | {row['measured_seconds'] * 1000:.1f} | " in result.stdout
    assert record["decode_cache_seconds"] > 0  # the synthetic folders had no cache yet: built and timed


@pytest.mark.torchrun
def test_the_decode_cache_was_built_before_the_runs(bench):
    _, _, folder = bench
    assert len(list((folder / "data").glob(".decoded-*.npz"))) == 1


def test_a_missing_data_folder_is_one_line(tmp_path):
    empty = tmp_path / "nothing"
    empty.write_text("a file, not a dataset")
    result = run_python("benchmarks/bench_speed.py", "--data-dir", empty)
    assert_one_line_error(
        result, "bench_speed.py: error: --data-dir", "is a file; pass the folder that holds the dataset"
    )
