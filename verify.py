"""Audit the artifacts of both runs; print the table and `AUDIT PASSED` only when every check held.

    python verify.py                                                   # the documented experiment
    python verify.py --artifacts artifacts/quick --expect-from-config  # a run judged by its own configuration

Without --expect-from-config the audit is the document's: 5 epochs, 100 optimizer steps and 400 (every) or
100 (no_sync) gradient syncs per epoch. With it, the expected counts are recomputed from the configuration
the runs recorded. Either way the all-reduced bytes and DDP's buffer broadcasts are recomputed from the
model's parameter and buffer sizes, both runs must share one configuration (only the mode may differ), every
file must carry its run's id and match the checksum the run recorded, and the reports must agree with their
own confusion matrices. A run profiled with train.py --profile-windows K must show the profiler's c10d calls
equal to the audit's in the profiled windows, rank by rank. A failure is one line naming the file and what is
wrong (exit 1). On success it also draws curves.png and communication.png next to the run folders, and
timeline.png when both runs were profiled.
"""
import itertools
import json
import math
from pathlib import Path

from PIL import Image

import lab
import plots
from model import CLASSES, CheckpointError, CifarCNN, IMAGE_SIZE, load_checkpoint
from precision import NUMERICS

SCRIPT = "verify.py"
COUNT_LABELS = {
    "optimizer_steps": "optimizer steps",
    "gradient_syncs": "gradient syncs",
    "sync_bucket_calls": "hook calls",
    "allreduce_bytes": "all-reduced bytes",
    "buffer_broadcast_collectives": "buffer-broadcast collectives",
    "broadcast_bytes": "broadcast bytes",
    "rebuild_broadcast_collectives": "bucket-rebuild broadcast collectives",
}
ROW_INTEGERS = ("epoch", *COUNT_LABELS)
CONFIG_COUNTS = ("world_size", "batch_size", "accum_steps", "epochs", "train_size", "validation_size", "test_size")
ROW_NUMBERS = (
    "train_loss",
    "train_accuracy",
    "validation_loss",
    "validation_accuracy",
    "comm_seconds",
    "epoch_seconds",
    "train_images_per_second",
    "validation_seconds",
)


class AuditError(lab.LabError):
    """An artifact that does not hold what it must (exit 1; a usage mistake exits 2)."""

    exit_code = 1

    def __init__(self, message, kind="RuntimeError"):
        super().__init__(message, kind)


def parse_args():
    parser = lab.ArgumentParser(prog=SCRIPT, description="Audit the artifacts of the every and no_sync runs.")
    parser.add_argument("--artifacts", type=Path, default=Path("artifacts"), help="folder holding every/ and no_sync/")
    parser.add_argument(
        "--expect-from-config",
        action="store_true",
        help="expect the counts the runs' own recorded configuration implies, not the documented 5/100/400/100",
    )
    return parser.parse_args()


# ----------------------------------------------------------------------------- reading


def require_file(path):
    if not path.is_file():
        raise AuditError(f"Lipsește artefactul obligatoriu: {path}", kind="FileNotFoundError")
    if path.stat().st_size == 0:
        raise AuditError(f"Artefact absent sau gol: {path} (it is empty; rerun train.py)")


def read_json(path):
    require_file(path)
    try:
        return json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise AuditError(f"{path}: not valid JSON ({error}); the file is damaged or truncated: rerun train.py") from None


def is_int(value):
    return type(value) is int


def is_number(value):
    return type(value) in (int, float) and math.isfinite(value)


def check(condition, path, message):
    if not condition:
        raise AuditError(f"{path}: {message}")


def describe_unfinished(folder):
    """Say what an interrupted run left beside `folder`, if anything (lab.RunFolder explains the names)."""
    notes = []
    for partial in lab.unfinished_runs(folder):
        run_id = partial.name.rsplit(".partial-", 1)[-1]
        if (partial / lab.RUN_RECORD_FILE).is_file():
            notes.append(f"run {run_id} finished but was interrupted while being moved into place; it lies complete in {partial}")
        else:
            notes.append(f"an unfinished run {run_id} was left in {partial} (interrupted before it finished)")
    for replaced in lab.replaced_runs(folder):
        run_id = replaced.name.rsplit(".replaced-", 1)[-1]
        notes.append(f"the run that run {run_id} replaced was left in {replaced} (interrupted while being removed)")
    return notes


