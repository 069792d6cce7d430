"""The document's checklist observed: each accumulation bug, injected in the loop and beneath it, refused by
verify.py naming the item it breaks; the witnesses' tolerances; the strict audit holding the whole documented
experiment; verify.py printing the checklist."""

import json
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import REPO, SMALL_RUN, assert_ok, copy_runs, read_json, subprocess_env, torchrun, verify
from ddp_no_sync_lab import experiment, files
from ddp_no_sync_lab.audit import scale
from ddp_no_sync_lab.checks import certify, strict_audit
from model import CifarCNN
from tools import synthetic_data

# Each bug, the checklist item it breaks (or the loop's and the beneath one's), and the modes its two injections
# run in (the loop's first, then beneath the loop's): across the bugs each way meets each mode.
BUGS = {
    "reset_inside_window": (7, ("no_sync", "every")),
    "reset_in_place": (7, ("every", "no_sync")),
    "loss_not_divided": (4, ("no_sync", "every")),
    "loss_divided_twice": (4, ("every", "no_sync")),
    "extra_step": (8, ("no_sync", "every")),
    "step_before_sync": (7, ("every", "no_sync")),
    "skipped_step": (8, ("no_sync", "every")),
    "hook_sums": (6, ("every", "no_sync")),
    "hook_divides_twice": (6, ("no_sync", "every")),
    "reset_on_one_rank": (7, ("every", "no_sync")),
    "loss_on_part_of_batch": ((3, 4), ("no_sync", "every")),  # in the loop: sliced before the criterion
}
# 120 train-source images (96 train: 48 per rank, 12 micro-batches of 4, 3 windows; 24 validation), 40 test.
BUG_IMAGES = (120, 40)
LABEL_LIE = "compression_label_lies"  # --comm-hook bf16 sending float32: both modes trained with it


def other(mode):
    return "every" if mode == "no_sync" else "no_sync"


@pytest.fixture(scope="module")
def injected_runs(tmp_path_factory):
    """Every scenario trained for one epoch in one torchrun start (tests/workers/checklist_bugs.py), with the
    lab's correct pair beside them: in the run's precision (each bugged mode's partner), and in float32. On
    BUG_IMAGES: 3 windows per rank, enough for each bug (a skipped step is the 3rd), in 30 trainings. Each run
    made in the loop is also watched as a foreign script would be (--watch): the watcher's verdict beside
    verify.py's."""
    out = tmp_path_factory.mktemp("bugs")
    image_data = out / "data"
    synthetic_data.write_dataset(image_data, "image-folders", *BUG_IMAGES)
    scenarios = [
        f"{bug}:{way}:{mode}" for bug, (_, modes) in BUGS.items() for way, mode in zip(("loop", "beneath"), modes)
    ] + [f"{LABEL_LIE}:loop:both", f"{LABEL_LIE}:beneath:both", "none:loop:both", "none:loop:both:fp32"]
    options = ["--data-dir", image_data, *SMALL_RUN, "--epochs", "1"]
    result = torchrun("tests/workers/checklist_bugs.py", "--watch", out, *scenarios, "--", *options, timeout=1200)
    assert_ok(result)
    assert_ok(verify(out / "none-loop-both"))  # the bugged modes' partner
    return out


@pytest.mark.torchrun
@pytest.mark.parametrize("bug", sorted(BUGS))
def test_each_bug_in_the_labs_loop_is_refused_by_the_watcher_naming_verifys_item(injected_runs, bug):
    """The same runs watched as a foreign script (python -m ddp_no_sync_lab.watch): the bug made in the loop
    refused at the item verify.py names."""
    items, modes = BUGS[bug]
    item = items[0] if isinstance(items, tuple) else items
    line = (injected_runs / f"{bug}-loop-{modes[0]}" / modes[0] / "watch.txt").read_text().strip()
    assert line.startswith("AUDIT FAILED: ") and f"[checklist item {item}: " in line, line


