"""train.py under faults and bad input: one clear line, a non-zero exit, no hang, nothing half-written."""

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest

from conftest import (
    PARTIAL_WINDOW_DEVICES,
    SMALL_RUN,
    assert_one_line_error,
    assert_refused,
    assert_train_error,
    copy_runs,
    read_json,
    run_in_process,
    run_python,
    start_train,
    subprocess_env,
    train,
    verify,
)
from ddp_no_sync_lab import experiment, files
from ddp_no_sync_lab.cli import LabError
from ddp_no_sync_lab.run import launch


def test_plain_python_stops_with_the_documents_world_size_message(tmp_path):
    result = run_python("train.py", "--mode", "no_sync", "--output", tmp_path / "out")
    line = assert_one_line_error(result, "ValueError: expected world_size=2, got 1")
    assert line.startswith("ValueError: expected world_size=2, got 1") and "torchrun --standalone" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "option, value, message",
    [
        ("--epochs", "0", "argument --epochs: must be at least 1, got 0"),
        ("--batch-size", "-50", "argument --batch-size: must be at least 1, got -50"),
        ("--accum-steps", "four", "argument --accum-steps: expected a positive whole number, got 'four'"),
        ("--progress-every", "-1", "argument --progress-every: must be a finite number of at least 0, got -1"),
        ("--mode", "sometimes", "argument --mode: invalid choice: 'sometimes'"),
        ("--bucket-cap-mb", "-1", "argument --bucket-cap-mb: must be a finite number of at least 0, got -1"),
        ("--comm-hook", "powersgd", "argument --comm-hook: invalid choice: 'powersgd'"),
        ("--bucket-cap-mb", "9e12", "argument --bucket-cap-mb: must be below 2**43 = 8796093022208"),
        ("--seed", "18446744073709551616", "argument --seed: must be from 0 to 18446744073709551611 for 5 epochs on 2"),
        ("--seed", "18446744073709551612", "argument --seed: must be from 0 to 18446744073709551611 for 5 epochs on 2"),
        ("--seed", "-1", "argument --seed: must be from 0 to 18446744073709551611 for 5 epochs on 2 ranks"),
    ],
)
def test_bad_numbers_and_choices_get_one_line(tmp_path, option, value, message):
    args = {"--mode": "every", "--output": str(tmp_path / "out"), option: value}
    result = run_in_process("train.py", *[part for pair in args.items() for part in pair])
    line = assert_one_line_error(result, message)
    assert line.startswith("train.py: error: ") and "--help" in line


def test_an_output_that_is_a_file_unwritable_or_foreign_is_refused(tmp_path):
    """launch.check_output, which rank 0 runs before any training (the one-line plumbing of a rank-0 refusal
    under torchrun: test_an_output_in_use_stops_a_second_run...)."""
    (tmp_path / "file").write_text("a file")
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "thesis.tex").write_text("keep me")
    refusals = {
        tmp_path / "file": f"--output {tmp_path}/file is a file; pass a folder path",
        Path("/sys/ddp-no-sync-lab/every"): "--output /sys/ddp-no-sync-lab/every is not writable",  # even to root
        tmp_path / "foreign": f"--output {tmp_path}/foreign holds files that are not lab artifacts",
    }
    for output, message in refusals.items():
        with pytest.raises(LabError) as refused:
            launch.check_output(output)
        assert str(refused.value).startswith(message)
    assert (tmp_path / "foreign" / "thesis.tex").read_text() == "keep me"


def test_device_cuda_without_gpus_names_the_remedy(shared_refusals):
    assert_refused(
        shared_refusals[1]["cuda"],
        "--device cuda needs one GPU per process: 2 processes on this node, 0 GPU(s) visible",
    )


def test_a_partial_last_window_stops_before_training_with_the_documents_message(shared_refusals):
    # 80 images per rank in micro-batches of 12: 7 micro-batches, not a multiple of 4.
    refused, stderr = shared_refusals
    line = assert_refused(
        stderr["partial-window"], "RuntimeError: 7 micro-batch-uri nu se împart exact la accum_steps=4"
    )
    assert "--partial-window scale" in line
    output = refused / "partial-window"
    assert not output.exists() and files.unfinished_runs(output) == []


