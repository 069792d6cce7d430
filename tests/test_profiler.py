"""train.py --profile-windows: the PyTorch profiler records windows 3 and 4 of epoch 1 of the shared runs
(conftest.PROFILED), and verify.py checks that its c10d calls are the audit's, rank by rank."""

import itertools
import json

import pytest

from conftest import assert_one_line_error, assert_refused, copy_runs, read_json, verify
from ddp_no_sync_lab import files
from ddp_no_sync_lab.report import tables

# Micro-batches 8-15 hold 2 windows of 4: every synchronizes all 8, no_sync the last of each window (11, 15);
# each window ends in one optimizer step, with the checklist's average-witness all-reduce (in its pre-hook) and
# the rank-agreement all-reduce; DDP broadcasts the buffers (2 dtypes) before each forward that follows a
# synchronized one.
EXPECTED_CALLS = {
    "every": {"c10d::allreduce_": 8 + 2 + 2, "c10d::broadcast_": 2 * 8},
    "no_sync": {"c10d::allreduce_": 2 + 2 + 2, "c10d::broadcast_": 2 * 2},
}
LAB_ALLREDUCES = 2 + 2  # in the 2 profiled windows: one rank-agreement and one average-witness each


@pytest.fixture
def runs(lab_runs, tmp_path):
    return copy_runs(lab_runs[0], tmp_path / "artifacts")


def test_each_rank_records_the_calls_and_their_executions_in_the_profiled_windows(lab_runs):
    artifacts, _ = lab_runs
    for mode, calls in EXPECTED_CALLS.items():
        profile = read_json(artifacts / mode / files.PROFILE_FILE)
        assert (profile["windows"], profile["micro_batches"]) == (2, [8, 16])
        assert [summary["rank"] for summary in profile["ranks"]] == [0, 1]
        for summary in profile["ranks"]:
            fsdp = {"c10d::_allgather_base_": 0, "c10d::_reduce_scatter_base_": 0}  # DDP: none of FSDP's calls
            assert summary["calls"] == {**calls, **fsdp}, summary
            # gloo executes a reduce-scatter as an all-reduce: executions are counted per kind of execution.
            assert summary["executions"] == {**calls, "c10d::_allgather_base_": 0}, summary
            assert [span[0] for span in summary["micro_batches"]] == list(range(8, 16))
            kinds = [kind for kind, _, _ in summary["collectives"]]
            assert kinds.count("gradient all-reduce") == calls["c10d::allreduce_"] - LAB_ALLREDUCES
            assert kinds.count("rank-agreement all-reduce") == kinds.count("average-witness all-reduce") == 2
            assert kinds.count("broadcast") == calls["c10d::broadcast_"]
            # Each window ends in its step: the average witness (the step's pre-hook), then the ranks' agreement,
            # both after the window's last gradient sync and inside its last micro-batch.
            last_micro_batches = [span for span in summary["micro_batches"] if span[0] in (11, 15)]
            witnesses = [start for kind, start, _ in summary["collectives"] if kind == "average-witness all-reduce"]
            agreements = [start for kind, start, _ in summary["collectives"] if kind == "rank-agreement all-reduce"]
            for witness, agreement, (_, begin, end) in zip(witnesses, agreements, last_micro_batches):
                assert begin < witness < agreement < end
            assert summary["audit"]["gradient_syncs"] == calls["c10d::allreduce_"] - LAB_ALLREDUCES
            assert summary["optimizer_steps"] == 2  # the profiler's own Optimizer.step ranges
            assert summary["compute_seconds_per_micro_batch"] > 0  # measured (never judged here)


def test_each_ranks_trace_opens_as_a_chrome_trace_of_the_profiled_micro_batches(lab_runs):
    artifacts, _ = lab_runs
    for (mode, calls), trace in itertools.product(EXPECTED_CALLS.items(), files.profile_trace_files(2)):
        events = json.loads((artifacts / mode / trace).read_bytes())["traceEvents"]
        names = [event.get("name") for event in events]
        assert sorted(name for name in names if name.startswith("micro-batch ")) == sorted(
            f"micro-batch {i}" for i in range(8, 16)
        )
        assert names.count("c10d::allreduce_") == names.count("gloo:all_reduce") == calls["c10d::allreduce_"]
        assert names.count("c10d::broadcast_") == names.count("gloo:broadcast") == calls["c10d::broadcast_"]


