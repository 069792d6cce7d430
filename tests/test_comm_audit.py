"""The audit counts what really crosses between the ranks: checked against the PyTorch profiler's record of
the c10d collectives, and against the counts ddp_no_sync_lab/experiment.py derives from the configuration and the model."""

import threading
import time

import pytest
import torch

import train
from ddp_no_sync_lab import cli, experiment
from ddp_no_sync_lab.audit import instruments
from ddp_no_sync_lab.strategies import ddp
from model import CifarCNN

EVALUATION_ALLREDUCES = 2  # evaluate() all-reduces its loss/count totals and its confusion matrix
# train_epoch adds two small all-reduces per optimizer step: the ranks' fingerprints (instruments.ranks_agree) and the
# checklist's projections of the ranks' local gradients (ddp_no_sync_lab.audit.checklist), counted as
# witness_allreduces.


@pytest.fixture(scope="module")
def measured(worker_results):
    return worker_results["comm_audit.py"]


@pytest.fixture(scope="module")
def rows(measured):
    return measured["rows"]


@pytest.mark.torchrun
def test_hook_calls_are_the_profilers_gradient_allreduces(rows):
    """With every lever: the hook's calls and DDP's own used-parameter-map all-reduces (searching for unused
    parameters: one per sync; a static graph: one, at the first) are the profiler's all-reduces, less the lab's."""
    for row in rows:
        assert row["audit"]["witness_allreduces"] == row["optimizer_steps"], row
        lab_allreduces = row["optimizer_steps"] + row["audit"]["witness_allreduces"] + EVALUATION_ALLREDUCES
        ddp_allreduces = row["audit"]["sync_bucket_calls"] + row["audit"]["used_map_allreduces"]
        assert ddp_allreduces == row["profiler_allreduces"] - lab_allreduces, row
    audits = {(row["setting"], row["mode"], row["epoch"]): row["audit"] for row in rows}
    used_map = {run: audit["used_map_allreduces"] for run, audit in audits.items()}
    searching, static = "find_unused_parameters=True, bucket_cap_mb=0.99", "static_graph=True, bucket_cap_mb=0.5"
    assert used_map[searching, "no_sync", 2] == 2 and used_map["documented", "every", 1] == 0
    assert (used_map[static, "every", 1], used_map[static, "every", 2]) == (1, 0)
    # By hand, 8 syncs per epoch in every mode: searching with 0.99 MiB buckets, 3 per sync from the start; a
    # static graph with 0.5 MiB buckets, its first two syncs in one bucket, then 3; without those, the first.
    assert audits[searching, "every", 1]["sync_bucket_calls"] == 8 * 3
    assert audits[static, "every", 1]["sync_bucket_calls"] == 2 + 6 * 3
    assert (
        audits["bucket_cap_mb=0.5, broadcast_buffers=False, comm_hook=bf16", "every", 1]["sync_bucket_calls"]
        == 1 + 7 * 3
    )


@pytest.mark.torchrun
def test_buffer_and_rebuild_broadcasts_are_the_profilers_broadcasts(rows):
    for row in rows:
        audit = row["audit"]
        assert (
            audit["buffer_broadcast_collectives"] + audit["rebuild_broadcast_collectives"] == row["profiler_broadcasts"]
        ), row
        rebuilds = row["epoch"] == 1 and not row["setting"].startswith("find_unused")  # that one never rebuilds
        assert audit["buffer_broadcast_collectives"] > 0 and audit["rebuild_broadcast_collectives"] == 2 * rebuilds, row


@pytest.mark.torchrun
def test_after_an_evaluation_every_rank_holds_rank_0s_batchnorm_buffers(rows):
    """Each rank's last training forward updates its own running statistics; the evaluation's first forward
    broadcasts rank 0's, so the model every rank evaluates (and rank 0 saves) is one."""
    for row in rows:
        assert row["buffers_equal"] == {"after training": False, "after evaluation": True}, row


@pytest.mark.torchrun
def test_measured_counts_equal_the_expected_counts(rows):
    sizes = experiment.comm_sizes(CifarCNN())
    for row in rows:
        config = {
            "train_size": row["train_size"],
            "world_size": row["world_size"],
            "batch_size": 4,
            "accum_steps": 4,
            "partial_window": "error",
            "epochs": max(row["epoch"] for row in rows),
            **row["settings"],
        }
        expected = experiment.expected_epoch_counts(config, row["mode"], row["epoch"], sizes)
        assert {key: expected[key] for key in row["audit"]} == row["audit"], row


@pytest.mark.torchrun
def test_no_sync_cuts_every_kind_of_collective(rows):
    documented = [row for row in rows if row["setting"] == "documented"]
    every = {row["epoch"]: row for row in documented if row["mode"] == "every"}
    no_sync = {row["epoch"]: row for row in documented if row["mode"] == "no_sync"}
    for epoch in every:
        # 8 micro-batches in windows of 4: 8 against 2 gradient syncs.
        assert (every[epoch]["audit"]["gradient_syncs"], no_sync[epoch]["audit"]["gradient_syncs"]) == (8, 2)
        assert every[epoch]["profiler_broadcasts"] > no_sync[epoch]["profiler_broadcasts"]


