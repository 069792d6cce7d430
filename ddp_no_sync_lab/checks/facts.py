"""The facts verify.py checks, one function per artifact or fact, each failing with one line naming the file and
what is wrong (files.AuditError): the run record and the pair's configuration; each epoch row's counts, positions,
agreement and memory; the report, the checkpoint, the pictures' run ids, the checksums; verify.py calls them in order.
"""

import itertools
import math

from PIL import Image

from ddp_no_sync_lab import experiment
from ddp_no_sync_lab.checks import certify
from ddp_no_sync_lab.files import (
    HISTORY_FILE,
    RUN_FILES,
    RUN_RECORD_FILE,
    TASK_RUN_FILES,
    AuditError,
    check,
    describe_unfinished,
    is_int,
    is_number,
    read_json,
    require_file,
    sha256_file,
)
from ddp_no_sync_lab.precision import NUMERICS
from ddp_no_sync_lab.run import resume
from ddp_no_sync_lab.run.records import CLOCKED_SECONDS
from ddp_no_sync_lab.strategies import fsdp
from ddp_no_sync_lab.tasks.data import IMAGE_ERRORS
from ddp_no_sync_lab.tasks.image import top_confusions
from model import CLASSES, CheckpointError, load_checkpoint

COUNT_LABELS = {
    "optimizer_steps": "optimizer steps",
    "gradient_syncs": "gradient syncs",
    "sync_bucket_calls": "hook calls",
    "allreduce_bytes": "all-reduced bytes",
    "buffer_broadcast_collectives": "buffer-broadcast collectives",
    "broadcast_bytes": "broadcast bytes",
    "rebuild_broadcast_collectives": "bucket-rebuild broadcast collectives",
    "used_map_allreduces": "used-parameter-map all-reduces",
    **{name: name.replace("_", "-", 1).replace("_", " ") for name in experiment.FSDP_COUNTS},  # all-gather bytes
}
ROW_INTEGERS = ("epoch", *COUNT_LABELS)
CONFIG_COUNTS = ("world_size", "batch_size", "accum_steps", "epochs", "train_size", "validation_size", "test_size")
ROW_NUMBERS = (
    "train_loss",
    "train_accuracy",
    "validation_loss",
    "validation_accuracy",
    *CLOCKED_SECONDS,
    "epoch_seconds",
    "train_images_per_second",
    "validation_seconds",
)


def read_run_record(folder, mode):
    path = folder / RUN_RECORD_FILE
    if not path.is_file():
        unfinished = describe_unfinished(folder)
        hint = (
            f"; {'; '.join(unfinished)}: rerun train.py --mode {mode}"
            if unfinished
            else f"; run train.py --mode {mode}"
        )
        raise AuditError(f"Lipsește artefactul obligatoriu: {path}{hint}", kind="FileNotFoundError")
    record = read_json(path)
    check(isinstance(record, dict), path, "expected a JSON object")
    check(isinstance(record.get("run_id"), str), path, "no run_id")
    check(record.get("mode") == mode, path, f"expected mode={mode}, got {record.get('mode')}")
    check(isinstance(record.get("config"), dict), path, "no config")
    check(isinstance(record.get("files"), dict), path, "no files list")
    for name in RUN_FILES if record["config"].get("task") is None else TASK_RUN_FILES:  # None: the document's task
        entry = record["files"].get(name)
        check(
            isinstance(entry, dict) and is_int(entry.get("bytes")) and isinstance(entry.get("sha256"), str),
            path,
            f"does not list {name} with its size and SHA-256",
        )
    config = record["config"]
    for key in CONFIG_COUNTS:
        check(
            is_int(config.get(key)) and config[key] > 0,
            path,
            f"config {key} must be a positive whole number, got {config.get(key)!r}",
        )
    check(
        config.get("partial_window") in experiment.PARTIAL_WINDOW_POLICIES,
        path,
        f"config partial_window {config.get('partial_window')!r} is unknown",
    )
    check(
        config.get("precision") in NUMERICS,
        path,
        f"config precision {config.get('precision')!r} is neither bf16 nor fp32",
    )
    return record


