"""verify.py cannot be fooled: each way artifacts can be missing, damaged, mixed or inconsistent fails
with one line naming the file (exit 1), on copies of real runs."""

import builtins
import errno
import json
import os
import shutil
import subprocess
import sys
import unittest.mock
from pathlib import Path

import pytest
import torch
from PIL import Image
from torch import nn

from conftest import (
    REPO,
    SMALL_RUN,
    assert_one_line_error,
    copy_runs,
    module_runs,
    module_start,
    png_header_only,
    read_json,
    run_in_process,
    subprocess_env,
    verify,
    write_png_with_a_damaged_chunk,
)
from ddp_no_sync_lab import experiment, files
from ddp_no_sync_lab.checks import task_results
from ddp_no_sync_lab.report import tables
from model import CLASSES

COUNTS = ("optimizer_steps", *experiment.COUNTS)


@pytest.fixture
def runs(lab_runs, tmp_path):
    artifacts, _ = lab_runs
    return copy_runs(artifacts, tmp_path / "artifacts")


def audit(artifacts):
    return verify(artifacts)


def edit_json(path, change):
    value = read_json(path)
    change(value)
    path.write_text(json.dumps(value))


def test_untouched_copies_pass(runs):
    result = audit(runs)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1].startswith("AUDIT PASSED")


def test_a_missing_file(runs):
    (runs / "no_sync" / "history.json").unlink()
    assert_one_line_error(
        audit(runs), f"FileNotFoundError: Lipsește artefactul obligatoriu: {runs}/no_sync/history.json", code=1
    )


def test_a_missing_run(runs):
    shutil.rmtree(runs / "every")
    line = assert_one_line_error(audit(runs), f"Lipsește artefactul obligatoriu: {runs}/every/run.json", code=1)
    assert "run train.py --mode every" in line


def test_an_empty_json_file(runs):
    (runs / "every" / "report.json").write_text("")
    assert_one_line_error(audit(runs), f"RuntimeError: Artefact absent sau gol: {runs}/every/report.json", code=1)


def test_a_truncated_json_file(runs):
    path = runs / "no_sync" / "history.json"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    assert_one_line_error(audit(runs), f"{runs}/no_sync/history.json: not valid JSON", "truncated", code=1)


def test_wrong_types(runs):
    edit_json(runs / "every" / "history.json", lambda rows: rows[1].update(gradient_syncs="40"))
    assert_one_line_error(audit(runs), "epoch row 2: gradient_syncs must be a whole number, got '40'", code=1)


def test_segments_of_the_wrong_shape(runs):
    edit_json(runs / "no_sync" / "run.json", lambda record: record.update(segments=[{"hardware": "CPU"}]))
    line = assert_one_line_error(audit(runs), f"{runs}/no_sync/run.json: segments must be a list of", code=1)
    assert "{'hardware': 'CPU'}" in line


def test_a_history_with_a_missing_row(runs):
    edit_json(runs / "every" / "history.json", lambda rows: rows.pop())
    assert_one_line_error(audit(runs), f"{runs}/every/history.json: expected 2 epochs, got 1", code=1)


def test_counts_that_disagree_with_the_expectation(runs):
    """What a no_sync run whose forward escaped the context would record: every micro-batch synced."""

    def sync_every_micro_batch(rows):
        for row in rows:
            row.update(gradient_syncs=20, sync_bucket_calls=20)

    edit_json(runs / "no_sync" / "history.json", sync_every_micro_batch)
    line = assert_one_line_error(
        audit(runs), f"RuntimeError: {runs}/no_sync/history.json: expected 5 gradient syncs, got 20", code=1
    )
    assert "forward ran outside no_sync()" in line