def test_partial_window_scale_trains_and_is_audited(partial_window_runs, tmp_path):
    """Also at the bounds of --seed and --bucket-cap-mb, which are torch's own: 1 epoch on 2 ranks uses seeds up
    to 2**64 - 1; one past them is refused at parse time (test_bad_numbers_and_choices_get_one_line)."""
    assert experiment.seed_range_error(2**64 - 2, 1, 2) is None and experiment.seed_range_error(2**64 - 1, 1, 2)
    runs, results = partial_window_runs
    artifacts = copy_runs(runs, tmp_path / "artifacts")  # verify.py draws beside the runs it passes
    for mode, syncs in (("every", 7), ("no_sync", 2)):
        row = json.loads(results[mode].stdout.splitlines()[0])
        assert (row["optimizer_steps"], row["gradient_syncs"]) == (2, syncs)
        # --device auto on a machine without CUDA (CI's): one notice, from rank 0, and the run goes on on CPU.
        notices = [
            line
            for line in results[mode].stderr.splitlines()
            if "0 GPU(s) visible for 2 process(es) on node 0; running on CPU" in line
        ]
        assert len(notices) == (1 if PARTIAL_WINDOW_DEVICES[mode] == "auto" else 0), results[mode].stderr
    audit = verify(artifacts)
    assert audit.returncode == 0, audit.stdout + audit.stderr
    assert audit.stdout.splitlines()[-1] == "AUDIT PASSED: no_sync reduced gradient synchronizations by 3.5x"
    assert read_json(artifacts / "every" / files.RUN_RECORD_FILE)["config"]["seed"] == 2**64 - 2
    # The short window's micro-batches hold 12, 12 and 8 images: per sample (the default), each mean loss is
    # divided by 32 over its own, as the witness read at each loss (the full window keeps the document's 4).
    for mode in ("every", "no_sync"):
        row = read_json(artifacts / mode / files.HISTORY_FILE)[0]
        for rank in row["checklist"]["ranks"]:
            assert rank["loss_divisors"] == [[0, 4, 4], [4, 6, 2.666667], [6, 7, 4]]


def child_pids(parent):
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == parent:
            children.append(int(stat.parent.name))
    return children


def rank_pid(launcher, rank):
    for pid in child_pids(launcher):
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in environ:
            return pid
    raise AssertionError(f"no rank {rank} under torchrun {launcher}")


def start_long_run(output, image_data):
    """train.py into `output` for 50 epochs, in a session of its own, returned once training is under way."""
    options = ["--mode", "every", "--output", output, "--data-dir", image_data, *SMALL_RUN]
    launcher = start_train(*options, "--epochs", "50", "--progress-every", "0")
    for line in launcher.stderr:  # wait until training is under way
        if "train:" in line:
            break
    return launcher


def stop_run(launcher):
    if launcher.poll() is None:
        os.killpg(launcher.pid, signal.SIGKILL)
    launcher.wait()


@pytest.mark.torchrun
def test_an_output_in_use_stops_a_second_run_and_a_killed_rank_ends_the_first_keeping_the_previous_run(
    lab_runs, image_data, tmp_path
):
    """A long run into an output that holds a complete run. A second run into it stops at once naming it and leaves
    the first alone (before, the second removed every partial folder beside the output, the first run's included,
    and the first died mid-training; now the first holds the output's lock). Then one of the first run's ranks is
    killed: its job ends quickly, and the output still holds the previous complete run."""
    artifacts, _ = lab_runs
    output = tmp_path / "every"
    shutil.copytree(artifacts / "every", output)
    previous_run = read_json(output / files.RUN_RECORD_FILE)["run_id"]
    first = start_long_run(output, image_data)
    try:
        started = time.monotonic()
        result = train(image_data, output, "every", "--quiet")
        assert time.monotonic() - started < 90  # against a hang: 5x the 13 s measured on the AVX2 kind
        assert_train_error(
            result,
            f"train.py: error: [rank 0, node 0] --output {output} is being written by a run that is still going "
            "(train.py, pid",
            "wait for it to finish, or pass another --output",
        )
        assert first.poll() is None, "the first run died"
        assert len(files.unfinished_runs(output)) == 1  # the first run's partial folder, untouched
        os.kill(rank_pid(first.pid, 1), signal.SIGKILL)
        killed_at = time.monotonic()
        _, rest = first.communicate(timeout=120)
        elapsed = time.monotonic() - killed_at
    finally:
        stop_run(first)
    assert first.returncode != 0
    assert elapsed < 60, f"the job took {elapsed:.0f} s to end after a rank died"
    assert "rank      : 1 (local_rank: 1)" in rest and "Signal 9 (SIGKILL)" in rest, rest
    # The output still holds the previous complete run; the interrupted one is only a partial folder.
    assert read_json(output / files.RUN_RECORD_FILE)["run_id"] == previous_run
    assert len(files.unfinished_runs(output)) == 1
    shutil.copytree(artifacts / "no_sync", tmp_path / "no_sync")
    audit = verify(tmp_path)
    assert audit.returncode == 0, audit.stdout + audit.stderr
    assert f"every: run {previous_run}" in audit.stdout
    assert "note: an unfinished run" in audit.stdout and f"{output} holds run {previous_run}" in audit.stdout


@pytest.mark.torchrun
def test_a_rank_that_raises_takes_the_job_down(image_data, tmp_path):
    started = time.monotonic()
    result = train(image_data, tmp_path / "out", "every", env=subprocess_env(LAB_TEST_RAISE_AT_STEP="1:3"))
    assert result.returncode == 1
    assert time.monotonic() - started < 120
    assert "rank      : 1 (local_rank: 1)" in result.stderr  # torchrun's report names the failed rank
    assert "OutOfMemoryError: injected by the test" in result.stderr
    assert not (tmp_path / "out").exists()
