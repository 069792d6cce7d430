"""The watcher (`-m ddp_no_sync_lab.watch`) on loops the lab did not write, unmodified: a plain DDP loop
(tests/loops/plain_ddp.py, one case per mistake) and nanoGPT's idiom (tests/loops/nanogpt_style.py). Each refusal
names its checklist item, its rank, window and micro-batch, beside its correct twin that passes. The cases run in
one torchrun start (tests/workers/watch_cases.py: the launcher's main on each in turn); the launcher's command
line itself runs as a command from a folder outside the project."""

import json
import subprocess
import sys
import sysconfig

import pytest

from conftest import REPO, SMALL_RUN, TORCHRUN, WORKERS, run_python, subprocess_env, torchrun, verify
from test_nodes import finish, start_nodes
from tools import synthetic_data

PLAIN, NANOGPT = REPO / "tests" / "loops" / "plain_ddp.py", REPO / "tests" / "loops" / "nanogpt_style.py"
PLAIN_CASES = (
    "no_sync",
    "every",
    "bf16",
    "short_last_by_k",
    "backward_only",
    "first_synced",
    "zero_grad_each",
    "not_divided",
    "divided_twice",
    "short_last_by_4",
    "extra_step",
    "skipped_step",
    "no_set_epoch",
    "same_samples",
    "two_optimizers",
    "logging_forward",
    "resumed",
    "eval_sampler",
    "mse",
    "grad_scaler",
    "grad_scaler_not_divided",
    "sgd_nesterov",
    "manual_update",
    "grad_scaler_fused",
    "grad_scaler_all_skipped",
    "hook_halves",
    "compiled",
    "compiled_first_synced",
)
# Each mistake: its correct twin, the item it breaks, and the refusal's start (rank, window, micro-batch: what).
REFUSED = {
    "backward_only": (
        "no_sync",
        5,
        "rank 0, window 1, micro-batch 1 of 4: it synchronized: its backward ran with DDP's sync off but its "
        "forward with it on (no_sync() entered, or require_backward_grad_sync set False, after the forward)",
    ),
    "nanogpt_flag_after_forward": (
        "nanogpt",
        5,
        "rank 0, window 1, micro-batch 1 of 4: it synchronized: its backward ran with DDP's sync off but its "
        "forward with it on",
    ),
    "first_synced": (
        "no_sync",
        5,
        "rank 0, window 1, micro-batch 1 of 4: it synchronized, and it is not its window's last micro-batch",
    ),
    "zero_grad_each": (
        "no_sync",
        7,
        "rank 0, window 1, micro-batch 2 of 4: its backward started on reset gradients inside a window",
    ),
    "not_divided": (
        "no_sync",
        4,
        "rank 0, window 1, micro-batch 1 of 4: the window's 4 micro-batch losses were each divided by 1: they "
        "weigh 4 means over the window and the ranks",
    ),
    "divided_twice": (
        "no_sync",
        4,
        "rank 0, window 1, micro-batch 1 of 4: the window's 4 micro-batch losses were each divided by 16: they "
        "weigh 0.25 means",
    ),
    "short_last_by_4": (
        "short_last_by_k",
        4,
        "rank 0, window 4, micro-batch 1 of 2: the window's 2 micro-batch losses were each divided by 4: they "
        "weigh 0.5 means",
    ),
    "logging_forward": (
        "no_sync",
        5,
        "rank 0, window 2, micro-batch 1 of 4: it synchronized although its forward and backward ran with DDP's "
        "sync off: an earlier forward with the sync on and gradients enabled was followed by no backward",
    ),
    "grad_scaler_not_divided": (
        "grad_scaler",
        4,
        "rank 0, window 1, micro-batch 1 of 4: the window's 4 micro-batch losses were each divided by 1: they "
        "weigh 4 means over the window and the ranks",
    ),
    "compiled_first_synced": (
        "compiled",
        5,
        "rank 0, window 1, micro-batch 1 of 4: it synchronized, and it is not its window's last micro-batch",
    ),
    "hook_halves": (
        "no_sync",
        5,
        "rank 0, window 1, micro-batch 4 of 4: the gradients were not what the backward before left",
    ),
    "extra_step": ("no_sync", 8, "rank 0, optimizer step 2: it followed step 1 with no backward between"),
    "skipped_step": (
        "no_sync",
        8,
        "rank 0, window 2, micro-batch 8 of 8: its window held 8 micro-batches where the others hold 4 (a step() "
        "skipped)",
    ),
    "no_set_epoch": (
        "no_sync",
        2,
        "rank 0: a DataLoader began a training pass over a shuffling DistributedSampler in the order of an earlier "
        "one (epoch 0 again): call sampler.set_epoch(epoch)",
    ),
    "same_samples": ("no_sync", 2, "ranks 0 and 1 trained on the same inputs in all 48 forwards"),
}
# What each passing loop was found to be (the report's lines under its title).
FOUND = {
    "no_sync": ["per rank 24 training forwards, 6 optimizer steps", "syncs: 6 on rank 0 (1 per window)"],
    "every": ["per rank 24 training forwards, 6 optimizer steps", "syncs: 24 on rank 0 (4 per window)"],
    "bf16": ["syncs: 6 on rank 0 (1 per window)"],
    "short_last_by_k": ["window: 4 micro-batches per step (the last 2)", "syncs: 8 on rank 0 (1 per window)"],
    "nanogpt": ["per rank 12 training forwards, 3 optimizer steps", "syncs: 3 on rank 0 (1 per window)"],
    "two_optimizers": ["per rank 24 training forwards, 6 optimizer steps", "syncs: 6 on rank 0 (1 per window)"],
    "resumed": ["6 steps per rank, one per window of 4"],
    "eval_sampler": ["2 training passes over a DistributedSampler on rank 0, each in a new order"],
    "sgd_nesterov": ["6 steps per rank, one per window of 4", "syncs: 6 on rank 0 (1 per window)"],
    "compiled": ["6 steps per rank, one per window of 4", "syncs: 6 on rank 0 (1 per window)"],
    # a fused AdamW is stepped by the scaler and skips the update itself: the skip told by the scaler's own record
    "grad_scaler_fused": [
        "6 steps per rank, one per window of 4",
        "note: 2 optimizer steps skipped by GradScaler (inf or NaN gradients)",
    ],
    # the scaled loss read at its divisor, the unscaled gradients expected at the step, 2 skipped steps seen
    "grad_scaler": [
        "6 steps per rank, one per window of 4",
        "note: 2 optimizer steps skipped by GradScaler (inf or NaN gradients): their windows ended with no update, "
        "their averages not compared",
        "each window's last micro-batch synchronized: the ranks' mean, at 4 steps",
    ],
}
# The lab's own train.py under the watcher (the shared experiment's runs on LAB_IMAGES, 3 windows per rank and
# epoch): both modes, and its loop broken beneath it (tests/inject/sitecustomize.py's LAB_TEST_BROKEN_LOOP), each
# refused at the item its mistake breaks.
LAB_IMAGES = (120, 40)
LAB_BROKEN = {
    "sync_first": (
        5,
        "rank 0, window 1, micro-batch 1 of 4: it synchronized, and it is not its window's last micro-batch",
    ),
    "step_inside": (
        7,
        "rank 0, window 4, micro-batch 4 of 4: its backward started on reset gradients inside a window",
    ),
    "backward_only_in_no_sync": (
        5,
        "rank 0, window 1, micro-batch 1 of 4: it synchronized: its backward ran with DDP's sync off but its "
        "forward with it on",
    ),
}
RAISES = 'def fail():\n    raise ValueError("the script\'s own error")\n\n\nfail()\n'
TORN_DOWN_FAILING = (
    "import torch.distributed as dist\n\ntry:\n    raise RuntimeError('an error the script handles')\n"
    "except RuntimeError:\n    dist.destroy_process_group()\n"
)
NO_DDP = "import sys\n\nprint(sys.argv[1:], sys.path[0])\n"


