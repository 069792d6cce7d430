"""The watcher (`-m ddp_no_sync_lab.watch`) on the loops frameworks build, each written in its framework's
documented style and run unmodified: Accelerate's accumulate() (tests/loops/accelerate_loop.py), Lightning's
accumulate_grad_batches (tests/loops/lightning_loop.py), the HF Trainer's gradient_accumulation_steps
(tests/loops/hf_trainer_loop.py) and FSDP2's set_requires_gradient_sync (tests/loops/fsdp2_loop.py), and the lab's
own train.py --strategy fsdp. Each refusal names its item beside its framework's correct twin, which passes; all
cases run in one torchrun start (tests/workers/watch_cases.py)."""

import json
import subprocess
import sys
from datetime import timedelta

import pytest

from benchmarks import bench_watch
from conftest import REPO, SMALL_RUN, WORKERS, subprocess_env, torchrun, verify
from ddp_no_sync_lab.watch import observe
from ddp_no_sync_lab.watch.report import GLOSSES
from test_watch import last_line, marks

LOOPS = REPO / "tests" / "loops"
BENCH_PLAIN_LOOP = REPO / "benchmarks" / "watch_loop.py"  # benchmarks/bench_watch.py's hand-written loop
MODES = ("every", "no_sync")
# Each case: its loop and the loop's --case.
CASES = {
    "accelerate": ("accelerate_loop.py", "accumulate"),
    "accelerate_divided_twice": ("accelerate_loop.py", "divided_twice"),
    "accelerate_outside": ("accelerate_loop.py", "accumulate_outside"),
    "accelerate_short_last": ("accelerate_loop.py", "short_last"),
    "lightning": ("lightning_loop.py", "accumulate"),
    "lightning_divided": ("lightning_loop.py", "divided"),
    "lightning_short_last": ("lightning_loop.py", "short_last"),
    "hf_trainer": ("hf_trainer_loop.py", "accumulate"),
    "hf_ignores_num_items": ("hf_trainer_loop.py", "ignores_num_items"),
    "hf_gpt2": ("hf_trainer_loop.py", "gpt2"),
    "fsdp2": ("fsdp2_loop.py", "accumulate"),
    "fsdp2_gloo_sum": ("fsdp2_loop.py", "gloo_sum"),
    "fsdp2_never_set_back": ("fsdp2_loop.py", "never_set_back"),
    "fsdp2_clipped": ("fsdp2_loop.py", "clipped"),
    "fsdp2_teacher": ("fsdp2_loop.py", "teacher"),
}
# What each framework's correct loop was found to be (the report's lines under its title).
FOUND = {
    "accelerate": [
        "per rank 24 training forwards, 6 optimizer steps",
        "syncs: 6 on rank 0 (1 per window)",
        "the DDP model made by Accelerate, whose loop ran the windows",
    ],
    "lightning": [
        "per rank 24 training forwards, 6 optimizer steps",
        "syncs: 6 on rank 0 (1 per window)",
        "the DDP model made by Lightning, whose loop ran the windows",
    ],
    "hf_trainer": [
        "per rank 24 training forwards, 6 optimizer steps",
        "syncs: 6 on rank 0 (1 per window)",
        "the DDP model made by HF Trainer, whose loop ran the windows",
    ],
    "fsdp2": [
        "per rank 24 training forwards, 6 optimizer steps",
        "syncs: 6 on rank 0 (1 per window), 848 B handed to the reduce-scatters per sync",
        "the model under FSDP2's fully_shard: its reduce-scatters are the syncs, its shards averaged",
    ],
    # clip_grad_norm_ over the shards at every step: the clipped shards over the factor are the ranks' mean
    "fsdp2_clipped": ["syncs: 6 on rank 0 (1 per window), 848 B handed to the reduce-scatters per sync"],
    # a frozen model under fully_shard, called first: the student is adopted, the teacher's all-gathers no syncs
    "fsdp2_teacher": ["syncs: 6 on rank 0 (1 per window), 848 B handed to the reduce-scatters per sync"],
}
# Each mistake: its correct twin, the item it breaks, and the refusal's start.
REFUSED = {
    "accelerate_divided_twice": (
        "accelerate",
        4,
        "rank 0, window 1, micro-batch 1 of 4: the window's 4 micro-batch losses were each divided by 16: they "
        "weigh 0.25 means over the window and the ranks",
    ),
    "accelerate_outside": (
        "accelerate",
        8,
        "rank 0: 24 backwards and no optimizer step on the DDP model's parameters: nothing was updated: "
        "Accelerate's optimizer steps only where accumulate() found a window's end: enter `with "
        "accelerator.accumulate(model):` around each batch, not around the loop (accelerate#1211)",
    ),
    "accelerate_short_last": (
        "accelerate",
        4,
        "rank 0, window 4, micro-batch 1 of 2: the window's 2 micro-batch losses were each divided by 4, the full "
        "window's length: they weigh 0.5 means over the window and the ranks: Accelerate's backward() divides every "
        "loss by gradient_accumulation_steps, a short last window's too",
    ),
    "lightning_divided": (
        "lightning",
        4,
        "rank 0, window 1, micro-batch 1 of 4: the window's 4 micro-batch losses were each divided by 16: they "
        "weigh 0.25 means over the window and the ranks",
    ),
    "lightning_short_last": (
        "lightning",
        4,
        "rank 0, window 4, micro-batch 1 of 2: the window's 2 micro-batch losses were each divided by 4, the full "
        "window's length: they weigh 0.5 means over the window and the ranks: Lightning divides every "
        "training_step loss by accumulate_grad_batches, a short last window's too "
        "(Lightning-AI/pytorch-lightning#19987)",
    ),
    "hf_ignores_num_items": (
        "hf_trainer",
        4,
        "rank 0, window 1, micro-batch 1 of 4: the window's 4 micro-batch losses were each divided by 1: they "
        "weigh 4 means over the window and the ranks",
    ),
    # 32 rows per window over the ranks, each counted one token longer than its loss counts it.
    "hf_gpt2": (
        "hf_trainer",
        4,
        "rank 0, window 1, micro-batch 1 of 4: the window's 4 micro-batch losses weighed every item alike, as 1 "
        "of 396 items over the window and the ranks, where its losses count 364: they weigh 0.9192 means",
    ),
    "fsdp2_gloo_sum": (
        "fsdp2",
        6,
        "rank 0, optimizer step 1: the synchronized gradient's projection ",
        "the reduction did not average: it is the 2 ranks' sum: torch's FSDP2 hands ReduceOp.AVG to gloo's "
        "reduce-scatter, which sums (pytorch/pytorch#162338): call set_force_sum_reduction_for_comms(True) on every "
        "FSDP module (it divides by the world size itself)",
    ),
    "fsdp2_never_set_back": (
        "fsdp2",
        6,
        "rank 0, window 1, micro-batch 4 of 4: it did not synchronize (its backward with FSDP's gradient sync off: "
        "set_requires_gradient_sync(True) before it): the step did not take the ranks' mean gradient",
    ),
}


