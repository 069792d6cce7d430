"""The model's facts and the arithmetic of the audit, checked against numbers worked out by hand."""

import json

import pytest
import torch

from ddp_no_sync_lab import cli, experiment, files
from ddp_no_sync_lab.tasks import image
from model import CIFAR10_MEAN, CIFAR10_STD, CLASSES, CifarCNN

# Worked out by hand from the layer shapes (see model.py): the document's 445,834 is wrong.
PARAMETERS = 1_728 + 36_864 + 73_728 + 147_456 + 294_912 + 1_280 + 2_570
GRADIENT_BYTES = PARAMETERS * 4  # float32 gradients
# BatchNorm buffers: running mean and variance (float32) of 64+64+128+128+256 channels, and one int64
# num_batches_tracked per layer.
BUFFER_BYTES = 2 * (64 + 64 + 128 + 128 + 256) * 4 + 5 * 8


def test_model_output_shape_and_true_parameter_count():
    model = CifarCNN()
    output = model(torch.zeros(2, 3, 32, 32))
    assert tuple(output.shape) == (2, 10)
    assert sum(p.numel() for p in model.parameters()) == PARAMETERS == 558_538


def test_class_names_and_normalization_are_the_documents():
    assert CLASSES == ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
    assert CIFAR10_MEAN == (0.4914, 0.4822, 0.4465)
    assert CIFAR10_STD == (0.2470, 0.2435, 0.2616)


def test_communication_sizes_fit_one_bucket():
    sizes = experiment.comm_sizes(CifarCNN())
    assert (sizes.gradient_bytes, sizes.buffer_bytes, sizes.buffer_dtype_groups) == (GRADIENT_BYTES, BUFFER_BYTES, 2)
    assert GRADIENT_BYTES < 25 * 1024 * 1024 and sizes.gradient_buckets(25) == 1


def test_bucket_counts_follow_ddps_filling_order():
    """DDP fills a bucket until it holds the cap or more. Its rebuilt buckets take the gradients in reverse order
    of the parameters: classifier bias 40 and weight 10,240, the last BatchNorm's 1,024 + 1,024, the last conv's
    1,179,648, then 512 + 512 + 589,824, ...; searching for unused parameters it starts with buckets filled in
    the parameters' order: 6,912, 256 + 256, 147,456, ..."""
    sizes = experiment.comm_sizes(CifarCNN())
    assert sizes.gradient_tensor_bytes[:4] == (6_912, 256, 256, 147_456)
    assert sizes.gradient_tensor_bytes[-5:] == (1_179_648, 1_024, 1_024, 10_240, 40)
    # 1 MiB: the last five (1,191,976 bytes) close bucket 1; the other 1,042,176 bytes stay under the cap.
    assert sizes.gradient_buckets(1) == 2
    # 0.5 MiB: the last five; then 512 + 512 + 589,824; then the remaining 451,328 bytes.
    assert sizes.gradient_buckets(0.5) == 3
    # 0.99 MiB (1,038,090 bytes): backward, 1,191,976 then 1,042,176 bytes; forward, the first ten tensors make
    # 1,041,152 bytes, then 512 + 512 + 1,179,648, then the last four.
    assert (sizes.gradient_buckets(0.99), sizes.gradient_buckets(0.99, "forward")) == (2, 3)
    assert sizes.gradient_buckets(0) == 17  # a cap of 0: each tensor its own bucket
    assert sizes.sent_bytes("allreduce") == GRADIENT_BYTES and sizes.sent_bytes("bf16") == GRADIENT_BYTES // 2


def test_documented_experiment_counts():
    """400 micro-batches per rank and epoch: 100 steps; 400 syncs in every, 100 in no_sync."""
    assert experiment.micro_batches_per_rank(40_000, 2, 50) == 400
    sizes = experiment.comm_sizes(CifarCNN())
    for epoch, every_buffer_syncs, no_sync_buffer_syncs in ((1, 401, 101), (2, 400, 100), (5, 400, 100)):
        every = experiment.expected_epoch_counts(experiment.DOCUMENTED, "every", epoch, sizes)
        no_sync = experiment.expected_epoch_counts(experiment.DOCUMENTED, "no_sync", epoch, sizes)
        assert every == {
            "optimizer_steps": 100,
            "gradient_syncs": 400,
            "sync_bucket_calls": 400,
            "allreduce_bytes": 400 * GRADIENT_BYTES,
            "buffer_broadcast_collectives": 2 * every_buffer_syncs,
            "broadcast_bytes": every_buffer_syncs * BUFFER_BYTES,
            "rebuild_broadcast_collectives": 2 if epoch == 1 else 0,
            "used_map_allreduces": 0,
            "witness_allreduces": 100,
            **dict.fromkeys(experiment.FSDP_COUNTS, 0),  # DDP makes none of FSDP's collectives
        }
        assert no_sync == {
            "optimizer_steps": 100,
            "gradient_syncs": 100,
            "sync_bucket_calls": 100,
            "allreduce_bytes": 100 * GRADIENT_BYTES,
            "buffer_broadcast_collectives": 2 * no_sync_buffer_syncs,
            "broadcast_bytes": no_sync_buffer_syncs * BUFFER_BYTES,
            "rebuild_broadcast_collectives": 2 if epoch == 1 else 0,
            "used_map_allreduces": 0,
            "witness_allreduces": 100,
            **dict.fromkeys(experiment.FSDP_COUNTS, 0),  # DDP makes none of FSDP's collectives
        }