@pytest.fixture(scope="module")
def watched(tmp_path_factory):
    """Every case's [rank 0's, rank 1's] {status, stdout, stderr}, all run in one torchrun start."""
    folder = tmp_path_factory.mktemp("watched")
    scripts = folder / "scripts"
    scripts.mkdir()
    (scripts / "raises.py").write_text(RAISES)
    (scripts / "no_ddp.py").write_text(NO_DDP)
    (scripts / "exits.py").write_text("import sys\n\nsys.exit(3)\n")
    (scripts / "torn_down_failing.py").write_text(TORN_DOWN_FAILING)
    cases = [[name, PLAIN, "--case", name] for name in PLAIN_CASES]
    cases += [["nanogpt", NANOGPT], ["nanogpt_flag_after_forward", NANOGPT, "--flag-after-forward"]]
    cases += [["nanogpt_compiled", NANOGPT, "--compile"]]
    cases += [["raises", scripts / "raises.py"], ["exits", scripts / "exits.py"]]
    cases += [["torn_down_failing", scripts / "torn_down_failing.py"]]
    cases += [["no_ddp", scripts / "no_ddp.py", "an argument", "--", "--an-option"]]
    synthetic_data.write_dataset(folder / "data", "image-folders", *LAB_IMAGES)
    lab = [REPO / "train.py", "--data-dir", folder / "data", *SMALL_RUN, "--quiet", "--output"]
    cases += [[f"lab_{mode}", *lab, folder / "lab" / mode, "--mode", mode] for mode in ("every", "no_sync")]
    cases += [
        [f"LAB_TEST_BROKEN_LOOP={broken}", f"lab_{broken}", *lab, folder / broken, "--mode", "no_sync"]
        for broken in LAB_BROKEN
    ]
    arguments = [argument for case in cases for argument in ("---", *case)]
    result = torchrun(WORKERS.relative_to(REPO) / "watch_cases.py", folder, *arguments, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    names = [next(word for word in case if not str(word).startswith("LAB_TEST_")) for case in cases]
    return {
        name: [json.loads((folder / f"{name}.rank{rank}.json").read_text()) for rank in (0, 1)] for name in names
    } | {"scripts": scripts, "lab": folder / "lab"}


def last_line(result):
    return result["stdout"].rstrip("\n").splitlines()[-1]


def marks(result):
    """The report's table: item number -> its mark."""
    rows = [row.split(" | ") for row in result["stdout"].splitlines() if row.startswith("| ") and row[2].isdigit()]
    return {int(row[0][2:]): row[3] for row in rows}


@pytest.mark.torchrun
@pytest.mark.parametrize("name", FOUND)
def test_correct_loops_pass_and_say_what_they_were_found_to_be(watched, name):
    rank0, rank1 = watched[name]
    assert (rank0["status"], rank1["status"]) == (0, 0), rank0["stderr"][-2000:]
    assert last_line(rank0) == "AUDIT PASSED"
    assert "AUDIT" not in rank1["stdout"]  # one report, by global rank 0
    for line in FOUND[name]:
        assert line in rank0["stdout"]


@pytest.mark.torchrun
def test_a_loop_without_no_sync_passes_with_what_no_sync_would_save(watched):
    report = watched["every"][0]["stdout"]
    assert [number for number, mark in marks(watched["every"][0]).items() if mark != "✓"] == [5, 9, 10]
    notes = [line for line in report.splitlines() if line.startswith("note: ")]
    assert len(notes) == 1 and notes[0].startswith(
        "note: 4 syncs per window where 1 suffices: no_sync() around the forward and backward of the first 3 "
        "micro-batches would save"
    )


@pytest.mark.torchrun
@pytest.mark.parametrize("name", REFUSED)
def test_each_mistake_is_refused_naming_its_item_beside_its_correct_twin(watched, name):
    twin, item, refusal = REFUSED[name]
    rank0, rank1 = watched[name]
    assert (rank0["status"], rank1["status"]) == (1, 1), rank0["stderr"][-2000:]
    line = last_line(rank0)
    assert line.startswith(f"AUDIT FAILED: {refusal}"), line
    assert line.endswith("]") and f"[checklist item {item}: " in line
    assert "AUDIT" not in rank1["stdout"]
    assert last_line(watched[twin][0]) == "AUDIT PASSED"
    assert marks(rank0)[item] == "✗"  # the named item marked in the table (an effect of it may be marked too)


@pytest.mark.torchrun
def test_the_labs_own_train_py_passes_the_watcher_and_verify_alike(watched):
    for mode, syncs in (("every", 24), ("no_sync", 6)):
        rank0, rank1 = watched[f"lab_{mode}"]
        assert (rank0["status"], rank1["status"]) == (0, 0), rank0["stderr"][-2000:]
        assert last_line(rank0) == "AUDIT PASSED"
        assert f"syncs: {syncs} on rank 0" in rank0["stdout"]
        assert (
            "the script's communication hook counting_allreduce_hook ran inside the watcher's count" in rank0["stdout"]
        )
    result = verify(watched["lab"])
    assert result.returncode == 0 and result.stdout.rstrip().endswith(
        "AUDIT PASSED: no_sync reduced gradient synchronizations by 4x"
    )


@pytest.mark.torchrun
@pytest.mark.parametrize("broken", LAB_BROKEN)
def test_the_labs_own_loop_broken_beneath_it_is_refused_by_the_watcher(watched, broken):
    item, refusal = LAB_BROKEN[broken]
    rank0, _ = watched[f"lab_{broken}"]
    assert rank0["status"] == 1
    line = last_line(rank0)
    assert line.startswith(f"AUDIT FAILED: {refusal}") and f"[checklist item {item}: " in line, line


@pytest.mark.torchrun
def test_a_loss_it_does_not_read_leaves_its_items_unobserved_and_the_audit_incomplete(watched):
    rank0, rank1 = watched["mse"]
    assert (rank0["status"], rank1["status"]) == (1, 1)
    assert last_line(rank0) == (
        "AUDIT INCOMPLETE: items 3, 4, 5, 6, 7, 9 were not observed: no loss computed by torch's cross_entropy: the "
        "backwards, syncs and divisors are read at it"
    )
    assert [number for number, mark in marks(rank0).items() if mark == "✓"] == [1, 2, 8]


@pytest.mark.torchrun
def test_a_loss_computed_inside_a_compiled_model_is_said_unread_and_the_script_runs_unchanged(watched):
    """nanoGPT compiles its model, and its loss inside it: the watcher reads no loss there (the compiler traces it),
    says so, and the script's losses are those of its uncompiled run."""
    rank0, _ = watched["nanogpt_compiled"]
    assert rank0["status"] == 1
    assert last_line(rank0) == (
        "AUDIT INCOMPLETE: items 3, 4, 5, 6, 7, 9 were not observed: the loss is computed inside a compiled region "
        "(torch.compile), where it is traced, not read: compute it outside the compiled model to have the "
        "backwards, syncs and divisors read at it"
    )
    assert rank0["stdout"].splitlines()[0] == watched["nanogpt"][0]["stdout"].splitlines()[0]  # "last loss ..."


@pytest.mark.torchrun
def test_a_run_whose_every_step_gradscaler_skipped_leaves_the_updates_unobserved(watched):
    rank0, rank1 = watched["grad_scaler_all_skipped"]
    assert (rank0["status"], rank1["status"]) == (1, 1)
    assert last_line(rank0) == (
        "AUDIT INCOMPLETE: items 6, 8 were not observed: every one of the 6 steps was skipped by GradScaler (inf or "
        "NaN gradients)"
    )
    assert [number for number, mark in marks(rank0).items() if mark == "—"] == [6, 8, 10]


@pytest.mark.torchrun
def test_the_script_runs_as_python_runs_it_its_failures_its_own(watched):
    raised, _ = watched["raises"]
    assert raised["status"] == 1 and "AUDIT" not in raised["stdout"]
    assert (
        'raises.py", line 2, in fail' in raised["stderr"] and "ValueError: the script's own error" in raised["stderr"]
    )
    assert "ddp_no_sync_lab" not in raised["stderr"] and "runpy" not in raised["stderr"]
    exited, _ = watched["exits"]
    assert (exited["status"], exited["stdout"]) == (3, "")
    plain, _ = watched["no_ddp"]
    assert plain["stdout"].splitlines()[0] == f"['an argument', '--', '--an-option'] {watched['scripts']}"
    assert plain["status"] == 1 and last_line(plain).startswith(
        "NOTHING AUDITED: the script made no DistributedDataParallel model"
    )
    by_hand, _ = watched["manual_update"]
    assert (by_hand["status"], last_line(by_hand)) == (
        1,
        "NOTHING AUDITED: the model's weights changed with no torch optimizer's step: its windows are read at steps",
    )
    failing, _ = watched["torn_down_failing"]
    assert (failing["status"], last_line(failing)) == (
        1,
        "NOTHING AUDITED: the script tore its process group down while handling an exception: not judged",
    )


@pytest.mark.torchrun
def test_two_nodes_give_the_verdicts_one_node_gives(watched, tmp_path):
    """The same cases on two torchrun nodes of one rank each (loopback): each report the one node's, word for word."""
    names = ["no_sync", "backward_only", "no_set_epoch", "same_samples"]
    arguments = [tmp_path, *(word for name in names for word in ("---", name, PLAIN, "--case", name))]
    script = WORKERS.relative_to(REPO) / "watch_cases.py"
    for result in finish(start_nodes([tmp_path, tmp_path], arguments, arguments, script=script))[0]:
        assert result.returncode == 0, result.stderr[-3000:]
    for name in names:
        ranks = [json.loads((tmp_path / f"{name}.rank{rank}.json").read_text()) for rank in (0, 1)]
        assert [rank["status"] for rank in ranks] == [rank["status"] for rank in watched[name]]
        assert ranks[0]["stdout"] == watched[name][0]["stdout"]


@pytest.mark.torchrun
def test_the_launcher_runs_from_any_folder_and_its_status_and_record_are_the_verdicts(tmp_path):
    out = tmp_path / "record"
    command = [*TORCHRUN, "-m", "ddp_no_sync_lab.watch", "--out", str(out), str(PLAIN), "--case", "divided_twice"]
    result = subprocess.run(command, capture_output=True, text=True, env=subprocess_env(), cwd=tmp_path, timeout=300)
    assert result.returncode != 0
    printed = [line for line in result.stdout.splitlines() if line.startswith("AUDIT")]
    assert len(printed) == 1 and printed[0].endswith(
        "[checklist item 4: each window's losses weigh one mean over the window and the ranks]"
    )
    record = json.loads((out / "watch.json").read_text())
    assert record["last_line"] == printed[0]
    assert record["findings"]["4"]["mark"] == "✗" and record["findings"]["5"]["mark"] == "✓"
    assert record["args"] == ["--case", "divided_twice"] and len(record["observed"]["models"][0]["ranks"]) == 2


@pytest.mark.torchrun
def test_the_launcher_runs_with_the_project_on_pythonpath_alone(tmp_path):
    """An environment with torch and the frameworks but not the lab's package (a venv whose path reaches this one's
    site-packages, whose .pth files, the editable install's among them, it does not read): the watcher runs from a
    folder outside the project with PYTHONPATH naming the checkout, and only so."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True, timeout=120)
    (tmp_path / "venv" / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages").joinpath(
        "lab_dependencies.pth"
    ).write_text(sysconfig.get_paths()["purelib"] + "\n")
    python = str(tmp_path / "venv" / "bin" / "python")
    bare = subprocess.run([python, "-c", "import ddp_no_sync_lab"], capture_output=True, text=True, cwd=tmp_path)
    assert bare.returncode != 0 and "No module named 'ddp_no_sync_lab'" in bare.stderr
    command = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m"]
    command += ["ddp_no_sync_lab.watch", str(PLAIN), "--case", "no_sync"]
    env = subprocess_env(PYTHONPATH=str(REPO))
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.rstrip().endswith("AUDIT PASSED")


@pytest.mark.torchrun
def test_fail_fast_stops_the_ranks_at_the_first_window_one_rank_sees_broken_and_passes_its_twin(tmp_path):
    """--fail-fast judges items 5, 7 and 8 on each rank's own windows as each ends: the broken loop stops in its
    first epoch (the script never prints its epoch line), its correct twin runs to its end and passes."""
    results = {}
    for case in ("zero_grad_each", "no_sync"):
        command = [*TORCHRUN, "-m", "ddp_no_sync_lab.watch", "--fail-fast", str(PLAIN), "--case", case]
        results[case] = subprocess.run(
            command, capture_output=True, text=True, env=subprocess_env(), cwd=tmp_path, timeout=300
        )
    broken = results["zero_grad_each"]
    stops = [line for line in broken.stdout.splitlines() if line.startswith("AUDIT FAILED (--fail-fast, rank ")]
    assert broken.returncode != 0 and stops, broken.stdout[-2000:]
    assert all(
        line.endswith(
            "window 1, micro-batch 2 of 4: its backward started on reset gradients inside a window (zero_grad() "
            "before the window's last micro-batch: the window's earlier gradients were lost) [checklist item 7: "
            "zero_grad() only after the step; the gradients untouched between backwards]"
        )
        for line in stops
    ), stops
    assert "epoch 0: last loss" not in broken.stdout
    twin = results["no_sync"]
    assert twin.returncode == 0, twin.stderr[-2000:]
    assert "epoch 1: last loss" in twin.stdout and twin.stdout.rstrip().endswith("AUDIT PASSED")


@pytest.mark.torchrun
def test_the_overhead_benchmark_times_both_runs_and_records_its_arithmetic(tmp_path):
    """The Lightning loop, plain and watched, each in its own start where Lightning makes the process group (the
    hand-written loop, which the benchmark starts the same way, is watched among the frameworks' cases:
    test_watch_frameworks.py)."""
    output = tmp_path / "watch.json"
    options = ["--windows", "1", "--repeats", "1", "--batch-size", "4", "--loops", "lightning", "--output", output]
    result = run_python("benchmarks/bench_watch.py", *options)
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads(output.read_text())
    assert list(record["seconds"]) == ["lightning"]
    seconds, medians = record["seconds"]["lightning"], record["medians"]["lightning"]
    assert {variant: len(times) for variant, times in seconds.items()} == {"plain": 1, "watched": 1}
    assert all(times[0] > 0 for times in seconds.values())
    assert record["overheads"]["lightning"] == medians["watched"] / medians["plain"] - 1
    assert "| lightning | plain |" in result.stdout and "| lightning | watched |" in result.stdout
    assert "overhead, lightning loop: " in result.stdout


def test_a_missing_script_is_one_line_naming_it(tmp_path):
    command = [sys.executable, "-m", "ddp_no_sync_lab.watch", str(tmp_path / "absent.py")]
    result = subprocess.run(command, capture_output=True, text=True, env=subprocess_env(), cwd=tmp_path, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"python -m ddp_no_sync_lab.watch: error: {tmp_path / 'absent.py'}: no such script: give the path of the "
        f"training script (see: python -m ddp_no_sync_lab.watch --help)"
    ]


def test_an_out_that_is_a_file_is_one_line_naming_it(tmp_path):
    (tmp_path / "taken").write_text("")
    (tmp_path / "train.py").write_text("")
    command = [sys.executable, "-m", "ddp_no_sync_lab.watch", "--out", "taken", "train.py"]
    result = subprocess.run(command, capture_output=True, text=True, env=subprocess_env(), cwd=tmp_path, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "python -m ddp_no_sync_lab.watch: error: --out taken: a file, not a folder: give a folder for watch.json "
        "(see: python -m ddp_no_sync_lab.watch --help)"
    ]