def read_run_record(folder, mode):
    path = folder / lab.RUN_RECORD_FILE
    if not path.is_file():
        unfinished = describe_unfinished(folder)
        hint = f"; {'; '.join(unfinished)}: rerun train.py --mode {mode}" if unfinished else f"; run train.py --mode {mode}"
        raise AuditError(f"Lipsește artefactul obligatoriu: {path}{hint}", kind="FileNotFoundError")
    record = read_json(path)
    check(isinstance(record, dict), path, "expected a JSON object")
    check(isinstance(record.get("run_id"), str), path, "no run_id")
    check(record.get("mode") == mode, path, f"expected mode={mode}, got {record.get('mode')}")
    check(isinstance(record.get("config"), dict), path, "no config")
    check(isinstance(record.get("files"), dict), path, "no files list")
    for name in lab.RUN_FILES:
        entry = record["files"].get(name)
        check(
            isinstance(entry, dict) and is_int(entry.get("bytes")) and isinstance(entry.get("sha256"), str),
            path,
            f"does not list {name} with its size and SHA-256",
        )
    config = record["config"]
    for key in CONFIG_COUNTS:
        check(is_int(config.get(key)) and config[key] > 0, path, f"config {key} must be a positive whole number, got {config.get(key)!r}")
    check(config.get("partial_window") in lab.PARTIAL_WINDOW_POLICIES, path, f"config partial_window {config.get('partial_window')!r} is unknown")
    check(config.get("precision") in NUMERICS, path, f"config precision {config.get('precision')!r} is neither bf16 nor fp32")
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


def check_history(path, mode, record, expected_config, sizes, hint):
    history = read_json(path)
    check(isinstance(history, list) and all(isinstance(row, dict) for row in history), path, "expected a list of epoch rows")
    if len(history) != expected_config["epochs"]:
        raise AuditError(f"{path}: expected {expected_config['epochs']} epochs, got {len(history)}{hint}")
    for number, row in enumerate(history, start=1):
        for key in ROW_INTEGERS:
            check(is_int(row.get(key)), path, f"epoch row {number}: {key} must be a whole number, got {row.get(key)!r}")
        for key in ROW_NUMBERS:
            check(is_number(row.get(key)), path, f"epoch row {number}: {key} must be a number, got {row.get(key)!r}")
        check(row["epoch"] == number, path, f"epoch row {number} is numbered {row['epoch']}")
        check(row.get("mode") == mode, path, f"expected mode={mode}, got {row.get('mode')}")
        check(row.get("run_id") == record["run_id"], path, f"epoch {number} has run id {row.get('run_id')}, run.json {record['run_id']}")
        for key in ("train_accuracy", "validation_accuracy"):
            check(0 <= row[key] <= 1, path, f"epoch {number}: {key} {row[key]} is outside [0, 1]")
        expected = lab.expected_epoch_counts(expected_config, mode, number, sizes)
        # How many syncs and steps, then where they happened, then what they imply (bytes, broadcasts).
        check_counts(path, number, row, {key: expected.pop(key) for key in POSITION_FIELDS}, mode, hint)
        check_positions(path, number, row, lab.epoch_plan(expected_config), mode, hint)
        check_rank_agreement(path, number, row)
        check_counts(path, number, row, expected, mode, hint)
        check_memory_fields(path, number, row, record["config"])
    return history


def check_memory_fields(path, number, row, config):
    saved, peak = row.get("saved_activation_bytes"), row.get("peak_allocated_bytes")
    check(is_int(saved) and saved > 0, path, f"epoch row {number}: saved_activation_bytes must be a positive whole number, got {saved!r}")
    if config.get("device") == "cuda":
        check(is_int(peak) and peak > 0, path, f"epoch row {number}: peak_allocated_bytes must be a positive whole number on CUDA, got {peak!r}")
    else:
        check(peak is None, path, f"epoch row {number}: peak_allocated_bytes must be null on {config.get('device')}, got {peak!r}")