def test_window_plan_syncs_and_steps_on_the_last_micro_batch_of_each_window():
    plan = experiment.window_plan(8, 4, "error")
    assert [(m.sync, m.loss_divisor, m.step) for m in plan] == [(False, 4, False)] * 3 + [(True, 4, True)] + [
        (False, 4, False)
    ] * 3 + [(True, 4, True)]


def test_partial_window_stops_with_the_documents_message():
    with pytest.raises(cli.LabError) as caught:
        experiment.window_plan(401, 4, "error")
    assert caught.value.line("train.py").startswith(
        "RuntimeError: 401 micro-batch-uri nu se împart exact la accum_steps=4"
    )
    assert "--partial-window scale" in str(caught.value)


def test_partial_window_scale_divides_the_short_window_by_its_length():
    plan = experiment.window_plan(6, 4, "scale")
    assert [(m.sync, m.loss_divisor, m.step) for m in plan] == [
        (False, 4, False),
        (False, 4, False),
        (False, 4, False),
        (True, 4, True),
        (False, 2, False),
        (True, 2, True),
    ]
    config = {**experiment.DOCUMENTED, "train_size": 1_200, "batch_size": 100, "partial_window": "scale"}
    counts = experiment.expected_epoch_counts(config, "no_sync", 1, experiment.comm_sizes(CifarCNN()))
    assert (counts["optimizer_steps"], counts["gradient_syncs"]) == (2, 2)


def test_buffer_broadcasts_follow_synchronized_forwards():
    """Before the first forward, then before each forward that follows a synchronized one; the
    validation pass adds one; an epoch after an evaluation starts without one."""
    plan = experiment.window_plan(8, 4, "error")
    assert experiment.buffer_syncs_in_epoch(plan, "every", first_epoch=True) == 8 + 1
    assert experiment.buffer_syncs_in_epoch(plan, "every", first_epoch=False) == 7 + 1
    assert experiment.buffer_syncs_in_epoch(plan, "no_sync", first_epoch=True) == 2 + 1
    assert experiment.buffer_syncs_in_epoch(plan, "no_sync", first_epoch=False) == 1 + 1


def test_bucket_rebuild_happens_at_the_first_training_forward_after_a_sync():
    assert experiment.bucket_rebuild_epoch(experiment.window_plan(8, 4, "error"), "no_sync") == 1
    assert experiment.bucket_rebuild_epoch(experiment.window_plan(2, 1, "error"), "every") == 1
    # One window per epoch: no_sync's first sync is the epoch's last forward; the rebuild waits for epoch 2.
    assert experiment.bucket_rebuild_epoch(experiment.window_plan(4, 4, "error"), "no_sync") == 2
    assert experiment.bucket_rebuild_epoch(experiment.window_plan(4, 4, "error"), "every") == 1


def test_run_folder_publishes_all_at_once_and_clears_stale_partials(tmp_path):
    output = tmp_path / "every"
    output.mkdir()
    (output / files.HISTORY_FILE).write_text("[] (the previous run)")
    stale = tmp_path / ".every.partial-killedrun"
    stale.mkdir()
    folder = files.RunFolder(output, "newrun", files.utc_now())
    folder.begin()
    assert not stale.exists() and folder.partial.is_dir()
    folder.write(files.HISTORY_FILE, b"[]\n")
    assert (output / files.HISTORY_FILE).read_text() == "[] (the previous run)"  # untouched until published
    folder.publish({"run_id": "newrun"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["every"]  # no partial or replaced folder left
    record = json.loads((output / files.RUN_RECORD_FILE).read_text())
    assert record["run_id"] == "newrun"
    assert record["files"][files.HISTORY_FILE]["sha256"] == files.sha256_file(output / files.HISTORY_FILE)


def test_top_confusions_are_off_diagonal_by_count_then_class_order():
    matrix = [[0] * 10 for _ in range(10)]
    matrix[0][0] = 50
    matrix[3][5] = 7
    matrix[5][3] = 7
    matrix[1][9] = 9
    assert image.top_confusions(matrix) == [
        {"true": "automobile", "predicted": "truck", "count": 9},
        {"true": "cat", "predicted": "dog", "count": 7},
        {"true": "dog", "predicted": "cat", "count": 7},
    ]