@pytest.fixture(scope="module")
def watched(tmp_path_factory, image_data):
    """Every case's [rank 0's, rank 1's] {status, stdout, stderr}, all run in one torchrun start: the loops, the
    overhead benchmark's hand-written loop, then the lab's train.py --strategy fsdp in both modes."""
    folder = tmp_path_factory.mktemp("frameworks")
    cases = []
    for name, (loop, case) in CASES.items():
        output = ["--output", folder / name] if loop == "hf_trainer_loop.py" else []
        cases.append([name, LOOPS / loop, "--case", case, *output])
    cases.append(["bench_plain", BENCH_PLAIN_LOOP, "--windows", "1", "--batch-size", "4"])
    lab = [REPO / "train.py", "--strategy", "fsdp", "--data-dir", image_data, *SMALL_RUN, "--quiet"]
    cases += [[f"lab_fsdp_{mode}", *lab, "--mode", mode, "--output", folder / "lab" / mode] for mode in MODES]
    arguments = [argument for case in cases for argument in ("---", *case)]
    result = torchrun(WORKERS.relative_to(REPO) / "watch_cases.py", folder, *arguments, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    names = [case[0] for case in cases]
    return {
        name: [json.loads((folder / f"{name}.rank{rank}.json").read_text()) for rank in (0, 1)] for name in names
    } | {"lab": folder / "lab"}


@pytest.mark.torchrun
@pytest.mark.parametrize("name", FOUND)
def test_each_frameworks_documented_accumulation_passes(watched, name):
    rank0, rank1 = watched[name]
    assert (rank0["status"], rank1["status"]) == (0, 0), rank0["stderr"][-2000:]
    assert last_line(rank0) == "AUDIT PASSED"
    assert "AUDIT" not in rank1["stdout"]
    for line in FOUND[name]:
        assert line in rank0["stdout"]
    assert [number for number, mark in marks(rank0).items() if mark != "✓"] == [10]


@pytest.mark.torchrun
@pytest.mark.parametrize("name", REFUSED)
def test_each_framework_mistake_is_refused_naming_its_item_beside_its_correct_twin(watched, name):
    twin, item, refusal, *ending = REFUSED[name]  # an ending after the run's own projections, where given
    rank0, rank1 = watched[name]
    assert (rank0["status"], rank1["status"]) == (1, 1), rank0["stderr"][-2000:]
    line = last_line(rank0)
    assert line.startswith(f"AUDIT FAILED: {refusal}"), line
    assert not ending or line.endswith(f"{ending[0]} [checklist item {item}: {GLOSSES[item - 1]}]"), line
    assert f"[checklist item {item}: " in line
    assert marks(rank0)[item] == "✗"
    assert last_line(watched[twin][0]) == "AUDIT PASSED"


@pytest.mark.torchrun
def test_a_sampler_epoch_the_framework_sets_is_credited_to_it_not_to_the_script(watched):
    rank0, _ = watched["lightning"]
    item_2 = next(row for row in rank0["stdout"].splitlines() if row.startswith("| 2 |"))
    assert item_2.endswith(
        "2 training passes over a DistributedSampler on rank 0, each in a new order; set_epoch: — (Lightning set it "
        "before every pass, not the script) |"
    )


@pytest.mark.torchrun  # Lightning's own launcher starts the second rank
def test_lightning_started_by_plain_python_is_refused_in_one_line_naming_torchrun(tmp_path):
    command = [sys.executable, "-m", "ddp_no_sync_lab.watch", str(LOOPS / "lightning_loop.py")]
    env = subprocess_env(LAB_TEST_WATCH_HANDSHAKE_SECONDS="2")  # the watcher's 20 s bound, shorter: its line names it
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.startswith("python -m ddp_no_sync_lab.watch")]
    assert lines == [
        "python -m ddp_no_sync_lab.watch: error: the script made a model over 2 ranks, and the others did not answer "
        "the watcher in 2 s: the script started them itself (as Lightning does under plain python), without the "
        "watcher: launch it with torchrun --nproc-per-node=2 -m ddp_no_sync_lab.watch SCRIPT (DistStoreError)"
    ]
    assert "AUDIT" not in result.stdout
    assert observe.HANDSHAKE_TIMEOUT == timedelta(seconds=20)  # the bound a user's run waits, shortened here