def test_tampered_bytes_count(runs):
    edit_json(
        runs / "every" / "history.json", lambda rows: rows[0].update(allreduce_bytes=rows[0]["allreduce_bytes"] // 4)
    )
    assert_one_line_error(audit(runs), "expected 44683040 all-reduced bytes, got 11170760 (epoch 1)", code=1)


def test_runs_with_different_configurations(runs):
    edit_json(runs / "no_sync" / files.RUN_RECORD_FILE, lambda record: record["config"].update(seed=48))
    assert_one_line_error(audit(runs), "come from different configurations (seed: 47 vs 48)", code=1)


@pytest.mark.parametrize("task", ["video", ["text"]])
def test_runs_of_a_task_verify_does_not_know_are_refused_naming_it(runs, task):
    """verify.py finds the task's checks by the task the runs recorded; one it has none for, or no name at all, is
    refused in one line, not checked as another task's."""
    for mode in ("every", "no_sync"):
        edit_json(runs / mode / files.RUN_RECORD_FILE, lambda record: record["config"].update(task=task))
    line = assert_one_line_error(
        audit(runs), f"the runs' task {task!r} is none verify.py knows (cifar10, text, or MODULE:CLASS)", code=1
    )
    assert line.startswith(f"RuntimeError: {runs}/every/run.json: ")
    assert sorted(task_results.TASK_RESULTS) == sorted(experiment.TASKS)  # each task train.py runs has its checks


def test_a_configuration_of_the_wrong_type(runs):
    for mode in ("every", "no_sync"):
        edit_json(runs / mode / files.RUN_RECORD_FILE, lambda record: record["config"].update(batch_size="10"))
    assert_one_line_error(audit(runs), "config batch_size must be a positive whole number, got '10'", code=1)


def test_files_of_different_runs(runs):
    edit_json(runs / "every" / "report.json", lambda report: report.update(run_id="20260101T000000Z-000000"))
    assert_one_line_error(audit(runs), f"{runs}/every/report.json: run id 20260101T000000Z-000000, run.json", code=1)


def test_a_model_swapped_in_from_another_run(runs):
    shutil.copy(runs / "every" / "model.pt", runs / "no_sync" / "model.pt")
    assert_one_line_error(audit(runs), f"{runs}/no_sync/model.pt: run id", code=1)


def test_a_model_that_does_not_load(runs):
    path = runs / "every" / "model.pt"
    path.write_bytes(path.read_bytes()[:1000])
    assert_one_line_error(audit(runs), f"checkpoint unreadable: {runs}/every/model.pt is truncated", code=1)


def test_a_model_of_another_architecture(runs):
    record = read_json(runs / "every" / files.RUN_RECORD_FILE)
    checkpoint = {
        "model": nn.Linear(4, 10).state_dict(),
        "classes": CLASSES,
        "run_id": record["run_id"],
        "mode": "every",
    }
    torch.save(checkpoint, runs / "every" / "model.pt")
    assert_one_line_error(audit(runs), f"checkpoint does not fit CifarCNN: {runs}/every/model.pt", code=1)


def test_a_report_that_disagrees_with_its_confusion_matrix(runs):
    edit_json(runs / "no_sync" / "report.json", lambda report: report.update(model_test_accuracy=0.99))
    assert_one_line_error(audit(runs), "model_test_accuracy 0.99 differs from its confusion matrix", code=1)


def test_a_file_changed_after_the_run(runs):
    """A valid picture with the right run id, but not the one the run wrote: only the checksum tells."""
    path = runs / "no_sync" / "sample_test.png"
    run_id = files.png_text(path)["run_id"]
    path.write_bytes(files.png_bytes(Image.new("RGB", (32, 32), "white"), {"run_id": run_id}))
    assert_one_line_error(audit(runs), f"{runs}/no_sync/sample_test.png: changed after the run finished", code=1)


@pytest.mark.parametrize(
    "damage",
    [
        lambda path: path.write_bytes(path.read_bytes()[:200]),
        write_png_with_a_damaged_chunk,  # Pillow: SyntaxError
        lambda path: png_header_only(path, 20_000, 20_000),  # Pillow: DecompressionBombError
    ],
    ids=["truncated", "damaged_chunk", "decompression_bomb"],
)
def test_a_damaged_picture(runs, damage):
    damage(runs / "every" / "confusion_matrix.png")
    assert_one_line_error(audit(runs), f"{runs}/every/confusion_matrix.png: not a readable PNG", code=1)


def test_an_interrupted_run_is_named(runs):
    (runs / ".no_sync.partial-20260101T000000Z-abcdef").mkdir()
    passed = audit(runs)
    assert passed.returncode == 0
    assert f"note: an unfinished run 20260101T000000Z-abcdef was left in {runs}/.no_sync.partial-" in passed.stdout
    shutil.rmtree(runs / "no_sync")
    line = assert_one_line_error(audit(runs), f"Lipsește artefactul obligatoriu: {runs}/no_sync/run.json", code=1)
    assert "an unfinished run 20260101T000000Z-abcdef" in line


def test_a_publish_interrupted_between_its_renames_is_named_and_cleaned(runs, monkeypatch):
    """RunFolder.publish moves the old run aside, then the new one into place: a crash between the two
    leaves no no_sync/ at all. verify.py names both hidden folders; the next run into no_sync removes them."""
    output = runs / "no_sync"
    folder = files.RunFolder(output, "20260101T000000Z-abcdef", files.utc_now())
    folder.begin()
    for name in files.RUN_FILES:
        shutil.copy(output / name, folder.partial / name)
    renames = []

    def crash_on_the_second_rename(source, target):
        renames.append(target)
        if len(renames) == 2:
            raise KeyboardInterrupt("the machine went down")
        return real_rename(source, target)

    real_rename = files.os.rename
    monkeypatch.setattr(files.os, "rename", crash_on_the_second_rename)
    with pytest.raises(KeyboardInterrupt):
        folder.publish({"run_id": folder.run_id})
    monkeypatch.undo()
    replaced = runs / ".no_sync.replaced-20260101T000000Z-abcdef"
    assert not output.exists() and replaced.is_dir() and (folder.partial / files.RUN_RECORD_FILE).is_file()

    line = assert_one_line_error(audit(runs), f"Lipsește artefactul obligatoriu: {output}/run.json", code=1)
    assert (
        f"run 20260101T000000Z-abcdef finished but was interrupted while being moved into place; it lies complete in {folder.partial}"
        in line
    )
    assert f"the run that run 20260101T000000Z-abcdef replaced was left in {replaced}" in line

    # The old run back in place, its copy half removed: verify passes and still says what is left over.
    shutil.copytree(replaced, output)
    shutil.rmtree(folder.partial)
    (replaced / files.MODEL_FILE).unlink()
    passed = audit(runs)
    assert passed.returncode == 0, passed.stderr
    assert f"note: the run that run 20260101T000000Z-abcdef replaced was left in {replaced}" in passed.stdout

    files.RunFolder(output, "nextrun", files.utc_now()).begin()
    assert sorted(path.name for path in runs.iterdir() if path.name.startswith(".no_sync")) == [
        ".no_sync.lock",
        ".no_sync.partial-nextrun",
    ]


def read_only_verify(artifacts, *options):
    """verify.py on `artifacts` mounted read-only (a bind mount in a mount namespace of its own), as on an
    archive or a shared mount; where no mount namespace can be made, with every write under it failing."""
    if shutil.which("unshare") and subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode == 0:
        script = 'mount --bind -o ro "$1" "$1" && shift && exec "$@"'
        command = [sys.executable, "verify.py", "--artifacts", artifacts, "--expect-from-config", *options]
        return subprocess.run(
            ["unshare", "--mount", "sh", "-c", script, "read-only", artifacts, *map(str, command)],
            capture_output=True,
            text=True,
            env=subprocess_env(),
            cwd=REPO,
            timeout=300,
        )

    def refused_under_artifacts(real, writes):
        def call(path, *args, **kwargs):
            if writes(*args, **kwargs) and Path(path).resolve().is_relative_to(artifacts.resolve()):
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
            return real(path, *args, **kwargs)

        return call

    write_modes = lambda mode="r", *rest, **kw: bool(set(mode) & set("wax+"))  # noqa: E731
    write_flags = lambda flags, *rest, **kw: bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))  # noqa: E731
    with (
        unittest.mock.patch("builtins.open", refused_under_artifacts(builtins.open, write_modes)),
        unittest.mock.patch("os.open", refused_under_artifacts(os.open, write_flags)),
        unittest.mock.patch("os.mkdir", refused_under_artifacts(os.mkdir, lambda *rest, **kw: True)),
    ):
        return verify(artifacts, *options)