def check_same_saved_activations(runs, artifacts):
    """One configuration, one forward: every epoch of both modes holds the same activations per micro-batch
    (no_sync changes when gradients are reduced, not what the forward keeps)."""
    reference = runs["every"][0][0]["saved_activation_bytes"]
    for mode, (history, _, _) in runs.items():
        for row in history:
            check(
                row["saved_activation_bytes"] == reference,
                artifacts / mode / lab.HISTORY_FILE,
                f"epoch {row['epoch']} held {row['saved_activation_bytes']} bytes of activations per micro-batch, "
                f"every's epoch 1 {reference}: the same forward must hold the same",
            )


def check_rank_agreement(path, number, row):
    """At every optimizer step all ranks must have held the same gradients before it and the same
    parameters after it (train.ranks_agree compares float64 fingerprints across the ranks)."""
    agreed, first = row.get("steps_with_ranks_agreed"), row.get("first_rank_disagreement")
    check(is_int(agreed), path, f"epoch row {number}: steps_with_ranks_agreed must be a whole number, got {agreed!r}")
    if first is None and agreed == row["optimizer_steps"]:
        return
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


def check_counts(path, number, row, expected, mode, hint):
    for key, value in expected.items():
        if row[key] != value:
            advice = ""
            if key == "gradient_syncs" and mode == "no_sync" and row[key] > value:
                advice = "; the forward ran outside no_sync() or the run used --mode every"
            raise AuditError(f"{path}: expected {value} {COUNT_LABELS[key]}, got {row[key]} (epoch {number}{advice}){hint}")


POSITION_FIELDS = {"gradient_syncs": "gradient_sync_positions", "optimizer_steps": "optimizer_step_positions"}
POSITION_MESSAGES = {
    "gradient_syncs": "gradient sync {number} of the epoch ran in the backward of micro-batch {happened}; "
    "the window plan puts it in micro-batch {planned}'s",
    "optimizer_steps": "optimizer step {number} of the epoch came after micro-batch {happened}; "
    "the window plan puts it after micro-batch {planned}",
}


def check_positions(path, number, row, plan, mode, hint):
    """The micro-batches where the syncs and steps happened must be the window plan's, one by one."""
    planned = lab.planned_positions(plan, mode)
    for key, field in POSITION_FIELDS.items():
        runs = row.get(field)
        check(
            isinstance(runs, list)
            and all(isinstance(run, list) and len(run) == 3 and all(is_int(n) for n in run) for run in runs)
            and all(0 <= start < stop <= len(plan) and step > 0 for start, stop, step in runs),
            path,
            f"epoch row {number}: {field} must be [start, stop, step] runs of micro-batch indices, got {runs!r}",
        )
        recorded = lab.from_progressions(runs)
        if recorded == planned[key]:
            continue
        first, (happened, due) = next(
            (index, pair) for index, pair in enumerate(itertools.zip_longest(recorded, planned[key], fillvalue="none"))
            if pair[0] != pair[1]
        )
        message = POSITION_MESSAGES[key].format(number=first + 1, happened=happened, planned=due)
        raise AuditError(f"{path}: epoch {number}: {message}{hint}")


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
        and all(isinstance(row, list) and len(row) == size and all(is_int(c) and c >= 0 for c in row) for row in matrix),
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
    check(report.get("baseline_class") in CLASSES, path, f"baseline_class {report.get('baseline_class')!r} is not a class")
    baseline = sum(matrix[CLASSES.index(report["baseline_class"])]) / total
    check(
        math.isclose(report["baseline_accuracy"], baseline, abs_tol=1e-9),
        path,
        f"baseline_accuracy {report['baseline_accuracy']} differs from its confusion matrix ({baseline})",
    )
    check(report.get("top_confusions") == lab.top_confusions(matrix), path, "top_confusions differ from its confusion matrix")
    return report


