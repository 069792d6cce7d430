"""DDP's other levers under the audit: train.py's DDP options and --comm-hook, with counts derived from the
setting (experiment.expected_epoch_counts) and checked against what really happened; benchmarks/
bench_ddp_settings.py's matrix once on small data; the one-line refusal of a combination torch breaks."""

import json
import shutil

import pytest
import torch

from conftest import (
    assert_ok,
    assert_one_line_error,
    assert_train_error,
    copy_runs,
    read_json,
    run_python,
    train,
    verify,
)
from ddp_no_sync_lab import experiment, files
from model import CifarCNN

GRADIENT_BYTES = 558_538 * 4
SIZES = experiment.comm_sizes(CifarCNN())


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    """Each lever alone, both modes: 2 windows of 4 micro-batches of 4 per rank, float32."""
    output = tmp_path_factory.mktemp("ddp-settings") / "ddp_settings.json"
    options = ["--windows", "2", "--batch-size", "4", "--precision", "fp32", "--output", output]
    result = run_python("benchmarks/bench_ddp_settings.py", *options, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    record = json.loads(output.read_text())
    rows = {(row["setting"], row["mode"]): row for row in record["rows"]}
    return rows, record, result.stdout


@pytest.mark.torchrun
def test_every_setting_counts_what_its_derivation_says_and_the_witness_saw(matrix):
    rows, _, _ = matrix
    for (setting, mode), row in rows.items():
        if "refused" in row:
            continue
        assert row["counts"] == row["expected"], (setting, mode)
        assert row["counts"]["allreduce_bytes"] == row["witnessed_allreduce_bytes"], (setting, mode)
        syncs = 8 if mode == "every" else 2  # 8 micro-batches in windows of 4
        assert row["counts"]["gradient_syncs"] == syncs, (setting, mode)


@pytest.mark.torchrun
def test_each_lever_changes_exactly_its_own_counts(matrix):
    rows, _, _ = matrix
    for mode, syncs in (("every", 8), ("no_sync", 2)):
        documented = rows["documented", mode]["counts"]
        assert documented["sync_bucket_calls"] == syncs and documented["allreduce_bytes"] == syncs * GRADIENT_BYTES
        # 0.5 MiB buckets: three per sync (tests/test_model_and_counts.py works them out), but for the first,
        # which DDP all-reduces in one bucket before it rebuilds them.
        assert rows["bucket_cap_mb=0.5", mode]["counts"] == {**documented, "sync_bucket_calls": 1 + 3 * (syncs - 1)}
        # No buffer broadcast by DDP; one by the evaluation, of both dtypes (float32 statistics, int64 counters).
        assert rows["broadcast_buffers=False", mode]["counts"] == {
            **documented,
            "buffer_broadcast_collectives": 2,
            "broadcast_bytes": SIZES.buffer_bytes,
        }
        for hook in ("bf16", "fp16"):  # half the bytes: 2 per gradient element
            assert rows[f"comm_hook={hook}", mode]["counts"] == {
                **documented,
                "allreduce_bytes": syncs * GRADIENT_BYTES // 2,
            }
        assert rows["gradient_as_bucket_view=True", mode]["counts"] == documented
        # Searching for unused parameters: no bucket rebuild, and DDP's all-reduce of the used-parameter map at
        # every sync.
        assert rows["find_unused_parameters=True", mode]["counts"] == {
            **documented,
            "rebuild_broadcast_collectives": 0,
            "used_map_allreduces": syncs,
        }
    # A static graph all-reduces the map once, at its first sync.
    assert rows["static_graph=True", "every"]["counts"] == {
        **rows["documented", "every"]["counts"],
        "used_map_allreduces": 1,
    }


@pytest.mark.torchrun
def test_levers_that_do_not_touch_the_numbers_train_the_same_weights_bit_for_bit(matrix):
    """Bucketing, the search for unused parameters, gradients as bucket views and a static graph change how
    DDP all-reduces, not what; without broadcast_buffers rank 0's BatchNorm statistics are its own either way."""
    rows, _, _ = matrix
    same = [
        "bucket_cap_mb=0.5",
        "broadcast_buffers=False",
        "find_unused_parameters=True",
        "gradient_as_bucket_view=True",
    ]
    for mode in experiment.MODES:
        for setting in same:
            assert rows[setting, mode]["weights_equal_documented"] is True, (setting, mode)
            assert rows[setting, mode]["largest_weight_difference"] == 0
    assert rows["static_graph=True", "every"]["weights_equal_documented"] is True


@pytest.mark.torchrun
def test_compression_changes_the_gradients_by_its_rounding_and_no_more(matrix):
    rows, record, stdout = matrix
    for hook, unit_roundoff in (("bf16", 2**-8), ("fp16", 2**-11)):
        measured = record["compression"][hook]
        # Each rank's gradient is rounded once to 16 bits before the sum and the mean once after: a few units of
        # the format's rounding, relative to the gradients' size (fp16's small values lose more: subnormals).
        assert 0 < measured["relative_difference"] < 4 * unit_roundoff, (hook, measured)
        for mode in experiment.MODES:
            row = rows[f"comm_hook={hook}", mode]
            assert row["weights_equal_documented"] is False and 0 < row["largest_weight_difference"] < 0.05
        assert f"| {hook} | {measured['relative_difference']:.2e} |" in stdout


@pytest.mark.torchrun
def test_static_graph_inside_no_sync_is_refused_with_one_line(matrix):
    """torch 2.8's reducer fails an internal assert at the first backward inside no_sync() with
    static_graph=True (pytorch/pytorch#143580): one line naming the option, the torch version and the issue."""
    rows, _, stdout = matrix
    line = rows["static_graph=True", "no_sync"]["refused"]
    assert line.startswith("RuntimeError: --static-graph with no_sync(): DDP failed")
    assert f"on torch {torch.__version__} (pytorch/pytorch#143580)" in line and line in stdout


def test_train_py_records_its_levers_and_verify_audits_them(levers_runs, tmp_path):
    """Both modes with three levers at once (conftest.DDP_LEVERS), audited against their own configuration; a pair
    whose hooks differ and the strict audit both name the lever."""
    artifacts = copy_runs(levers_runs, tmp_path / "artifacts")  # verify.py draws beside the runs it passes
    config = read_json(artifacts / "every" / files.RUN_RECORD_FILE)["config"]
    assert {name: config[name] for name in experiment.DDP_DEFAULTS} == {
        **experiment.DDP_DEFAULTS,
        "comm_hook": "bf16",
        "bucket_cap_mb": 0.5,
        "broadcast_buffers": False,
    }
    rows = read_json(artifacts / "no_sync" / files.HISTORY_FILE)
    # 0.5 MiB buckets: 3 per sync but for the run's first, in one bucket before DDP rebuilds them.
    assert [(row["gradient_syncs"], row["sync_bucket_calls"], row["allreduce_bytes"]) for row in rows] == [
        (5, 1 + 4 * 3, 5 * GRADIENT_BYTES // 2),
        (5, 5 * 3, 5 * GRADIENT_BYTES // 2),
    ]
    assert [row["buffer_broadcast_collectives"] for row in rows] == [2, 2]
    assert_ok(verify(artifacts))
    mixed = tmp_path / "mixed"
    shutil.copytree(artifacts, mixed)
    run_record = mixed / "no_sync" / files.RUN_RECORD_FILE
    record = read_json(run_record)
    record["config"]["comm_hook"] = "fp16"
    run_record.write_text(json.dumps(record))
    assert_one_line_error(verify(mixed), "come from different configurations (comm_hook: 'bf16' vs 'fp16')", code=1)


@pytest.mark.torchrun
def test_static_graph_with_no_sync_stops_train_py_with_one_line(image_data, tmp_path):
    result = train(image_data, tmp_path / "out", "no_sync", "--static-graph", "--epochs", "1", "--quiet")
    assert_train_error(result, "RuntimeError: --static-graph with no_sync(): DDP failed", "pytorch/pytorch#143580")