def test_a_read_only_copy_passes_and_its_pictures_go_where_they_can(runs, tmp_path):
    for name in (tables.CURVES_FILE, tables.COMMUNICATION_FILE, tables.TIMELINE_FILE):
        (runs / name).unlink(missing_ok=True)
    result = read_only_verify(runs)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (
        f"pictures: not drawn, {runs} cannot be written (Read-only file system); pass --pictures DIR" in result.stdout
    )
    assert result.stdout.splitlines()[-1].startswith("AUDIT PASSED")
    elsewhere = read_only_verify(runs, "--pictures", tmp_path / "pictures")
    assert elsewhere.returncode == 0, elsewhere.stdout + elsewhere.stderr
    drawn = [
        tmp_path / "pictures" / name for name in (tables.CURVES_FILE, tables.COMMUNICATION_FILE, tables.TIMELINE_FILE)
    ]
    assert f"pictures: {', '.join(map(str, drawn))}" in elsewhere.stdout and all(path.is_file() for path in drawn)
    assert not (runs / tables.CURVES_FILE).exists()
    refused = read_only_verify(runs, "--pictures", runs / "pictures")
    assert_one_line_error(refused, f"argument --pictures: {runs}/pictures cannot be written (Read-only file system)")


def test_usage_errors_exit_2(runs):
    assert_one_line_error(
        run_in_process("verify.py", "--artifacts"), "verify.py: error: argument --artifacts: expected one argument"
    )