# What a run records of the machines it ran on: printed, not compared (the same experiment may run each mode
# on other hardware, in the same precision).
DESCRIPTIVE_CONFIG = {"hardware"}


def compare_configs(every_record, no_sync_record, artifacts):
    every_config, no_sync_config = every_record["config"], no_sync_record["config"]
    differences = [
        f"{key}: {every_config.get(key)!r} vs {no_sync_config.get(key)!r}"
        for key in sorted((set(every_config) | set(no_sync_config)) - DESCRIPTIVE_CONFIG)
        if every_config.get(key) != no_sync_config.get(key)
    ]
    if differences:
        raise AuditError(
            f"{artifacts}/every and {artifacts}/no_sync come from different configurations ({'; '.join(differences)}); "
            f"rerun both modes with the same settings and data"
        )


# ----------------------------------------------------------------------------- one run


def check_history(path, mode, record, expected_config, sizes):
    history = read_json(path)
    check(
        isinstance(history, list) and all(isinstance(row, dict) for row in history),
        path,
        "expected a list of epoch rows",
    )
    if len(history) != expected_config["epochs"]:
        raise AuditError(f"{path}: expected {expected_config['epochs']} epochs, got {len(history)}")
    plan = experiment.epoch_plan(expected_config)
    starts = resume.wrapper_starts(path, history, len(plan))
    orders = {}  # each epoch's order of samples (its fingerprint): the epoch that read it
    for number, row in enumerate(history, start=1):
        check_finite(path, number, row)
        for key in ROW_INTEGERS:
            check(is_int(row.get(key)), path, f"epoch row {number}: {key} must be a whole number, got {row.get(key)!r}")
        for key in ROW_NUMBERS:
            check(is_number(row.get(key)), path, f"epoch row {number}: {key} must be a number, got {row.get(key)!r}")
        check(row["epoch"] == number, path, f"epoch row {number} is numbered {row['epoch']}")
        check(row.get("mode") == mode, path, f"expected mode={mode}, got {row.get('mode')}")
        check(
            row.get("run_id") == record["run_id"],
            path,
            f"epoch {number} has run id {row.get('run_id')}, run.json {record['run_id']}",
        )
        for key in ("train_accuracy", "validation_accuracy"):
            check(0 <= row[key] <= 1, path, f"epoch {number}: {key} {row[key]} is outside [0, 1]")
        expected = fsdp.epoch_counts(record["config"])(expected_config, mode, number, sizes, starts)
        # How many syncs and steps, then where they happened, then what they imply (bytes, broadcasts). Steps
        # only where the plan has them, repeated or missing, are a wrong count; anywhere else, a wrong place.
        steps_in_place = steps_at_planned_places(row, plan)
        counted = ("gradient_syncs", "optimizer_steps") if steps_in_place else ("gradient_syncs",)
        check_counts(path, number, row, {key: expected.pop(key) for key in counted}, mode)
        check_positions(path, number, row, plan, mode)
        if not steps_in_place:
            check_counts(path, number, row, {"optimizer_steps": expected.pop("optimizer_steps")}, mode)
        check_steps(path, number, row, record["config"].get("strategy") == "fsdp")
        check_shards(path, number, row, record["config"], orders)
        check_counts(path, number, row, expected, mode)
        observed = {**record["config"], **expected_config}
        certify.check_epoch(path, number, row, observed, mode, plan)
        check_memory_fields(path, number, row, record["config"])
    return history


def check_memory_fields(path, number, row, config):
    saved, peak, held = row.get("saved_activation_bytes"), row.get("peak_allocated_bytes"), row.get("held_bytes")
    on_cuda = config.get("device") == "cuda"
    peak_wanted = "a positive whole number on CUDA" if on_cuda else f"null on {config.get('device')}"
    for valid, name, wanted, value in (
        (is_int(saved) and saved > 0, "saved_activation_bytes", "a positive whole number", saved),
        (is_int(peak) and peak > 0 if on_cuda else peak is None, "peak_allocated_bytes", peak_wanted, peak),
        (
            isinstance(held, dict) and sorted(held) == ["gradients", "parameters"] and all(map(is_int, held.values())),
            "held_bytes",
            "whole numbers of gradients and parameters",
            held,
        ),
    ):
        check(valid, path, f"epoch row {number}: {name} must be {wanted}, got {value!r}")


