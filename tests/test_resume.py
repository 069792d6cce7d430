"""A stopped run resumes where it stopped, bit for bit: a worker killed under torchrun --max-restarts, a
launcher stopped by SIGTERM (a scheduler's preemption) and started again with --resume, two nodes restarted,
kills at every boundary (tests/inject/sitecustomize.py's LAB_TEST_KILL_AT, beneath the lab's code); and a
saved state that was altered, or another configuration or mode, is refused with one line."""

import os
import shutil
import signal
import time

import pytest
import torch

from conftest import (
    MODES,
    REFUSED,
    SMALL_RUN,
    TIMING,
    assert_ok,
    assert_refused,
    read_json,
    start_train,
    subprocess_env,
    train,
    train_in_one_start,
    verify,
)
from ddp_no_sync_lab import files
from ddp_no_sync_lab.run import resume
from test_faults import rank_pid, stop_run
from test_nodes import node_folders, start_nodes, two_nodes

KILLED_WRITE = ".history.json.tmp-host-1-0a0b0c0d"  # a temporary file whose write was killed before its rename
CHECKPOINTS = ["--checkpoint-every-windows", "2"]  # saves after windows 2 and 4 of each epoch, and at its end


def start(output, data, *extra):
    """torchrun (two ranks, in a session of its own) running train.py into `output`, with progress lines."""
    return start_train(
        "--mode", "no_sync", "--output", output, "--data-dir", data, *SMALL_RUN, "--progress-every", "0", *extra
    )


def wait_for(launcher, fragment):
    """Read the launcher's stderr until a line holds `fragment`; returns what was read."""
    seen = []
    for line in launcher.stderr:
        seen.append(line)
        if fragment in line:
            return seen
    raise AssertionError(f"never saw {fragment!r}:\n{''.join(seen[-30:])}")


def outcome(launcher, timeout=300):
    stdout, rest = launcher.communicate(timeout=timeout)
    return launcher.returncode, stdout, rest


def newest_save(partial):
    """The newest complete save in an unfinished run's folder: (its state file, its record)."""
    number = resume.saves(partial)[-1]
    return (partial / name.format(number=number) for name in (resume.STATE_FILE, resume.STATE_RECORD))


def same_run(first, second):
    """Two run folders of one configuration: model.pt (weights and BatchNorm buffers) and report equal, and the
    histories equal but for times, where a run resumed and what that restart cost."""
    weights = [torch.load(folder / "model.pt", weights_only=True)["model"] for folder in (first, second)]
    assert all(torch.equal(weights[0][name], weights[1][name]) for name in weights[0])
    reports = [read_json(folder / "report.json") for folder in (first, second)]
    for report in reports:
        report.pop("run_id"), report["config"].pop("nodes")  # a two-node run is the one-node run's otherwise
    assert reports[0] == reports[1]
    restart = TIMING | {
        "resumed_at",
        "rebuild_broadcast_collectives",
        "buffer_broadcast_collectives",
        "broadcast_bytes",
    }
    histories = [read_json(folder / "history.json") for folder in (first, second)]
    assert [{k: v for k, v in row.items() if k not in restart} for row in histories[0]] == [
        {k: v for k, v in row.items() if k not in restart} for row in histories[1]
    ]
    return histories[1]


@pytest.fixture(scope="module")
def uninterrupted(lab_runs):
    """The runs the stopped ones must equal: the session's shared pair, every and no_sync never stopped (profiled,
    which changes no number: test_e2e.py)."""
    artifacts, _ = lab_runs
    return artifacts


@pytest.fixture(scope="module")
def preempted(image_data, tmp_path_factory):
    """no_sync stopped by SIGTERM to its launcher in epoch 2: the ranks finish their window, save and exit."""
    output = tmp_path_factory.mktemp("preempted") / "no_sync"
    launcher = start(output, image_data)
    try:
        wait_for(launcher, "epoch 2/2 train: 6/20")
        started = time.monotonic()
        launcher.send_signal(signal.SIGTERM)
        code, _, stderr = outcome(launcher)
        seconds = time.monotonic() - started
    finally:
        stop_run(launcher)
    return output, code, stderr, seconds


