"""The document's checklist observed: each accumulation bug, injected in the loop and beneath it, refused by
verify.py naming the item it breaks; the witnesses' tolerances; the strict audit holding the whole documented
experiment; verify.py printing the checklist."""

import json
import shutil

import pytest
import torch

from conftest import SMALL_RUN, assert_ok, copy_runs, read_json, torchrun, verify
from lab import certify, checklist, experiment, records
from model import CifarCNN

# Each bug, the checklist item it breaks, and the modes its two injections run in (the loop's first, then
# beneath the loop's): across the bugs each way meets each mode.
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
}
LABEL_LIE = "compression_label_lies"  # --comm-hook bf16 sending float32: both modes trained with it


def other(mode):
    return "every" if mode == "no_sync" else "no_sync"


@pytest.fixture(scope="module")
def injected_runs(tmp_path_factory, image_data):
    """Every scenario trained in one torchrun start (tests/workers/checklist_bugs.py)."""
    out = tmp_path_factory.mktemp("bugs")
    scenarios = [
        f"{bug}:{way}:{mode}" for bug, (_, modes) in BUGS.items() for way, mode in zip(("loop", "beneath"), modes)
    ] + [f"{LABEL_LIE}:loop:both", f"{LABEL_LIE}:beneath:both"]
    result = torchrun(
        "tests/workers/checklist_bugs.py", out, *scenarios, "--", "--data-dir", image_data, *SMALL_RUN, timeout=1200
    )
    assert_ok(result)
    return out


def refusal(result):
    assert result.returncode == 1, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    assert "AUDIT PASSED" not in result.stdout and "Traceback" not in result.stderr, result.stderr
    (line,) = [line for line in result.stderr.splitlines() if line.strip()]
    return line


@pytest.mark.parametrize("way", ["loop", "beneath"])
@pytest.mark.parametrize("bug", sorted(BUGS))
def test_each_bug_is_refused_naming_its_checklist_item(bug, way, injected_runs, lab_runs, tmp_path):
    """The bugged mode beside the same experiment's correct other mode (the shared runs): refused, the item
    named, whatever the way the bug was made."""
    item, modes = BUGS[bug]
    mode = modes[0] if way == "loop" else modes[1]
    artifacts = copy_runs(injected_runs / f"{bug}-{way}-{mode}", tmp_path / "artifacts")
    shutil.copytree(lab_runs[0] / other(mode), artifacts / other(mode))
    line = refusal(verify(artifacts))
    assert f"{artifacts}/{mode}/history.json: " in line
    assert line.endswith(certify.item(item)), line


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


def test_the_witnesses_saw_the_correct_runs_as_they_are(lab_runs):
    """What the shared correct runs' rows hold: every micro-batch's backward, the resets at the windows' starts
    alone, the window's divisor at every micro-batch, 2 ranks x 16 samples behind every step, every step's
    average checked, the optimizer's own count equal to its hooks'."""
    artifacts, _ = lab_runs
    for mode in ("every", "no_sync"):
        for row in read_json(artifacts / mode / "history.json"):
            seen = row["checklist"]
            assert seen["ranks"] == {
                "processes": 2,
                "devices": 1,  # both ranks on this machine's CPU: the one-GPU-each rule is CUDA's
                "device_type": "cpu",
                "per_rank": [{"micro_batches": 20, "samples": 80, "backwards": 20}] * 2,
            }
            assert seen["backward_starts"] == [[0, 20, 1]]
            assert seen["fresh_at_backward"] == [[0, 17, 4]]
            assert (seen["fresh_at_step"], seen["altered_at"], seen["steps_before_backward"]) == ([], [], [])
            assert seen["loss_divisors"] == [[0, 20, 4]]
            assert seen["step_samples"] == [[32, 5]] and seen["step_micro_batches"] == [[8, 5]]
            assert seen["averages_checked"] == 5 and seen["first_average_off"] is None
            assert seen["optimizer_state_steps"] == 5
            assert row["witness_allreduces"] == 5
            bound, residual_bound = checklist.loss_scale_bounds(torch.bfloat16)
            assert 0 < seen["loss_scale_deviation"] <= bound and 0 < seen["loss_scale_residual"] <= residual_bound


def test_the_loss_scale_witness_reads_the_divisor_off_the_logits_gradient():
    """The witness's arithmetic on a known gradient: (softmax - one-hot) / batch / divisor gives the divisor
    back, within float32's rounding; the same gradient rounded to BF16 stays within the BF16 bound."""
    logits = torch.randn(50, 10, generator=torch.Generator().manual_seed(3))
    targets = torch.randint(0, 10, (50,), generator=torch.Generator().manual_seed(4))
    for divisor in (1, 4, 16):
        leaf = logits.clone().requires_grad_()
        (torch.nn.functional.cross_entropy(leaf, targets) / divisor).backward()
        for dtype in (torch.float32, torch.bfloat16):
            seen = leaf.grad.to(dtype)
            expected = torch.softmax(logits.double(), 1)
            expected[torch.arange(50), targets] -= 1
            expected /= 50
            found = expected.pow(2).sum() / (seen.double() * expected).sum()
            residual = (seen.double() * found - expected).norm() / expected.norm()
            deviation_bound, residual_bound = checklist.loss_scale_bounds(dtype)
            assert abs(found / divisor - 1) <= deviation_bound and residual <= residual_bound


def test_strict_verify_holds_every_documented_key(tmp_path):
    """Another seed, or a 100-image test set, is not the documented experiment even when every count would
    match: the first differing key is named."""
    path = tmp_path / "run.json"
    certify.check_documented(path, dict(experiment.DOCUMENTED))
    for key, value in (("seed", 48), ("test_size", 100), ("learning_rate", 1e-3), ("augmentation", "none")):
        with pytest.raises(records.AuditError) as caught:
            certify.check_documented(path, {**experiment.DOCUMENTED, key: value})
        assert str(caught.value) == (
            f"{path}: config {key}={value!r} is not the documented experiment's {experiment.DOCUMENTED[key]!r}: run "
            f"the documented experiment, or audit these runs against their own configuration with --expect-from-config"
        )


def test_verify_prints_the_checklist_with_its_witnesses(lab_runs):
    result = verify(lab_runs[0])
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
    record["files"]["history.json"] = {"bytes": path.stat().st_size, "sha256": records.sha256_file(path)}
    (artifacts / "no_sync" / "run.json").write_text(json.dumps(record))
    assert f"{path}: epoch row 2: checklist must hold the witnesses' observations" in refusal(verify(artifacts))