def test_a_sync_recorded_in_the_wrong_micro_batch(runs):
    edit_json(
        runs / "no_sync" / "history.json",
        lambda rows: rows[1].update(gradient_sync_positions=[[3, 16, 4], [18, 19, 1]]),
    )
    assert_one_line_error(
        audit(runs),
        "no_sync/history.json: epoch 2: gradient sync 5 of the epoch ran in the backward of micro-batch 18; "
        "the window plan puts it in micro-batch 19's",
        code=1,
    )


@pytest.mark.parametrize("positions", [[[3, 400, 4]], [[3, 40, 0]], "3:40:4", [[3, 40]]])
def test_positions_that_are_not_runs_of_micro_batches(runs, positions):
    edit_json(runs / "every" / "history.json", lambda rows: rows[0].update(optimizer_step_positions=positions))
    assert_one_line_error(audit(runs), "epoch row 1: optimizer_step_positions must be [start, stop, step] runs", code=1)


# The shared experiment's runs with the loop broken beneath train.py (tests/inject), trained in the session's module start:
# each broken loop's no_sync, and a drift on one rank in `every`.
BROKEN = {
    "sync_first": ["LAB_TEST_BROKEN_LOOP=sync_first", "--mode", "no_sync"],
    "step_inside": ["LAB_TEST_BROKEN_LOOP=step_inside", "--mode", "no_sync"],
    "backward_only_in_no_sync": ["LAB_TEST_BROKEN_LOOP=backward_only_in_no_sync", "--mode", "no_sync"],
    "drift": ["LAB_TEST_DRIFT_AT_STEP=1:8", "--mode", "every"],
}


@module_runs("broken")
def broken_loop_runs(folder, image_data):
    return [
        [*words, "--output", folder / name / words[-1], "--data-dir", image_data, *SMALL_RUN, "--quiet"]
        for name, words in BROKEN.items()
    ]


@pytest.fixture(scope="module")
def broken_runs(tmp_path_factory, image_data):
    folder, _ = module_start(tmp_path_factory, image_data, "broken")
    return folder