@pytest.mark.torchrun
def test_sigterm_stops_every_rank_at_a_window_end_with_its_state_saved(preempted):
    output, code, stderr, seconds = preempted
    assert seconds < 60  # against a hang, not a speed
    lines = [line for line in stderr.splitlines() if "preempted at epoch" in line]
    assert lines == ["train.py: preempted at epoch 2, window 2: its state is saved; resume with --resume"]
    assert code != 0  # torchrun reports the signal it got; the ranks exited with resume.PREEMPTED_EXIT_CODE
    (partial,) = files.unfinished_runs(output)
    state, record = newest_save(partial)
    saved = read_json(record)
    assert (saved["epoch"], saved["micro_batch"]) == (2, 8)
    assert saved["state"]["bytes"] == state.stat().st_size
    assert sorted(path.name for path in partial.glob("resume_state*")) == sorted(
        [state.name, record.name]
    )  # one save kept
    assert not output.exists()


@pytest.fixture(scope="module")
def preempted_copies(preempted, image_data, tmp_path_factory):
    """Four copies of the preempted run's output, started again in one torchrun start: two whose newest saved state
    is damaged (cut short; its last byte altered), each refused with --resume; one resumed; one started without
    --resume. Each copy's output, its unfinished run's folder, and its run's output, by name."""
    output, _, _, _ = preempted
    root = tmp_path_factory.mktemp("preempted-copies")
    copies = {}
    for name in ("truncated", "altered", "resumed", "restarted"):
        shutil.copytree(output.parent, root / name)
        (partial,) = files.unfinished_runs(root / name / "no_sync")
        copies[name] = (root / name / "no_sync", partial)
    for damage in ("truncated", "altered"):
        (copies[damage][1] / KILLED_WRITE).write_bytes(b"half a writ")
        state, _ = newest_save(copies[damage][1])
        content = state.read_bytes()
        state.write_bytes(
            content[: len(content) // 2] if damage == "truncated" else content[:-1] + bytes([content[-1] ^ 1])
        )
    common = ["--mode", "no_sync", "--data-dir", image_data, *SMALL_RUN, "--quiet"]
    runs = [[REFUSED, *common, "--output", copies[damage][0], "--resume"] for damage in ("truncated", "altered")]
    runs.append([*common, "--output", copies["resumed"][0], "--resume"])
    runs.append([*common, "--output", copies["restarted"][0], "--epochs", "1"])
    outputs = train_in_one_start(root / "logs", *runs)
    return {name: (*copies[name], result) for name, result in zip(copies, outputs)}


@pytest.mark.torchrun
def test_resume_finishes_the_preempted_run_bit_for_bit(preempted_copies, uninterrupted):
    copy, _, result = preempted_copies["resumed"]
    assert "train.py: resuming run" in result.stderr
    history = same_run(uninterrupted / "no_sync", copy)
    assert [row["resumed_at"] for row in history] == [[], [8]]
    shutil.copytree(uninterrupted / "every", copy.parent / "every")
    assert verify(copy.parent).returncode == 0


@pytest.mark.torchrun
@pytest.mark.parametrize("damage", ["truncated", "altered"])
def test_a_saved_state_cut_short_or_altered_is_refused(preempted_copies, damage):
    _, partial, result = preempted_copies[damage]
    state, record = newest_save(partial)
    assert_refused(result.stderr, f"{state} is not the state {record} recorded", "cut short or altered")
    assert state.is_file() and (partial / KILLED_WRITE).is_file()  # refused, nothing removed


@pytest.mark.torchrun
def test_a_first_start_without_resume_replaces_the_unfinished_run(preempted_copies):
    output, partial, _ = preempted_copies["restarted"]
    assert not partial.exists() and read_json(output / "history.json")[0]["resumed_at"] == []


@pytest.mark.torchrun
def test_two_nodes_restarted_after_one_dies_finish_and_pass_the_audit(uninterrupted, tmp_path, image_data):
    """Node 1's worker killed in epoch 2; both torchrun agents restart their workers (c10d rendezvous,
    --max-restarts=1), which resume from the last save and finish the run: the one-node run's model, and with
    every on the same two nodes, verify.py passes."""
    node0, node1 = node_folders(tmp_path, image_data)
    common = ["--output-placeholder", "--data-dir", "data", *SMALL_RUN, *CHECKPOINTS, "--progress-every", "0"]
    every, no_sync = (["--mode", mode, "--output", f"artifacts/{mode}", *common[1:]] for mode in ("every", "no_sync"))
    results, _ = two_nodes([node0, node1], every, every)
    for result in results:
        assert_ok(result)
    launchers = start_nodes([node0, node1], no_sync, no_sync, restarts=1)
    try:
        for line in launchers[0].stderr:
            if "epoch 2/2 train: 10/20" in line:
                break
        os.kill(rank_pid(launchers[1].pid, 1), signal.SIGKILL)
        outputs = [launcher.communicate(timeout=300) for launcher in launchers]
    finally:
        for launcher in launchers:
            launcher.kill()
    assert [launcher.returncode for launcher in launchers] == [0, 0], outputs[0][1][-3000:]
    history = same_run(uninterrupted / "no_sync", node0 / "artifacts" / "no_sync")
    assert sum(len(row["resumed_at"]) for row in history) == 1
    result = verify(node0 / "artifacts")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no_sync resumed at epoch 2" in result.stdout


def test_only_this_job_and_this_configuration_count_as_finished(tmp_path):
    """A restart skips training only for the run its own torchrun job published with its own configuration and
    mode: a later job (another token, even with the same --rdzv-id), other options or the other mode train
    again; --resume (no job named) takes any job's."""
    config = {"epochs": 2, "hardware": ["CPU AVX2"]}
    (tmp_path / files.RUN_RECORD_FILE).write_bytes(
        files.json_bytes({"run_id": "r1", "mode": "every", "config": config, "launch_id": "job-a"})
    )
    ours = {**config, "mode": "every"}
    assert resume.finished_run(tmp_path, {**ours, "hardware": ["CPU AVX512"]}, "job-a") == "r1"
    assert resume.finished_run(tmp_path, ours) == "r1"
    assert resume.finished_run(tmp_path, ours, "job-b") is None
    assert resume.finished_run(tmp_path, {**ours, "epochs": 3}, "job-a") is None
    assert resume.finished_run(tmp_path, {**ours, "mode": "no_sync"}) is None
    assert resume.finished_run(tmp_path / "nothing", ours, "job-a") is None


# ----------------------------------------------------------------------------- every boundary


@pytest.mark.torchrun
def test_kills_at_every_boundary_resume_bit_for_bit_and_an_interrupted_publish_is_finished(
    uninterrupted, image_data, tmp_path
):
    """One torchrun job whose worker is killed (SIGKILL, beneath the lab's code) at a new place in each start:
    after the first window's save; inside the epoch's last save, between its state file and its record (the
    earlier save is kept and wins); right after an epoch's end save; during a validation (after the epoch's last
    window, which leaves its save to the epoch's end); during the test evaluation; between publish's two renames.
    Each restart resumes from the newest complete save; the last one finds the run complete, publishes it and
    trains nothing. The run equals the uninterrupted one and passes verify.py."""
    artifacts = tmp_path / "artifacts"
    for mode in MODES:  # an earlier no_sync run in the output: the publish replaces it
        shutil.copytree(uninterrupted / mode, artifacts / mode)
    previous = read_json(artifacts / "no_sync" / files.RUN_RECORD_FILE)["run_id"]
    kills = "saved:1,saving:4,saved:1,eval:1,eval:2,publish"
    result = train(
        image_data,
        artifacts / "no_sync",
        "no_sync",
        "--checkpoint-every-windows",
        "1",
        "--quiet",
        env=subprocess_env(LAB_TEST_KILL_AT=kills),
        launcher=["--max-restarts=6"],
    )
    assert_ok(result)
    resumed = [line.split(" at ")[1] for line in result.stderr.splitlines() if line.startswith("train.py: resuming")]
    assert resumed == [
        f"epoch {epoch}, micro-batch {index}, from its saved state"
        for epoch, index in [(1, 4), (1, 16), (2, 0), (2, 16), (3, 0)]
    ]
    record = read_json(artifacts / "no_sync" / files.RUN_RECORD_FILE)
    assert record["run_id"] != previous
    assert f"train.py: run {record['run_id']} was complete but not yet in place; published it into " in result.stderr
    assert f"train.py: run {record['run_id']} is finished; nothing left to do" in result.stderr
    assert sorted(path.name for path in artifacts.iterdir()) == [".no_sync.lock", "every", "no_sync"]
    assert all(files.is_artifact(path.name) for path in (artifacts / "no_sync").iterdir())
    history = same_run(uninterrupted / "no_sync", artifacts / "no_sync")
    assert [row["resumed_at"] for row in history] == [[4, 16], [0, 16]]
    assert [(segment["epoch"], segment["micro_batch"]) for segment in record["segments"]] == [
        (1, 0),
        (1, 4),
        (1, 16),
        (2, 0),
        (2, 16),
        (3, 0),
    ]
    checked = verify(artifacts)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    # One machine: no change of hardware to note; only the timeline's (the never-stopped every was profiled).
    assert [line for line in checked.stdout.splitlines() if line.startswith("note:")] == [
        "note: timeline.png needs both runs profiled (train.py --profile-windows K); no_sync was not"
    ]


@pytest.mark.torchrun
def test_sigterm_in_an_epochs_last_window_stops_at_its_end_and_resumes_only_into_the_same_run(
    uninterrupted, image_data, tmp_path
):
    """SIGTERM (rank 0's, beneath the lab) in the last window of epoch 1 stops the run after that epoch's
    validation, saved; a resume in the other mode with another DDP lever is refused, naming both; a temporary file a
    killed write left is never published; the resumed run is the uninterrupted one, and verify.py notes a
    change of hardware between its segments."""
    artifacts = tmp_path / "artifacts"
    output = artifacts / "no_sync"
    stopped = train(image_data, output, "no_sync", "--quiet", env=subprocess_env(LAB_TEST_KILL_AT="term:18"))
    assert stopped.returncode != 0
    assert "train.py: preempted after epoch 1: its state is saved; resume with --resume" in stopped.stderr
    (partial,) = files.unfinished_runs(output)
    _, record = newest_save(partial)
    assert (read_json(record)["epoch"], read_json(record)["micro_batch"]) == (2, 0)
    # A refusal leaves it (test_a_saved_state_cut_short_or_altered_is_refused); the resume must not publish it.
    (partial / KILLED_WRITE).write_bytes(b"half a writ")
    common = ["--output", output, "--data-dir", image_data, *SMALL_RUN, "--resume", "--quiet"]
    refused, _ = train_in_one_start(
        tmp_path / "logs", [REFUSED, "--mode", "every", *common, "--bucket-cap-mb", "1"], ["--mode", "no_sync", *common]
    )
    assert_refused(
        refused.stderr,
        f"--resume: the unfinished run in {partial} was started with another configuration (bucket_cap_mb 25.0 vs "
        "1.0; mode 'no_sync' vs 'every')",
    )
    assert all(files.is_artifact(path.name) for path in output.iterdir())
    history = same_run(uninterrupted / "no_sync", output)
    assert [row["resumed_at"] for row in history] == [[], [0]]
    shutil.copytree(uninterrupted / "every", artifacts / "every")
    run_record = read_json(output / files.RUN_RECORD_FILE)
    run_record["segments"][0]["hardware"] = ["CPU AVX2"]  # as if it had started on another machine
    (output / files.RUN_RECORD_FILE).write_bytes(files.json_bytes(run_record))
    checked = verify(artifacts)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert (
        f"note: no_sync: run {run_record['run_id']} resumed on other hardware (from epoch 1, micro-batch 0: CPU AVX2; "
        f"from epoch 2, micro-batch 0: {', '.join(run_record['config']['hardware'])}): it is the same computation, "
        "but bit-identity with an uninterrupted run is not promised across hardware"
    ) in checked.stdout