def check_model(path, mode, record, training_forwards):
    require_file(path)
    try:
        _, checkpoint = load_checkpoint(path)
    except CheckpointError as error:
        raise AuditError(str(error)) from None
    check(checkpoint.get("run_id") == record["run_id"], path, f"run id {checkpoint.get('run_id')}, run.json {record['run_id']}")
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
    except (OSError, SyntaxError, ValueError) as error:
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
            path.stat().st_size == expected.get("bytes") and lab.sha256_file(path) == expected.get("sha256"),
            path,
            f"changed after the run finished (size or SHA-256 differs from {lab.RUN_RECORD_FILE}); rerun train.py",
        )


# ----------------------------------------------------------------------------- the profiler's witness


def in_range(runs, first, stop):
    return sum(first <= position < stop for position in lab.from_progressions(runs))


def check_profile(folder, record, history):
    """train.py --profile-windows K: the profiler's c10d calls in the recorded micro-batches of epoch 1 must
    be the audit's for the same micro-batches, on every rank: each hook call and each rank-agreement
    all-reduce (one per optimizer step) a c10d::allreduce_, each buffer or bucket-rebuild broadcast a
    c10d::broadcast_; on gloo each call also executed once. Returns the profile, or None without one."""
    path = folder / lab.PROFILE_FILE
    if lab.PROFILE_FILE not in record["files"]:
        check(not path.exists(), path, f"is not listed in {lab.RUN_RECORD_FILE}: it does not come from this run")
        return None
    profile = read_json(path)
    config = record["config"]
    accum_steps = config["accum_steps"]
    windows = profile.get("windows") if isinstance(profile, dict) else None
    check(is_int(windows) and windows > 0, path, f"windows must be a positive whole number, got {windows!r}")
    span = [2 * accum_steps, (2 + windows) * accum_steps]
    check(profile.get("micro_batches") == span, path, f"micro_batches must be {span} for {windows} windows of {accum_steps}")
    ranks = profile.get("ranks")
    check(
        isinstance(ranks, list)
        and [summary.get("rank") if isinstance(summary, dict) else None for summary in ranks] == list(range(config["world_size"])),
        path,
        f"expected one summary per rank, ranks 0 to {config['world_size'] - 1}",
    )
    first, stop = span
    steps = in_range(history[0]["optimizer_step_positions"], first, stop)
    syncs = in_range(history[0]["gradient_sync_positions"], first, stop)
    where = f"epoch 1, micro-batches {first}-{stop - 1}"
    for summary in ranks:
        rank = summary["rank"]
        audit, calls, executions = (summary.get(key) for key in ("audit", "calls", "executions"))
        check(
            all(isinstance(part, dict) for part in (audit, calls, executions))
            and all(is_int(audit.get(key)) for key in COUNT_LABELS if key != "optimizer_steps")
            and all(is_int(part.get(name)) for part in (calls, executions) for name in PROFILED_CALLS),
            path,
            f"rank {rank}: calls, executions and audit must hold whole-number counts",
        )
        check_profile_spans(path, rank, summary)
        check(
            audit["gradient_syncs"] == syncs,
            path,
            f"rank {rank}: the audit counted {audit['gradient_syncs']} gradient syncs in {where}, the history's "
            f"positions put {syncs} there",
        )
        expected = {
            "c10d::allreduce_": (audit["sync_bucket_calls"] + steps, f"{audit['sync_bucket_calls']} hook calls + {steps} rank-agreement all-reduces"),
            "c10d::broadcast_": (
                audit["buffer_broadcast_collectives"] + audit["rebuild_broadcast_collectives"],
                f"{audit['buffer_broadcast_collectives']} buffer-broadcast + {audit['rebuild_broadcast_collectives']} bucket-rebuild collectives",
            ),
        }
        for name, (count, made_of) in expected.items():
            check(
                calls[name] == count,
                path,
                f"rank {rank}: the profiler saw {calls[name]} {name} calls in {where}, the audit counted {made_of} = "
                f"{count}: the audit and its witness disagree",
            )
            if config.get("backend") == "gloo":
                check(
                    executions[name] == calls[name],
                    path,
                    f"rank {rank}: {calls[name]} {name} calls but {executions[name]} executions on gloo's threads in {where}",
                )
    return profile


PROFILED_CALLS = ("c10d::allreduce_", "c10d::broadcast_")