@pytest.mark.torchrun
def test_the_labs_correct_pair_of_the_bugs_experiment_passes_the_watcher(injected_runs):
    for mode in ("every", "no_sync"):
        assert (injected_runs / "none-loop-both" / mode / "watch.txt").read_text() == "AUDIT PASSED\n"


def refusal(result):
    assert result.returncode == 1, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    assert "AUDIT PASSED" not in result.stdout and "Traceback" not in result.stderr, result.stderr
    (line,) = [line for line in result.stderr.splitlines() if line.strip()]
    return line


@pytest.mark.torchrun
@pytest.mark.parametrize("way", ["loop", "beneath"])
@pytest.mark.parametrize("bug", sorted(BUGS))
def test_each_bug_is_refused_naming_its_checklist_item(bug, way, injected_runs, tmp_path):
    """The bugged mode beside the same experiment's correct other mode: refused, the item named, whatever the
    way the bug was made."""
    items, modes = BUGS[bug]
    mode, item = (modes[0], items) if way == "loop" else (modes[1], items)
    if isinstance(items, tuple):
        item = items[0] if way == "loop" else items[1]
    artifacts = copy_runs(injected_runs / f"{bug}-{way}-{mode}", tmp_path / "artifacts")
    shutil.copytree(injected_runs / "none-loop-both" / other(mode), artifacts / other(mode))
    line = refusal(verify(artifacts))
    assert f"{artifacts}/{mode}/history.json: " in line
    assert line.endswith(certify.item(item)), line


@pytest.mark.torchrun
@pytest.mark.parametrize("way", ["loop", "beneath"])
def test_a_compression_label_that_lies_is_refused_by_the_bytes_handed_to_the_collective(way, injected_runs):
    """--comm-hook bf16 whose hook sends float32 (in train.py's hook, or in torch's _compress_hook): the run
    says bf16, the collective got twice the bytes."""
    artifacts = injected_runs / f"{LABEL_LIE}-{way}-both"
    assert read_json(artifacts / "every" / "run.json")["config"]["comm_hook"] == "bf16"
    line = refusal(verify(artifacts))
    rows = read_json(artifacts / "every" / "history.json")
    sent = experiment.comm_sizes(CifarCNN()).gradient_bytes * rows[0]["gradient_syncs"]
    assert f"expected {sent // 2} all-reduced bytes, got {sent} (epoch 1)" in line
    assert line.endswith(certify.item(9))


def test_the_byte_witness_wraps_nothing_until_installed_and_installs_once():
    """Importing the tap changes no collective; train.py installs it as it is loaded, wrapping
    torch.distributed.all_reduce once (a second install changes nothing). A fresh interpreter: nothing before."""
    program = """
import torch.distributed as dist
original = dist.all_reduce
from ddp_no_sync_lab.audit import tap
assert dist.all_reduce is original and tap.TAP.original is None
import train
wrapped = dist.all_reduce
assert wrapped is not original and tap.TAP.original is original
assert tap.TAP.install() is tap.TAP and dist.all_reduce is wrapped
print("tap ok")
"""
    result = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, env=subprocess_env(), cwd=REPO, timeout=120
    )
    assert result.returncode == 0 and result.stdout == "tap ok\n", result.stderr


def test_the_witnesses_saw_the_correct_runs_as_they_are(lab_runs):
    """What the shared correct runs' rows hold, for each rank (check_correct_rank)."""
    artifacts, _ = lab_runs
    for mode in ("every", "no_sync"):
        for row in read_json(artifacts / mode / "history.json"):
            checklist_row = row["checklist"]
            # both ranks on this machine's CPU: the one-GPU-each rule is CUDA's
            assert {key: checklist_row[key] for key in ("processes", "devices", "device_type")} == {
                "processes": 2,
                "devices": 1,
                "device_type": "cpu",
            }
            assert len(checklist_row["ranks"]) == 2
            for seen in checklist_row["ranks"]:
                assert (seen["micro_batches"], seen["samples"], seen["backwards"]) == (20, 80, 20)
                check_correct_rank(seen, row)