def check_same_saved_activations(runs, artifacts):
    """One configuration, one forward: every epoch of both modes holds the same activations per micro-batch
    (no_sync changes when gradients are reduced, not what the forward keeps)."""
    reference = runs["every"][0][0]["saved_activation_bytes"]
    for mode, (history, _, _) in runs.items():
        for row in history:
            check(
                row["saved_activation_bytes"] == reference,
                artifacts / mode / HISTORY_FILE,
                f"epoch {row['epoch']} held {row['saved_activation_bytes']} bytes of activations per micro-batch, "
                f"every's epoch 1 {reference}: the same forward must hold the same",
            )


def check_finite(path, number, row):
    """Every optimizer step met only finite gradients and parameters (instruments.ranks_agree); checked before the
    row's numbers, which a diverged run fills with NaN."""
    nonfinite = row.get("first_nonfinite_step")
    if nonfinite is not None:
        check(
            isinstance(nonfinite, dict)
            and is_int(nonfinite.get("optimizer_step"))
            and isinstance(nonfinite.get("in"), list),
            path,
            f"epoch row {number}: first_nonfinite_step must be null or {{optimizer_step, in}}, got {nonfinite!r}",
        )
        raise AuditError(
            f"{path}: epoch {number}: at optimizer step {nonfinite['optimizer_step']} the "
            f"{' and '.join(map(str, nonfinite['in']))} held NaN or infinite values: the run diverged (check the "
            f"learning rate and the data)"
        )


def check_steps(path, number, row, sharded=False):
    """What every optimizer step did, from every rank's fingerprints (instruments.ranks_agree): the same gradients
    before it and the same parameters after it on every rank (FSDP's ranks hold shards: none to compare), and
    parameters it changed."""
    agreed, first = row.get("steps_with_ranks_agreed"), row.get("first_rank_disagreement")
    wanted = "null (shards: no copies to compare)" if sharded else "a whole number"
    valid = agreed is None and first is None if sharded else is_int(agreed)
    check(valid, path, f"epoch row {number}: steps_with_ranks_agreed must be {wanted}, got {agreed!r}")
    if not sharded and (first is not None or agreed != row["optimizer_steps"]):
        check(
            isinstance(first, dict) and is_int(first.get("optimizer_step")) and isinstance(first.get("differed"), list),
            path,
            f"epoch {number}: the ranks agreed at {agreed} of {row['optimizer_steps']} optimizer steps, and "
            f"first_rank_disagreement does not say where they did not ({first!r})",
        )
        differed = " and ".join(map(str, first["differed"]))
        raise AuditError(
            f"{path}: epoch {number}: at optimizer step {first['optimizer_step']} the ranks held different {differed} "
            f"(agreed at {agreed} of {row['optimizer_steps']} steps): they no longer trained one model"
        )
    changed = row.get("steps_that_changed_parameters")
    check(
        is_int(changed),
        path,
        f"epoch row {number}: steps_that_changed_parameters must be a whole number, got {changed!r}",
    )
    check(
        changed == row["optimizer_steps"],
        path,
        f"epoch {number}: {row['optimizer_steps'] - changed} of {row['optimizer_steps']} optimizer steps changed no "
        f"parameter: the optimizer did not learn from its gradients (were they lost before the step?)"
        f"{certify.item(8)}",
    )