def check_profile_spans(path, rank, summary):
    """What the witness table and the timeline read: times as numbers, spans as [label, start, end]."""
    seconds, micro_batches, collectives = (summary.get(key) for key in ("collective_seconds", "micro_batches", "collectives"))
    check(
        isinstance(seconds, dict) and all(is_number(seconds.get(kind)) for kind in lab.COLLECTIVE_KINDS)
        and is_number(summary.get("compute_seconds_per_micro_batch")) and is_number(summary["audit"].get("comm_seconds")),
        path,
        f"rank {rank}: collective_seconds, compute_seconds_per_micro_batch and the audit's comm_seconds must be numbers",
    )
    check(
        isinstance(micro_batches, list) and micro_batches
        and all(isinstance(span, list) and len(span) == 3 and is_int(span[0]) and is_number(span[1]) and is_number(span[2]) for span in micro_batches)
        and isinstance(collectives, list)
        and all(isinstance(span, list) and len(span) == 3 and span[0] in lab.COLLECTIVE_KINDS and is_number(span[1]) and is_number(span[2]) for span in collectives),
        path,
        f"rank {rank}: micro_batches must be [index, start, end] and collectives [kind, start, end] spans",
    )


def audit_run(folder, mode, record, expected_config, sizes, hint):
    history = check_history(folder / lab.HISTORY_FILE, mode, record, expected_config, sizes, hint)
    report = check_report(folder / lab.REPORT_FILE, mode, record)
    training_forwards = len(lab.epoch_plan(record["config"])) * record["config"]["epochs"]
    check_model(folder / lab.MODEL_FILE, mode, record, training_forwards)
    check_png(folder / lab.SAMPLE_FILE, record, size=(IMAGE_SIZE, IMAGE_SIZE))
    check_png(folder / lab.CONFUSION_FILE, record)
    check_checksums(folder, record)
    profile = check_profile(folder, record, history)
    return history, report, profile


# ----------------------------------------------------------------------------- output


def per_epoch(history, key):
    """The value if every epoch has the same one, else the values joined by '/'."""
    values = [row[key] for row in history]
    return str(values[0]) if len(set(values)) == 1 else "/".join(map(str, values))


def total(history, key):
    return sum(row[key] for row in history)


def ratio(numerator, denominator):
    return f"{numerator / denominator:.2f}x" if denominator else "n/a"