@pytest.mark.torchrun
@pytest.mark.parametrize(
    "broken, message",
    [
        (
            "sync_first",
            "epoch 1: gradient sync 1 of the epoch ran in the backward of micro-batch 0; the window plan puts it in micro-batch 3's",
        ),
        (
            "step_inside",
            "epoch 1: optimizer step 1 of the epoch came after micro-batch 0; the window plan puts it after micro-batch 3",
        ),
        ("backward_only_in_no_sync", "expected 5 gradient syncs, got 20 (epoch 1; the forward ran outside no_sync()"),
    ],
)
def test_a_broken_accumulation_loop_is_rejected(lab_runs, broken_runs, tmp_path, broken, message):
    """The real train.py with a broken loop (tests/inject/sitecustomize.py); the first two keep every count of
    syncs and steps, so only their positions give them away."""
    artifacts, _ = lab_runs
    runs = copy_runs(broken_runs / broken, tmp_path / "artifacts")
    shutil.copytree(artifacts / "every", runs / "every")
    rows, correct_rows = (read_json(folder / "no_sync" / "history.json") for folder in (runs, artifacts))
    counts = [(row["optimizer_steps"], row["gradient_syncs"]) for row in rows]
    if broken == "backward_only_in_no_sync":
        assert counts == [(5, 20), (5, 20)] and rows[0]["gradient_sync_positions"] == [[0, 20, 1]]
    else:
        assert counts == [(row["optimizer_steps"], row["gradient_syncs"]) for row in correct_rows] == [(5, 5), (5, 5)]
    if broken == "step_inside":  # every count the audit keeps is the correct run's but the checklist's own:
        # the window's sync that no step followed is checked once more at the epoch's end (6 all-reduces, not 5)
        kept = [key for key in COUNTS if key != "witness_allreduces"]
        assert [{key: row[key] for key in kept} for row in rows] == [
            {key: row[key] for key in kept} for row in correct_rows
        ]
        assert [row["witness_allreduces"] for row in rows] == [6, 6]
    if broken != "backward_only_in_no_sync":  # each rank stepped on its own unsynchronized gradients too
        assert rows[0]["first_rank_disagreement"] == {"optimizer_step": 1, "differed": ["gradients", "parameters"]}
    assert_one_line_error(audit(runs), f"{runs}/no_sync/history.json: {message}", code=1)


@pytest.mark.torchrun
def test_a_rank_that_drifts_apart_is_caught_where_every_count_holds(lab_runs, broken_runs, tmp_path):
    """Rank 1 moves one weight after its 8th optimizer step (epoch 2, step 3): the counts and positions are
    the correct run's, but the ranks' parameter fingerprints differ from that step on."""
    artifacts, _ = lab_runs
    runs = copy_runs(broken_runs / "drift", tmp_path / "artifacts")
    shutil.copytree(artifacts / "no_sync", runs / "no_sync")
    rows, correct_rows = (read_json(folder / "every" / "history.json") for folder in (runs, artifacts))
    positions = ("gradient_sync_positions", "optimizer_step_positions")
    assert [{key: row[key] for key in COUNTS + positions} for row in rows] == [
        {key: row[key] for key in COUNTS + positions} for row in correct_rows
    ]
    assert [(row["steps_with_ranks_agreed"], row["first_rank_disagreement"]) for row in rows] == [
        (5, None),
        (2, {"optimizer_step": 3, "differed": ["parameters"]}),
    ]
    assert_one_line_error(
        audit(runs),
        f"{runs}/every/history.json: epoch 2: at optimizer step 3 the ranks held different parameters "
        "(agreed at 2 of 5 steps): they no longer trained one model",
        code=1,
    )


def test_a_tampered_agreement_record(runs):
    edit_json(runs / "no_sync" / "history.json", lambda rows: rows[0].update(steps_with_ranks_agreed=4))
    assert_one_line_error(
        audit(runs),
        "epoch 1: the ranks agreed at 4 of 5 optimizer steps, and first_rank_disagreement does not say where",
        code=1,
    )


def test_memory_fields_of_the_wrong_kind(runs):
    edit_json(runs / "every" / "history.json", lambda rows: rows[0].update(peak_allocated_bytes=5))
    assert_one_line_error(audit(runs), "epoch row 1: peak_allocated_bytes must be null on cpu, got 5", code=1)
    edit_json(
        runs / "every" / "history.json",
        lambda rows: rows[0].update(peak_allocated_bytes=None, saved_activation_bytes=0),
    )
    assert_one_line_error(
        audit(runs), "epoch row 1: saved_activation_bytes must be a positive whole number, got 0", code=1
    )


def test_saved_activations_that_differ_between_the_modes(runs):
    """Resealed, as someone who wanted to fool the audit would: each file alone is consistent."""
    from test_profiler import reseal

    every = read_json(runs / "every" / "history.json")[0]["saved_activation_bytes"]
    reseal(runs / "no_sync", "history.json", lambda rows: rows[1].update(saved_activation_bytes=every // 2))
    assert_one_line_error(
        audit(runs),
        f"{runs}/no_sync/history.json: epoch 2 held {every // 2} bytes of activations per micro-batch, every's epoch 1 "
        f"{every}: the same forward must hold the same",
        code=1,
    )