def check_correct_rank(seen, row):
    """Every micro-batch's backward, the resets at the windows' starts alone, the window's divisor at every
    micro-batch, 2 ranks x 16 samples behind every step, every step's average checked, the optimizer's own count
    equal to its hooks'."""
    assert seen["backward_starts"] == [[0, 20, 1]]
    assert seen["fresh_at_backward"] == [[0, 17, 4]]
    assert (seen["fresh_at_step"], seen["altered_at"], seen["steps_before_backward"]) == ([], [], [])
    assert seen["loss_divisors"] == [[0, 20, 4]] and seen["loss_short_of_samples"] == []
    assert seen["step_samples"] == [[32, 5]] and seen["step_micro_batches"] == [[8, 5]]
    assert seen["averages_checked"] == 5 and seen["first_average_off"] is None
    assert seen["optimizer_state_steps"] == 5
    assert row["witness_allreduces"] == 5
    # Within BF16's bounds (float32's are tighter); exactly 0 is right where float32 divides by 4 exactly.
    bound, residual_bound = scale.loss_scale_bounds(torch.bfloat16)
    assert 0 <= seen["loss_scale_deviation"] <= bound and 0 <= seen["loss_scale_residual"] <= residual_bound


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_loss_scale_is_read_within_its_bound_however_confident_the_model(precision):
    """scale.loss_scale on the gradient a real loss/divisor backward leaves at the logits (under BF16
    autocast as the lab runs it, or float32): the divisor comes back within the bound, for random logits and
    for batches the model is sure of (margins up to 30, where softmax - one-hot cancels to rounding), of 50,
    2 and 1 samples; a wrong divisor is far outside it. The divisor read at the loss (its value and the gradient
    that reached it) is the divisor itself, recorded whole."""
    generator = torch.Generator().manual_seed(3)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    deviation_bound, residual_bound = scale.loss_scale_bounds(dtype)
    for batch, margin in ((50, 0), (50, 14), (50, 16), (50, 18), (50, 30), (2, 20), (1, 20)):
        targets = torch.randint(0, 10, (batch,), generator=generator)
        weights = torch.randn(batch, 10, generator=generator) + margin * torch.nn.functional.one_hot(targets, 10)
        for divisor in (1, 3, 4, 16):
            leaf = weights.clone().requires_grad_()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                logits = leaf.to(
                    torch.bfloat16 if precision == "bf16" else torch.float32
                )  # as a classifier leaves them
                loss = torch.nn.functional.cross_entropy(logits, targets)
            logits.retain_grad()
            loss.retain_grad()
            (loss / divisor).backward()
            # Read as the witness does: the mean cross-entropy's value computed alike, over the criterion's times
            # the gradient that reached it.
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"), torch.no_grad():
                alike = torch.nn.functional.cross_entropy(logits, targets)
            read = alike.double() / (loss.detach().double() * loss.grad.double())
            found, residual, read = scale.loss_scale(logits.detach(), targets, logits.grad, read=read).tolist()
            assert abs(found / divisor - 1) <= deviation_bound, (batch, margin, divisor, found)
            assert residual <= residual_bound, (batch, margin, divisor, residual)
            assert scale.recorded_divisor(found, read) == divisor == round(found)


def test_strict_verify_holds_every_documented_key(tmp_path):
    """Another seed, or a 100-image test set, is not the documented experiment even when every count would
    match: the first differing key is named."""
    path = tmp_path / "run.json"
    strict_audit.check_documented(path, dict(experiment.DOCUMENTED))
    for key, value in (("seed", 48), ("test_size", 100), ("learning_rate", 1e-3), ("augmentation", "none")):
        with pytest.raises(files.AuditError) as caught:
            strict_audit.check_documented(path, {**experiment.DOCUMENTED, key: value})
        assert str(caught.value) == (
            f"{path}: config {key}={value!r} is not the documented experiment's {experiment.DOCUMENTED[key]!r}: run "
            f"the documented experiment, or audit these runs against their own configuration with --expect-from-config"
        )