def print_tables(runs, config):
    every_history, every_report, _ = runs["every"]
    no_sync_history, no_sync_report, _ = runs["no_sync"]
    print("| mod | pași optimizer/epocă | sincronizări/epocă | test accuracy |")
    print("|---|---:|---:|---:|")
    for mode, (history, report, _) in runs.items():
        print(
            f"| {mode} | {per_epoch(history, 'optimizer_steps')} | {per_epoch(history, 'gradient_syncs')} | "
            f"{report['model_test_accuracy']:.4f} |"
        )
    print()
    epochs = len(every_history)
    print(f"Communication per rank, totals over {epochs} epochs (comm and epoch seconds: means over ranks):")
    print(
        "| mode | gradient syncs | hook calls | all-reduce MB | buffer-broadcast collectives | broadcast KB "
        "| bucket-rebuild collectives | comm s | epoch s | images/s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for mode, (history, _, _) in runs.items():
        print(
            f"| {mode} | {total(history, 'gradient_syncs')} | {total(history, 'sync_bucket_calls')} | "
            f"{total(history, 'allreduce_bytes') / 1e6:.1f} | {total(history, 'buffer_broadcast_collectives')} | "
            f"{total(history, 'broadcast_bytes') / 1e3:.1f} | {total(history, 'rebuild_broadcast_collectives')} | "
            f"{total(history, 'comm_seconds'):.2f} | "
            f"{total(history, 'epoch_seconds'):.1f} | "
            f"{sum(r['train_images_per_second'] for r in history) / epochs:.0f} |"
        )
    print(
        "| every / no_sync | "
        + " | ".join(
            ratio(total(every_history, key), total(no_sync_history, key))
            for key in (
                "gradient_syncs",
                "sync_bucket_calls",
                "allreduce_bytes",
                "buffer_broadcast_collectives",
                "broadcast_bytes",
                "rebuild_broadcast_collectives",
                "comm_seconds",
                "epoch_seconds",
            )
        )
        + " | |"
    )
    print()
    checkpointing = "on" if config.get("activation_checkpointing") else "off"
    print("Memory per micro-batch (rank 0; activations held from the forward for the backward, saved_tensors_hooks):")
    print("| mode | activation checkpointing | saved activations MB | peak allocated MB (CUDA, per epoch) |")
    print("|---|---|---:|---:|")
    for mode, (history, _, _) in runs.items():
        peaks = [row["peak_allocated_bytes"] for row in history]
        peak = "/".join(f"{value / 1e6:.1f}" for value in peaks) if peaks[0] is not None else "n/a (CPU)"
        print(f"| {mode} | {checkpointing} | {history[0]['saved_activation_bytes'] / 1e6:.2f} | {peak} |")
    print()
    print("baseline:", no_sync_report["baseline_class"], f"{no_sync_report['baseline_accuracy']:.4f}")
    print("top confusions:", no_sync_report["top_confusions"])


def print_witness(runs):
    profiled = {mode: profile for mode, (_, _, profile) in runs.items() if profile}
    if not profiled:
        return
    print()
    print("The profiler as witness, epoch 1's recorded micro-batches, per rank (seconds: the profiler's executions")
    print("of the gradient all-reduces and broadcasts, the audit's comm_seconds for the same micro-batches):")
    print(
        "| mode | micro-batches | rank | c10d::allreduce_ (profiler) | hook calls + steps (audit) | c10d::broadcast_ "
        "(profiler) | broadcast collectives (audit) | collective s (profiler) | comm s (audit) | compute s per micro-batch |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for mode, profile in profiled.items():
        first, stop = profile["micro_batches"]
        steps = profile["windows"]
        for summary in profile["ranks"]:
            audit, calls, seconds = summary["audit"], summary["calls"], summary["collective_seconds"]
            print(
                f"| {mode} | {first}-{stop - 1} | {summary['rank']} | {calls['c10d::allreduce_']} | "
                f"{audit['sync_bucket_calls']} + {steps} | {calls['c10d::broadcast_']} | "
                f"{audit['buffer_broadcast_collectives'] + audit['rebuild_broadcast_collectives']} | "
                f"{seconds['gradient all-reduce'] + seconds['broadcast']:.4f} | {audit['comm_seconds']:.4f} | "
                f"{summary['compute_seconds_per_micro_batch']:.4f} |"
            )


def first_window(profile, accum_steps):
    """The first recorded window of each rank: its micro-batches and the collectives that start in it."""
    first = profile["micro_batches"][0]
    lanes = []
    for summary in profile["ranks"]:
        spans = [span for span in summary["micro_batches"] if first <= span[0] < first + accum_steps]
        window_end = max(stop for _, _, stop in spans)
        collectives = [collective for collective in summary["collectives"] if collective[1] <= window_end]
        lanes.append({"label": f"rank {summary['rank']}", "micro_batches": spans, "collectives": collectives})
    return lanes


def draw_timeline(artifacts, runs, records, text):
    path = artifacts / lab.TIMELINE_FILE
    unprofiled = [mode for mode, (_, _, profile) in runs.items() if profile is None]
    if unprofiled:
        if len(unprofiled) < len(runs):
            print(f"note: {lab.TIMELINE_FILE} needs both runs profiled (train.py --profile-windows K); {', '.join(unprofiled)} was not")
        path.unlink(missing_ok=True)  # a timeline of earlier runs would not show these
        return None
    accum_steps = records["every"]["config"]["accum_steps"]
    panels = []
    for mode, (_, _, profile) in runs.items():
        first = profile["micro_batches"][0]
        title = f"{mode}: window {first // accum_steps + 1} of epoch 1 (micro-batches {first}-{first + accum_steps - 1})"
        panels.append({"title": title, "lanes": first_window(profile, accum_steps)})
    caption = (
        f"The PyTorch profiler's record (train.py --profile-windows): one accumulation window of {accum_steps} "
        f"micro-batches per mode; collectives as executed ({records['every']['config']['backend']})."
    )
    image, data = plots.timeline_image("One accumulation window: every vs no_sync", panels, caption)
    lab.write_atomic(path, lab.png_bytes(image, {**text, "data": json.dumps(data)}))
    return path


def draw_pictures(artifacts, runs, records):
    text = {"run_ids": json.dumps({mode: record["run_id"] for mode, record in records.items()})}
    curves = []
    for metric, label in (("loss", "cross-entropy loss"), ("accuracy", "accuracy")):
        series = [
            {"label": f"{mode} {split}", "mode": mode, "dashed": split == "validation", "values": [row[f"{split}_{metric}"] for row in history]}
            for mode, (history, _, _) in runs.items()
            for split in ("train", "validation")
        ]
        curves.append({"title": f"{metric} per epoch", "y_label": label, "series": series})
    image, data = plots.line_panels("Training curves: every vs no_sync (validation dashed)", curves)
    lab.write_atomic(artifacts / lab.CURVES_FILE, lab.png_bytes(image, {**text, "data": json.dumps(data)}))

    panels = [
        ("gradient_syncs", "gradient syncs per epoch", "syncs", 1),
        ("allreduce_bytes", "all-reduced gradients per epoch", "MB per rank", 1e6),
        ("buffer_broadcast_collectives", "buffer-broadcast collectives per epoch", "collectives", 1),
        ("comm_seconds", "time in collectives per epoch", "seconds (mean over ranks)", 1),
    ]
    bars = [
        {"title": title, "y_label": unit, "bars": {mode: [row[key] / scale for row in history] for mode, (history, _, _) in runs.items()}}
        for key, title, unit, scale in panels
    ]
    image, data = plots.bar_panels("Communication: every vs no_sync", bars)
    lab.write_atomic(artifacts / lab.COMMUNICATION_FILE, lab.png_bytes(image, {**text, "data": json.dumps(data)}))
    return draw_timeline(artifacts, runs, records, text)


def main():
    args = parse_args()
    artifacts = args.artifacts
    records = {mode: read_run_record(artifacts / mode, mode) for mode in lab.MODES}
    for mode, record in records.items():
        print(f"{mode}: run {record['run_id']} ({record.get('finished_at', '?')}) in {artifacts / mode}")
        config = record["config"]
        print(f"  precision {config.get('precision')} on {', '.join(config.get('hardware') or ['?'])}")
        for note in describe_unfinished(artifacts / mode):
            print(f"note: {note}; {artifacts / mode} holds run {record['run_id']}, the next train.py into it removes the rest")
    compare_configs(records["every"], records["no_sync"], artifacts)

    config = records["every"]["config"]
    if args.expect_from_config:
        expected_config, hint = config, ""
    else:
        expected_config = lab.DOCUMENTED
        departures = [f"{key}={config.get(key)}" for key, value in lab.DOCUMENTED.items() if config.get(key) != value]
        hint = (
            f" (these runs are not the documented experiment: {', '.join(departures)}; "
            f"to audit them against their own configuration pass --expect-from-config)"
            if departures
            else ""
        )
    sizes = lab.comm_sizes(CifarCNN())
    runs = {
        mode: audit_run(artifacts / mode, mode, records[mode], expected_config, sizes, hint) for mode in lab.MODES
    }
    check_same_saved_activations(runs, artifacts)
    print_tables(runs, config)
    print_witness(runs)
    timeline = draw_pictures(artifacts, runs, records)
    pictures = [artifacts / lab.CURVES_FILE, artifacts / lab.COMMUNICATION_FILE] + ([timeline] if timeline else [])
    print(f"pictures: {', '.join(map(str, pictures))}")
    every_syncs = total(runs["every"][0], "gradient_syncs")
    no_sync_syncs = total(runs["no_sync"][0], "gradient_syncs")
    print(f"AUDIT PASSED: no_sync reduced gradient synchronizations by {every_syncs / no_sync_syncs:g}x")


if __name__ == "__main__":
    try:
        main()
    except lab.LabError as error:
        lab.exit_with(error, SCRIPT)