def reseal(folder, name, change):
    """Change a run's file and its checksum in run.json, as someone who wanted to fool the audit would."""
    path = folder / name
    value = read_json(path)
    change(value)
    path.write_text(json.dumps(value))
    record = read_json(folder / files.RUN_RECORD_FILE)
    record["files"][name] = {"bytes": path.stat().st_size, "sha256": files.sha256_file(path)}
    (folder / files.RUN_RECORD_FILE).write_text(json.dumps(record))


def audit(artifacts):
    return verify(artifacts)


def test_a_profiler_count_that_disagrees_with_the_audit_fails(runs):
    reseal(
        runs / "no_sync",
        files.PROFILE_FILE,
        lambda profile: profile["ranks"][1]["calls"].update({"c10d::allreduce_": 5}),
    )
    assert_one_line_error(
        audit(runs),
        f"{runs}/no_sync/profile.json: rank 1: the profiler saw 5 c10d::allreduce_ calls in epoch 1, micro-batches "
        "8-15, the audit counted 2 hook calls + 0 used-parameter-map all-reduces + 2 rank-agreement all-reduces + 2 "
        "average-witness all-reduces = 6: the audit and its witness disagree",
        code=1,
    )


def test_an_audit_that_disagrees_with_the_positions_fails(runs):
    reseal(runs / "every", files.PROFILE_FILE, lambda profile: profile["ranks"][0]["audit"].update(gradient_syncs=7))
    assert_one_line_error(
        audit(runs),
        "rank 0: the audit counted 7 gradient syncs in epoch 1, micro-batches 8-15, the history's positions put 8 there",
        code=1,
    )


def test_a_call_that_gloo_never_executed_fails(runs):
    reseal(
        runs / "every",
        files.PROFILE_FILE,
        lambda profile: profile["ranks"][0]["executions"].update({"c10d::broadcast_": 15}),
    )
    assert_one_line_error(audit(runs), "rank 0: 16 c10d::broadcast_ calls but 15 executions on gloo's threads", code=1)


def test_a_profile_that_is_not_the_runs_own_fails(runs):
    (runs / "every" / files.PROFILE_FILE).unlink()
    record = read_json(runs / "every" / files.RUN_RECORD_FILE)
    del record["files"][files.PROFILE_FILE]
    (runs / "every" / files.RUN_RECORD_FILE).write_text(json.dumps(record))
    result = audit(runs)  # one run profiled and the other not: audited, but no timeline
    assert result.returncode == 0, result.stderr
    assert "note: timeline.png needs both runs profiled (train.py --profile-windows K); every was not" in result.stdout
    assert not (runs / tables.TIMELINE_FILE).exists()
    (runs / "every" / files.PROFILE_FILE).write_bytes((runs / "no_sync" / files.PROFILE_FILE).read_bytes())
    assert_one_line_error(
        audit(runs), f"{runs}/every/profile.json: is not listed in run.json: it does not come from this run", code=1
    )


def test_more_windows_than_an_epoch_holds_is_one_line(shared_refusals):
    refused, stderr = shared_refusals
    assert_refused(
        stderr["profile-windows"],
        "--profile-windows 4 needs 6 windows of 4 micro-batches in an epoch (one skipped, one of warm-up, 4 profiled); "
        "an epoch here has 20 micro-batches: pass --profile-windows 3 or less",
    )
    output = refused / "profile-windows"
    assert not output.exists() and files.unfinished_runs(output) == []


@pytest.mark.parametrize(
    "change, message",
    [
        (
            lambda summary: summary.pop("collectives"),
            "rank 1: micro_batches must be [index, start, end] and collectives [kind, start, end] spans",
        ),
        (
            lambda summary: summary["micro_batches"][0].pop(),
            "rank 1: micro_batches must be [index, start, end] and collectives [kind, start, end] spans",
        ),
        (
            lambda summary: summary["collective_seconds"].update(broadcast="fast"),
            "rank 1: collective_seconds, compute_seconds_per_micro_batch and the audit's comm_seconds must be numbers",
        ),
    ],
)
def test_a_profile_with_malformed_spans_is_one_line(runs, change, message):
    reseal(runs / "every", files.PROFILE_FILE, lambda profile: change(profile["ranks"][1]))
    assert_one_line_error(audit(runs), f"{runs}/every/profile.json: {message}", code=1)
