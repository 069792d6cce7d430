"""Audit the artifacts of both runs; print the table and `AUDIT PASSED` only when every check held.

    python verify.py                                                   # the documented experiment
    python verify.py --artifacts artifacts/quick --expect-from-config  # a run judged by its own configuration

Without --expect-from-config the audit is the document's: the runs must be its experiment key by key (split and test
sizes, seed, batch, window, epochs, learning rate, weight decay, world size, DDP's settings, augmentation; the first
that differs is named), then 5 epochs, 100 optimizer steps and 400 (every) or 100 (no_sync) gradient syncs per epoch.
With it, the expected counts are recomputed from the configuration the runs recorded. Either way every item of the
document's checklist is checked against what the run's witnesses saw (ddp_no_sync_lab/audit/checklist.py: resets,
accumulation, the divisor read at each loss and the loss scale at the logits, the average of the ranks' gradients, the
samples per step, the optimizer's own steps, the bytes handed to the collective), and a refusal names the item. A pair
of the text task (train.py --task text) is held to its own documented configuration and its packing, made again here
(docs/packed.md). Either way the all-reduced bytes and DDP's buffer broadcasts are recomputed from the model's
parameter and buffer sizes, both runs must share one configuration (only the mode may differ), every file must carry
its run's id and match the checksum the run recorded, and the reports must agree with their own confusion matrices. A
run profiled with train.py --profile-windows K must show the profiler's c10d calls equal to the audit's in the
profiled windows, rank by rank. A failure is one line naming the file and what is wrong (exit 1). On success it also
draws curves.png and communication.png next to the run folders (or into --pictures DIR; on a read-only copy of the
artifacts it says so in one line and draws none), and timeline.png when both runs were profiled.
"""

import tempfile
from dataclasses import replace
from pathlib import Path

from ddp_no_sync_lab import experiment
from ddp_no_sync_lab.audit.face import check_profile
from ddp_no_sync_lab.checks import certify, facts, strict_audit, task_results
from ddp_no_sync_lab.cli import ArgumentParser, LabError, exit_with
from ddp_no_sync_lab.files import (
    HISTORY_FILE,
    RUN_RECORD_FILE,
    describe_unfinished,
)
from ddp_no_sync_lab.report import tables
from ddp_no_sync_lab.run import resume
from ddp_no_sync_lab.strategies import fsdp

SCRIPT = "verify.py"


def parse_args():
    parser = ArgumentParser(prog=SCRIPT, description="Audit the artifacts of the every and no_sync runs.")
    parser.add_argument("--artifacts", type=Path, default=Path("artifacts"), help="folder holding every/ and no_sync/")
    parser.add_argument(
        "--expect-from-config",
        action="store_true",
        help="expect the counts the runs' own recorded configuration implies, not the documented 5/100/400/100",
    )
    parser.add_argument("--pictures", type=Path, metavar="DIR", help="draw the pictures here (default: --artifacts)")
    args = parser.parse_args()
    if args.pictures:  # asked for: refused now, before the audit, if they cannot be written there
        try:
            args.pictures.mkdir(parents=True, exist_ok=True)
            tempfile.TemporaryFile(dir=args.pictures).close()
        except OSError as error:
            parser.error(f"argument --pictures: {args.pictures} cannot be written ({error.strerror})")
    return args


def audit_run(folder, mode, record, expected_config, sizes, strict, task):
    history = facts.check_history(folder / HISTORY_FILE, mode, record, expected_config, sizes)
    report = task.check_run(folder, mode, record, strict)  # the task's report, checkpoint and pictures
    facts.check_checksums(folder, record)
    return history, report, check_profile(folder, record, history)