@pytest.mark.torchrun
def test_the_overhead_benchmarks_hand_written_loop_passes_the_watcher_and_prints_its_timed_seconds(watched):
    """The loop benchmarks/bench_watch.py times plain and watched (one window timed after one of warm-up), as its
    watched start runs it: the watcher passes it, and rank 0 prints the line the benchmark reads."""
    assert bench_watch.LOOPS["plain"] == BENCH_PLAIN_LOOP.name
    rank0, rank1 = watched["bench_plain"]
    assert (rank0["status"], rank1["status"]) == (0, 0), rank0["stderr"][-2000:]
    assert last_line(rank0) == "AUDIT PASSED"
    (timed,) = [json.loads(line) for line in rank0["stdout"].splitlines() if line.startswith('{"loop_seconds"')]
    assert timed["micro_batches"] == 4 and timed["loop_seconds"] > 0
    assert "per rank 8 training forwards, 2 optimizer steps" in rank0["stdout"]


@pytest.mark.torchrun
def test_the_labs_fsdp_run_passes_the_watcher_and_verify_alike(watched):
    """The lab's own FSDP2 run counts its reduce-scatters into its audit and the watcher's at once."""
    for mode, syncs in (("every", 40), ("no_sync", 10)):
        rank0, rank1 = watched[f"lab_fsdp_{mode}"]
        assert (rank0["status"], rank1["status"]) == (0, 0), rank0["stderr"][-2000:]
        assert last_line(rank0) == "AUDIT PASSED"
        assert f"syncs: {syncs} on rank 0" in rank0["stdout"]
    result = verify(watched["lab"])
    assert result.returncode == 0 and result.stdout.rstrip().endswith(
        "AUDIT PASSED: no_sync reduced gradient synchronizations by 4x"
    ), result.stdout[-2000:]