@pytest.mark.torchrun
def test_the_bucket_size_must_be_explicit(measured):
    """SPEC correction 5: with DDP's default bucket_cap_mb the first bucket is capped at 1 MiB after the
    rebuild, so each sync makes two hook calls; the lab's explicit 25 MB keeps one."""
    assert measured["hook_calls_per_sync"] == {"default": [1, 2, 2], "25": [1, 1, 1]}


def test_collective_time_adds_up_when_callbacks_run_on_several_threads_at_once(monkeypatch):
    """gloo runs the futures' callbacks of several buckets on its own threads; each adds its time to one sum.
    Here every stop adds exactly 1.0 s, from 8 threads at once, and reading the clock lets the other threads
    run (as a real clock read can): an addition written as `total += clock() - started` reads the total
    before the clock and loses the additions made meanwhile."""

    def clock_that_yields():
        time.sleep(0)
        return 1.0

    monkeypatch.setattr(instruments.time, "perf_counter", clock_that_yields)
    clock = instruments.CollectiveClock("cpu")
    stops_per_thread = 2_000

    def stop_many():
        for index in range(stops_per_thread):
            clock.stop((index, 0.0), ("sync", "all_gather", "other", "other")[index % 4])

    threads = [threading.Thread(target=stop_many) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert clock.total() == 8 * stops_per_thread
    # and the syncs and all-gathers call by call, taken once: each call's 1.0 s, none lost
    calls = clock.take_calls()
    assert calls == {"sync": [1.0] * 2 * stops_per_thread, "all_gather": [1.0] * 2 * stops_per_thread}
    assert clock.take_calls() == {"sync": [], "all_gather": []}


@pytest.mark.torchrun
def test_each_ranks_wait_is_its_time_beyond_the_least_any_rank_spent_in_each_call(measured):
    """Syncs of 1 and 3 s on rank 0, 2 and 1 s on rank 1 (whose second call completed first): the least per
    call is 1 and 1 s, so rank 0 waited 0 + 2 s and rank 1 1 + 0 s (a total beyond the least total would say
    1 and 0 s; calls paired as they completed, 1 and 0 s too); the all-gathers of 0.5 and 0.25 s: rank 0 waited
    0.25 s. Ranks that timed different numbers of calls stop the run."""
    assert [rank["timed"] for rank in measured["waits"]] == [[4.0, 2.0, 0.5, 0.25], [3.0, 1.0, 0.25, 0.0]]
    assert all("different numbers of syncs or all-gathers" in rank["refused"] for rank in measured["waits"])


def counting_allreduce_hook(comm_audit, bucket):
    """Named as train.py's counting hook, and all-reducing as it does, but counting nothing."""
    return torch.distributed.all_reduce(bucket.buffer(), group=comm_audit.group, async_op=True).get_future()


@pytest.mark.parametrize(
    "change, named",
    [
        ({"broadcast_buffers": False}, "broadcast_buffers False (expected True)"),
        ({"find_unused_parameters": True}, "find_unused_parameters True (expected False)"),
        ({"gradient_as_bucket_view": True}, "gradient_as_bucket_view True (expected False)"),
        ({"static_graph": True}, "static_graph True (expected False)"),
        ({"bucket_cap_mb": 1}, "bucket_bytes_cap 1048576 (expected 26214400)"),
        ({"comm_hook": "bf16"}, "counted hook 'bf16' (expected 'allreduce')"),
        ({"hooks": "none"}, "gradient comm hooks [] (expected ['counting_allreduce_hook'])"),
        (
            {"hooks": "same name"},
            "comm hooks ['test_comm_audit.counting_allreduce_hook'] (expected ['counting_allreduce",
        ),
        ({"hooks": "buffer"}, "buffer comm hook True (expected False)"),
    ],
)
def test_ddp_settings_the_counts_rely_on_are_checked_when_wrapping(one_process_group, change, named):
    """The settings DDP holds, read back from the wrapper, against the run's (here the documented ones)."""
    cpu, documented = torch.device("cpu"), experiment.DDP_DEFAULTS
    ddp.check_ddp_settings(train.wrap_model(CifarCNN(), cpu, 1)[0], documented, train.counting_allreduce_hook)
    hooks = change.pop("hooks", "counting")
    comm_hook = change.pop("comm_hook", "allreduce")
    ddp_model = ddp.AuditedDDP(CifarCNN(), **{"bucket_cap_mb": experiment.BUCKET_CAP_MB, **change})
    ddp_model.comm_audit = instruments.CommAudit(1, comm_hook=comm_hook)
    if hooks == "same name":  # another function of the counting hook's name: found by identity, not by name
        ddp_model.register_comm_hook(ddp_model.comm_audit, counting_allreduce_hook)
    elif hooks != "none":
        ddp_model.register_comm_hook(ddp_model.comm_audit, train.counting_allreduce_hook)
    if hooks == "buffer":
        ddp_model._register_buffer_comm_hook(None, lambda state, buffers: [])
    with pytest.raises(cli.LabError) as caught:
        ddp.check_ddp_settings(ddp_model, documented, train.counting_allreduce_hook)
    message = str(caught.value)
    assert message.startswith("DDP is wrapped with settings the audit's expected counts do not assume: ")
    assert named in message and message.endswith("or change experiment.expected_epoch_counts with them")
