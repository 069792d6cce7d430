"""--strategy fsdp (ddp_no_sync_lab/strategies/fsdp.py, docs/fsdp.md): FSDP2's shards under the same audit. The pair
trained on the small image data passes verify.py with every collective's count derived from the units; FSDP's own
reduction (torch 2.8's gloo sums) and a no_sync that does nothing, both broken beneath the lab's code, are refused;
options FSDP has no counterpart for are refused in one line. tests/test_equivalence.py proves the updates."""

import inspect
import shutil

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

import train
from conftest import (
    PROFILED,
    SMALL_RUN,
    TIMING,
    WORKERS,
    assert_ok,
    assert_one_line_error,
    copy_runs,
    module_runs,
    module_start,
    read_json,
    run_in_process,
    run_python,
    torchrun,
    verify,
)
from ddp_no_sync_lab import experiment
from ddp_no_sync_lab.audit import instruments
from ddp_no_sync_lab.strategies import fsdp
from ddp_no_sync_lab.strategies.surface import Wrapper
from model import CifarCNN
from test_nodes import node_folders, same_run, two_nodes

FSDP = ["--strategy", "fsdp"]
# FSDP2 broken beneath the lab (tests/inject): its ReduceOp.AVG left to gloo, and set_requires_gradient_sync ignored.
BROKEN_BENEATH = (("uncorrected", "every"), ("sync_ignored", "no_sync"))


def test_both_wrappers_offer_the_surface_train_py_asks_of_a_strategy(one_process_group):
    """DDP's AuditedDDP (as train.py wraps) and FSDP2's ShardedModel each have every member strategies/surface.py
    declares; plain DDP, with no counts and no full state dict, has not."""
    methods = (name for name, value in vars(Wrapper).items() if inspect.isfunction(value))
    members = {*Wrapper.__annotations__, *(name for name in methods if name == "__call__" or not name.startswith("_"))}
    declared = "module comm_audit broadcast_buffers __call__ no_sync parameters train eval broadcast_rank_0_buffers"
    assert members == {*declared.split(), "full_state_dict"}
    audited, _ = train.wrap_model(CifarCNN(), torch.device("cpu"), 1)
    sharded = fsdp.ShardedModel(CifarCNN(), instruments.CommAudit(1), None)
    plain = DistributedDataParallel(CifarCNN())
    wrappers = {"audited": audited, "sharded": sharded, "plain": plain}
    missing = {
        name: sorted(member for member in members if not hasattr(wrapper, member)) for name, wrapper in wrappers.items()
    }
    assert missing == {
        "audited": [],
        "sharded": [],
        "plain": ["broadcast_rank_0_buffers", "comm_audit", "full_state_dict"],
    }


@module_runs("fsdp")
def fsdp_pair_runs(folder, image_data):
    """The fsdp pair (in artifacts/), and beside it (in broken/) a run of each mode with FSDP broken beneath the lab,
    in the session's module start."""
    common = ["--data-dir", image_data, *SMALL_RUN, *FSDP, "--quiet"]
    runs = [["--mode", mode, "--output", folder / "artifacts" / mode, *common, *PROFILED] for mode in experiment.MODES]
    return runs + [
        [f"LAB_TEST_FSDP={broken}", "--mode", mode, "--output", folder / "broken" / broken / mode, *common]
        for broken, mode in BROKEN_BENEATH
    ]


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory, image_data):
    folder, _ = module_start(tmp_path_factory, image_data, "fsdp")
    return folder / "artifacts"


def test_the_units_and_their_padded_sizes():
    """Five convolutions, then the root's BatchNorm and classifier parameters (3,850); two ranks pad nothing."""
    assert fsdp.unit_numels(CifarCNN(), 2) == (1728, 36864, 73728, 147456, 294912, 3850)
    assert sum(fsdp.unit_numels(CifarCNN(), 2)) == sum(p.numel() for p in CifarCNN().parameters())
    assert fsdp.unit_numels(CifarCNN(), 3)[-1] > 3850  # the classifier's 10 rows padded to 12