def test_verify_prints_the_checklist_with_its_witnesses(lab_runs, tmp_path):
    result = verify(lab_runs[0], "--pictures", tmp_path)  # the shared pair is only read
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    rows = [line for line in lines if line.startswith("| ") and line.split("|")[1].strip().isdigit()]
    table = [line for line in rows if " ✓ | ✓ | " in line]
    assert [int(line.split("|")[1]) for line in table] == list(range(1, 11))
    for (text, gloss), line in zip(certify.ITEMS, table):
        assert text in line and gloss in line
    assert "platform (printed, not compared): device cpu, backend gloo, precision" in result.stdout


def test_a_run_recorded_without_the_witnesses_is_refused(lab_runs, tmp_path):
    """A history row without the checklist's observations (an older run, or one edited) cannot pass."""
    artifacts = copy_runs(lab_runs[0], tmp_path / "artifacts")
    path = artifacts / "no_sync" / "history.json"
    rows = read_json(path)
    del rows[1]["checklist"]
    path.write_text(json.dumps(rows))
    record = read_json(artifacts / "no_sync" / "run.json")
    record["files"]["history.json"] = {"bytes": path.stat().st_size, "sha256": files.sha256_file(path)}
    (artifacts / "no_sync" / "run.json").write_text(json.dumps(record))
    assert f"{path}: epoch row 2: checklist must hold the witnesses' observations" in refusal(verify(artifacts))


def edit_history(artifacts, mode, change):
    """Edit a run's history rows and record its new checksum, as a run that wrote them would have."""
    path = artifacts / mode / "history.json"
    rows = read_json(path)
    change(rows)
    path.write_text(json.dumps(rows))
    record = read_json(artifacts / mode / "run.json")
    record["files"]["history.json"] = {"bytes": path.stat().st_size, "sha256": files.sha256_file(path)}
    (artifacts / mode / "run.json").write_text(json.dumps(record))
    return path


def test_ranks_that_shared_a_gpu_are_refused_after_every_other_item(lab_runs, tmp_path):
    """Two ranks on one GPU (gpu_check.sh's job over gloo) break item 1; it is checked after each rank's items,
    so that such a refusal says that every other item of the epoch held."""
    artifacts = copy_runs(lab_runs[0], tmp_path / "artifacts")

    def on_one_gpu(rows):
        for row in rows:
            row["checklist"].update(device_type="cuda", devices=1)

    path = edit_history(artifacts, "every", on_one_gpu)
    assert refusal(verify(artifacts)).startswith(
        f"RuntimeError: {path}: epoch 1: 2 ranks shared 1 GPUs: one process per GPU [checklist item 1:"
    )

    def and_a_rank_that_ran_one_micro_batch_less(rows):
        rows[0]["checklist"]["ranks"][1]["micro_batches"] -= 1

    edit_history(artifacts, "every", and_a_rank_that_ran_one_micro_batch_less)
    assert refusal(verify(artifacts)).startswith(
        f"RuntimeError: {path}: epoch 1, rank 1: 19 micro-batches ran (expected 20)"
    )


@pytest.mark.torchrun
def test_correct_runs_in_float32_pass_within_the_tighter_bounds(injected_runs):
    """The lab unchanged, in float32 (what `auto` takes on a CPU without BF16 instructions): the loss scale read
    within float32's bound, every item observed, AUDIT PASSED."""
    artifacts = injected_runs / "none-loop-both-fp32"
    result = verify(artifacts)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[-1] == "AUDIT PASSED: no_sync reduced gradient synchronizations by 4x"
    bound, residual_bound = scale.loss_scale_bounds(torch.float32)
    for mode in ("every", "no_sync"):
        assert read_json(artifacts / mode / "run.json")["config"]["precision"] == "fp32"
        for row in read_json(artifacts / mode / "history.json"):
            for seen in row["checklist"]["ranks"]:
                assert seen["loss_scale_deviation"] <= bound and seen["loss_scale_residual"] <= residual_bound
                assert seen["first_average_off"] is None and seen["altered_at"] == []