def read_runs(artifacts):
    """Both runs' records, each described as it is read: where, when and on what it ran, a move or a leftover."""
    records = {mode: facts.read_run_record(artifacts / mode, mode) for mode in experiment.MODES}
    for mode, record in records.items():
        print(f"{mode}: run {record['run_id']} ({record.get('finished_at', '?')}) in {artifacts / mode}")
        config = record["config"]
        print(f"  precision {config.get('precision')} on {', '.join(config.get('hardware') or ['?'])}")
        moved = resume.moved_hardware(record, artifacts / mode / RUN_RECORD_FILE)
        if moved:
            print(f"note: {mode}: {moved}")
        for note in describe_unfinished(artifacts / mode):
            print(
                f"note: {note}; {artifacts / mode} holds run {record['run_id']}, the next train.py into it removes the rest"
            )
    return records


def expected_configuration(args, records, task):
    """What both runs are held to: their own configuration (--expect-from-config), or the strict audit's documented
    experiment, once the runs are shown to be it, on real data."""
    artifacts, config = args.artifacts, records["every"]["config"]
    if args.expect_from_config:
        expected_config = config
    else:
        strict_audit.check_labs_task(artifacts / "every" / RUN_RECORD_FILE, config)
        for mode, record in records.items():  # the documented experiment ran on CIFAR-10 itself
            strict_audit.check_real_data(artifacts / mode, record)
        strict_audit.check_documented(artifacts / "every" / RUN_RECORD_FILE, config)
        expected_config = task.documented(config)
    return expected_config


def main():
    args = parse_args()
    artifacts = args.artifacts
    records = read_runs(artifacts)
    facts.compare_configs(records["every"], records["no_sync"], artifacts)
    config, strict = records["every"]["config"], not args.expect_from_config
    task = task_results.task_results(config, artifacts / "every" / RUN_RECORD_FILE)  # the task the runs recorded
    expected_config = expected_configuration(args, records, task)
    task.prepare(artifacts, config, strict)
    platform = ", ".join(f"{key} {config.get(key)}" for key in strict_audit.PLATFORM_CHOICES)
    print(f"platform (printed, not compared): {platform}")
    sizes = experiment.comm_sizes(task.model())
    if config.get("strategy") == "fsdp":  # FSDP's units, each padded to equal shards
        sizes = replace(sizes, fsdp_unit_numels=fsdp.unit_numels(task.model(), config["world_size"]))
    runs = {
        mode: audit_run(artifacts / mode, mode, records[mode], expected_config, sizes, strict, task)
        for mode in experiment.MODES
    }
    facts.check_same_saved_activations(runs, artifacts)
    task.check_pair(artifacts, config, runs, strict)
    for mode, (history, _, _) in runs.items():
        for row in history:
            for index in row["resumed_at"]:
                print(
                    f"{mode} resumed at epoch {row['epoch']}, micro-batch {index} (its restart's communication expected)"
                )
    print_results(args, runs, records, config)


def print_results(args, runs, records, config):
    """Once every check has held: the tables, the checklist as observed, the pictures, and the verdict."""
    tables.print_tables(runs, config)
    tables.print_witness(runs)
    certify.print_checklist(runs, config)
    folder = args.pictures or args.artifacts
    try:
        timeline = tables.draw_pictures(folder, runs, records)
        pictures = [folder / tables.CURVES_FILE, folder / tables.COMMUNICATION_FILE] + ([timeline] if timeline else [])
        print(f"pictures: {', '.join(map(str, pictures))}")
    except OSError as error:  # a read-only copy (an archive, a shared mount): the audit holds all the same
        print(f"pictures: not drawn, {folder} cannot be written ({error.strerror}); pass --pictures DIR to draw them")
    every_syncs = tables.total(runs["every"][0], "gradient_syncs")
    no_sync_syncs = tables.total(runs["no_sync"][0], "gradient_syncs")
    print(f"AUDIT PASSED: no_sync reduced gradient synchronizations by {every_syncs / no_sync_syncs:g}x")


if __name__ == "__main__":
    try:
        main()
    except LabError as error:
        exit_with(error, SCRIPT)