@pytest.mark.torchrun
def test_the_fsdp_pair_passes_the_audit_with_derived_counts(fsdp_runs):
    result = verify(fsdp_runs)
    assert_ok(result)
    assert "AUDIT PASSED: no_sync reduced gradient synchronizations by 4x" in result.stdout
    # The profiler's witness, 2 windows of epoch 1 per rank: 88 all-gathers in both modes, 48 against 12
    # reduce-scatters, each executed once on gloo's threads (a reduce-scatter as an all-reduce).
    for mode, reduce_scatters in (("every", 48), ("no_sync", 12)):
        for summary in read_json(fsdp_runs / mode / "profile.json")["ranks"]:
            assert summary["calls"]["c10d::_allgather_base_"] == summary["audit"]["all_gathers"] == 88
            assert summary["calls"]["c10d::_reduce_scatter_base_"] == reduce_scatters
            assert summary["executions"]["c10d::allreduce_"] == summary["calls"]["c10d::allreduce_"] + reduce_scatters
    every, no_sync = (read_json(fsdp_runs / mode / "history.json") for mode in experiment.MODES)
    # Per epoch and rank: 20 micro-batches of 11 all-gathers (6 units forward, 5 again backward), validation's
    # 5 batches of 5 plus the root once; 6 reduce-scatters per synchronized backward: 20 (every) against 5.
    for row in every + no_sync:
        assert row["all_gathers"] == 20 * 11 + 5 * 5 + 1
        assert row["sync_bucket_calls"] == row["allreduce_bytes"] == 0
        assert row["steps_with_ranks_agreed"] is None  # shards: no copies to compare
        # The training's reduce-scatters (the syncs) and all-gathers, timed call by call: recorded, never judged
        # here (the clock's arithmetic is tested on calls of known seconds, test_comm_audit.py).
        assert row["sync_seconds"] > 0 and row["all_gather_seconds"] > 0
        assert row["sync_wait_seconds"] >= 0 and row["all_gather_wait_seconds"] >= 0
    assert [row["reduce_scatters"] for row in every] == [120, 120]
    assert [row["reduce_scatters"] for row in no_sync] == [30, 30]
    assert every[0]["reduce_scatter_bytes"] == 4 * no_sync[0]["reduce_scatter_bytes"] == 4 * 5 * 558_538 * 4
    # Between micro-batches no_sync holds the window's whole gradients (unsharded), every only its shard of them.
    assert no_sync[0]["held_bytes"]["gradients"] == 558_538 * 4
    assert every[0]["held_bytes"]["gradients"] == 558_538 * 4 // 2


@pytest.mark.torchrun
def test_the_fsdp_checkpoint_is_a_plain_state_dict_for_infer(fsdp_runs):
    checkpoint = torch.load(fsdp_runs / "no_sync" / "model.pt", weights_only=True)
    model = CifarCNN()
    model.load_state_dict(checkpoint["model"])  # plain tensors, the document's model
    result = assert_ok(
        run_python(
            "infer.py",
            "--checkpoint",
            fsdp_runs / "no_sync" / "model.pt",
            "--image",
            fsdp_runs / "no_sync" / "sample_test.png",
        )
    )
    assert result.stdout.strip()


def broken_beneath(fsdp_runs, tmp_path, broken, mode):
    """The correct pair's other mode beside the mode trained with FSDP broken beneath the lab, audited."""
    artifacts = copy_runs(fsdp_runs, tmp_path / "artifacts")
    shutil.rmtree(artifacts / mode)
    shutil.copytree(fsdp_runs.parent / "broken" / broken / mode, artifacts / mode)
    return verify(artifacts)


@pytest.mark.torchrun
def test_fsdps_own_reduction_is_refused_where_gloo_sums(fsdp_runs, tmp_path):
    """The lab's correction undone beneath it: FSDP hands gloo ReduceOp.AVG. Where this torch's gloo sums (2.8,
    asked here), the average witness refuses the run (item 6); where it averages (2.11), the run is right and
    passes."""
    gloo = assert_ok(torchrun(WORKERS.relative_to(WORKERS.parents[1]) / "gloo_average.py")).stdout.split()[-1]
    result = broken_beneath(fsdp_runs, tmp_path, "uncorrected", "every")
    if gloo == "sum":
        assert result.returncode == 1, result.stdout
        assert "is not the mean of the ranks' local ones" in result.stderr and "checklist item 6" in result.stderr
    else:
        assert gloo == "mean" and result.returncode == 0, result.stderr


@pytest.mark.torchrun
def test_a_no_sync_that_does_nothing_is_refused(fsdp_runs, tmp_path):
    result = broken_beneath(fsdp_runs, tmp_path, "sync_ignored", "no_sync")
    assert result.returncode == 1 and "expected 5 gradient syncs, got 20" in result.stderr, result.stderr


@pytest.mark.parametrize(
    "option, named",
    [
        (["--comm-hook", "bf16"], "--comm-hook is DDP's gradient hook"),
        (["--no-broadcast-buffers"], "--no-broadcast-buffers is DDP's"),
        (["--task", "text"], "--task text runs under --strategy ddp only"),
        (["--resume"], "--resume runs under --strategy ddp only"),
    ],
)
@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")  # train.py's @record, run in this process
def test_options_fsdp_cannot_take_are_refused_in_one_line(tmp_path, option, named):
    result = run_in_process("train.py", "--mode", "every", "--output", tmp_path / "out", *FSDP, *option)
    assert_one_line_error(result, named)


@pytest.mark.torchrun
def test_fsdp_as_two_nodes_computes_exactly_what_one_node_computes(fsdp_runs, tmp_path, image_data):
    """Two torchrun nodes of one process each (the device mesh is the training group): the same rows, bit for
    bit but the clocks, and the same weights."""
    folders = node_folders(tmp_path, image_data)
    results, _ = two_nodes(folders, *same_run("no_sync", FSDP))
    for result in results:
        assert_ok(result)
    one, two = (read_json(folder / "no_sync" / "history.json") for folder in (fsdp_runs, folders[0] / "artifacts"))
    assert [{k: v for k, v in row.items() if k not in TIMING} for row in two] == [
        {k: v for k, v in row.items() if k not in TIMING} for row in one
    ]
    weights = [
        torch.load(folder / "no_sync" / "model.pt", weights_only=True)["model"]
        for folder in (fsdp_runs, folders[0] / "artifacts")
    ]
    assert all(torch.equal(weights[0][name], weights[1][name]) for name in weights[0])