def check_shards(path, number, row, config, orders):
    """The ranks read disjoint shards that cover the train split: DistributedSampler gives each rank
    ceil(split / world size) samples, the padding repeats, and all together read every sample once; and each
    epoch in an order of its own (`orders`: the earlier epochs' order fingerprints, this one's added)."""
    shards, split, world_size = row.get("sample_shards"), config["train_size"], config["world_size"]
    check(
        isinstance(shards, dict)
        and all(is_int(shards.get(key)) for key in ("samples_per_rank", "distinct_samples", "split_size"))
        and isinstance(shards.get("order"), str),
        path,
        f"epoch row {number}: sample_shards must hold samples_per_rank, distinct_samples, split_size and order, "
        f"got {shards!r}",
    )
    if shards["order"] in orders:
        raise AuditError(
            f"{path}: epoch {number}: the ranks read epoch {orders[shards['order']]}'s order of samples again (order "
            f"{shards['order']}): the sampler's set_epoch did not take, and every epoch repeats one order"
            f"{certify.item(2)}"
        )
    orders[shards["order"]] = number
    expected = {"samples_per_rank": math.ceil(split / world_size), "distinct_samples": split, "split_size": split}
    if {key: shards[key] for key in expected} != expected:
        raise AuditError(
            f"{path}: epoch {number}: the {world_size} ranks read {shards['samples_per_rank']} samples each, "
            f"{shards['distinct_samples']} distinct of the {split} in the train split (expected "
            f"{expected['samples_per_rank']} each, all {split} distinct): the ranks' shards overlap or miss samples "
            f"(a sampler without num_replicas and rank, or its set_epoch on one rank only?){certify.item(2)}"
        )


def check_counts(path, number, row, expected, mode):
    for key, value in expected.items():
        if row[key] != value:
            advice = ""
            if key == "gradient_syncs" and mode == "no_sync" and row[key] > value:
                advice = "; the forward ran outside no_sync() or the run used --mode every"
            raise AuditError(
                f"{path}: expected {value} {COUNT_LABELS[key]}, got {row[key]} (epoch {number}{advice})"
                f"{certify.item(COUNT_ITEMS[key]) if key in COUNT_ITEMS else ''}"
            )


# The checklist item a wrong count breaks (the others are the audit's own: DDP's buffers, buckets, maps).
COUNT_ITEMS = {"optimizer_steps": 8, "gradient_syncs": 9, "sync_bucket_calls": 9, "allreduce_bytes": 9}
POSITION_FIELDS = {"gradient_syncs": "gradient_sync_positions", "optimizer_steps": "optimizer_step_positions"}
POSITION_MESSAGES = {
    "gradient_syncs": "gradient sync {number} of the epoch ran in the backward of micro-batch {happened}; "
    "the window plan puts it in micro-batch {planned}'s",
    "optimizer_steps": "optimizer step {number} of the epoch came after micro-batch {happened}; "
    "the window plan puts it after micro-batch {planned}",
}


def steps_at_planned_places(row, plan):
    """Whether every recorded step position is one the plan has (malformed positions: no, check_positions says)."""
    try:
        recorded = set(experiment.from_progressions(row.get("optimizer_step_positions")))
    except (TypeError, ValueError):
        return False
    return recorded <= set(experiment.planned_positions(plan, "every")["optimizer_steps"])


def check_positions(path, number, row, plan, mode):
    """The micro-batches where the syncs and steps happened must be the window plan's, one by one."""
    planned = experiment.planned_positions(plan, mode)
    for key, field in POSITION_FIELDS.items():
        runs = row.get(field)
        check(
            isinstance(runs, list)
            and all(isinstance(run, list) and len(run) == 3 and all(is_int(n) for n in run) for run in runs)
            and all(0 <= start < stop <= len(plan) and step > 0 for start, stop, step in runs),
            path,
            f"epoch row {number}: {field} must be [start, stop, step] runs of micro-batch indices, got {runs!r}",
        )
        recorded = experiment.from_progressions(runs)
        if recorded == planned[key]:
            continue
        first, (happened, due) = next(
            (index, pair)
            for index, pair in enumerate(itertools.zip_longest(recorded, planned[key], fillvalue="none"))
            if pair[0] != pair[1]
        )
        message = POSITION_MESSAGES[key].format(number=first + 1, happened=happened, planned=due)
        if key == "optimizer_steps":
            broken = 7
        else:  # a sync where none was due breaks the intermediate micro-batches' item, a missing one the last's
            broken = 5 if due == "none" or (happened != "none" and happened < due) else 6
        raise AuditError(f"{path}: epoch {number}: {message}{certify.item(broken)}")


def check_report(path, mode, record):
    report = read_json(path)
    check(isinstance(report, dict), path, "expected a JSON object")
    check(report.get("mode") == mode, path, f"expected mode={mode}, got {report.get('mode')}")
    check(report.get("run_id") == record["run_id"], path, f"run id {report.get('run_id')}, run.json {record['run_id']}")
    check(report.get("config") == record["config"], path, "its config differs from run.json's")
    matrix = report.get("confusion_matrix")
    size = len(CLASSES)
    check(
        isinstance(matrix, list)
        and len(matrix) == size
        and all(
            isinstance(row, list) and len(row) == size and all(is_int(c) and c >= 0 for c in row) for row in matrix
        ),
        path,
        f"confusion_matrix must be {size}x{size} non-negative whole numbers",
    )
    total = sum(map(sum, matrix))
    test_size = record["config"].get("test_size")
    check(total == test_size, path, f"the confusion matrix counts {total} test images, the run had {test_size}")
    for key in ("model_test_loss", "model_test_accuracy", "baseline_accuracy"):
        check(is_number(report.get(key)), path, f"{key} must be a number, got {report.get(key)!r}")
    accuracy = sum(matrix[i][i] for i in range(size)) / total
    check(
        math.isclose(report["model_test_accuracy"], accuracy, abs_tol=1e-9),
        path,
        f"model_test_accuracy {report['model_test_accuracy']} differs from its confusion matrix ({accuracy})",
    )
    check(
        report.get("baseline_class") in CLASSES, path, f"baseline_class {report.get('baseline_class')!r} is not a class"
    )
    baseline = sum(matrix[CLASSES.index(report["baseline_class"])]) / total
    check(
        math.isclose(report["baseline_accuracy"], baseline, abs_tol=1e-9),
        path,
        f"baseline_accuracy {report['baseline_accuracy']} differs from its confusion matrix ({baseline})",
    )
    check(
        report.get("top_confusions") == top_confusions(matrix), path, "top_confusions differ from its confusion matrix"
    )
    return report


def check_model(path, mode, record, training_forwards):
    require_file(path)
    try:
        _, checkpoint = load_checkpoint(path)
    except CheckpointError as error:
        raise AuditError(str(error)) from None
    check(
        checkpoint.get("run_id") == record["run_id"],
        path,
        f"run id {checkpoint.get('run_id')}, run.json {record['run_id']}",
    )
    check(checkpoint.get("mode") == mode, path, f"expected mode={mode}, got {checkpoint.get('mode')}")
    # Rank 0's BatchNorm layers (DDP broadcasts rank 0's buffers, never into rank 0) count one update per
    # training forward; more means their statistics were updated twice, as a recomputation can do.
    for name, value in checkpoint["model"].items():
        if name.endswith("num_batches_tracked"):
            check(
                value.item() == training_forwards,
                path,
                f"{name.removesuffix('.num_batches_tracked')} counted {value.item()} BatchNorm updates, the run had "
                f"{training_forwards} training forwards: its running statistics were updated "
                f"{'more than once per forward (a recomputation that updates them again?)' if value.item() > training_forwards else 'too rarely'}",
            )


def check_png(path, record, size=None):
    require_file(path)
    try:
        with Image.open(path) as image:
            image.load()
            image_format, image_size, text = image.format, image.size, dict(getattr(image, "text", {}))
    except IMAGE_ERRORS as error:
        raise AuditError(f"{path}: not a readable PNG ({error}); rerun train.py") from None
    check(image_format == "PNG", path, f"expected a PNG, got {image_format}")
    if size is not None:
        check(image_size == size, path, f"expected {size[0]}x{size[1]} pixels, got {image_size[0]}x{image_size[1]}")
    check(text.get("run_id") == record["run_id"], path, f"run id {text.get('run_id')}, run.json {record['run_id']}")


def check_checksums(folder, record):
    for name, expected in record["files"].items():
        path = folder / name
        require_file(path)
        check(
            path.stat().st_size == expected.get("bytes") and sha256_file(path) == expected.get("sha256"),
            path,
            f"changed after the run finished (size or SHA-256 differs from {RUN_RECORD_FILE}); rerun train.py",
        )
