"""no_sync changes the communication and nothing else: the same updates as `every` and as one process that
accumulates both ranks' gradients by hand (tests/workers/equivalence.py; CPU; float32 and float64 without
autocast, and BF16 autocast on float32 weights: the lab's two precisions and an exact reference).

Three comparisons, each after every optimizer step, of the synchronized gradients and the parameters:
- float32, against a hand-made reference that adds the same numbers in the same order as the mode does
  (every: the ranks' running sums averaged after each micro-batch; no_sync: each rank's window summed, then
  averaged once): bit for bit equal. Only the order of floating-point sums can differ, and here it does not.
- float32, against one plain sum of all micro-batches of all ranks: the first update agrees to 1e-7. Later
  updates drift (up to about 1e-2): a rounding-level difference flips some ReLU and max-pool decisions,
  which then changes whole gradient terms. That is why the next comparison is in float64.
- float64, against the plain sum: every step agrees to rounding (observed below 1e-14), while each broken
  accumulation (no_sync on the wrong micro-batch, losses not divided by accum_steps, a step inside the window,
  a short last window divided by accum_steps) is off by far more.

- BF16 autocast on float32 weights (the lab's numerics), against the plain sum under the same autocast: the
  first update agrees to 1e-6 (measured here: 2.0e-9 for the gradients, 2.9e-9 for the parameters, and at most
  5.4e-9 over three steps; the convolutions' BF16 products are the same bits in both, only the float32 sums
  differ in order), while the broken plans are off by 7e-5 (parameters) to 3.0 (gradients) at the first update.

Gradients are compared as well as parameters because AdamW is almost blind to the scale of its gradients:
parameters alone would hardly show losses left undivided by accum_steps.
"""

import pytest

FLOAT64_TOLERANCE = 1e-12  # relative L2 difference of gradients and parameters, every step
FLOAT32_FIRST_STEP_TOLERANCE = 1e-5  # the same, first update, float32 against the plain sum
BFLOAT16_AUTOCAST_FIRST_STEP_TOLERANCE = 1e-6  # the same, first update, under the lab's BF16 autocast
CASES = {"full_windows": (3, {"every": 12, "no_sync": 3}), "partial_window": (4, {"every": 14, "no_sync": 4})}
MODES = ("every", "no_sync")


@pytest.fixture(scope="module")
def results(worker_results):
    return worker_results["equivalence.py"]


def agrees(variant, tolerance, steps=None):
    steps = slice(steps)
    return (
        variant["steps"] == variant["reference_steps"]
        and variant["ranks_agree"]
        and max(variant["grad_relative"][steps]) < tolerance
        and max(variant["param_relative"][steps]) < tolerance
    )


@pytest.mark.torchrun
@pytest.mark.parametrize("precision", ["float64", "float32", "bfloat16_autocast"])
def test_counting_hook_keeps_ddps_averaging(results, precision):
    assert results[precision]["hook_max_difference"] == 0.0


@pytest.mark.torchrun
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("mode", MODES)
def test_float32_equals_the_reference_summed_in_the_same_order_bit_for_bit(results, case, mode):
    steps, syncs = CASES[case]
    variant = results["float32"][case][f"{mode}_vs_same_order"]
    assert variant["steps"] == variant["reference_steps"] == steps
    assert variant["gradient_syncs"] == syncs[mode]
    assert variant["ranks_agree"]
    assert variant["grad_relative"] == variant["param_relative"] == [0.0] * steps


@pytest.mark.torchrun
def test_nanogpts_require_backward_grad_sync_idiom_is_no_sync_to_the_bit(results):
    """nanoGPT sets `model.require_backward_grad_sync` before each forward instead of entering no_sync(): the
    same flag no_sync() clears and restores, so the same syncs, the same gradients and the same weights."""
    variant = results["float32"]["full_windows"]["nanogpt_idiom_vs_no_sync"]
    assert variant["steps"] == variant["reference_steps"] == 3
    assert variant["gradient_syncs"] == 3
    assert variant["grad_relative"] == variant["param_relative"] == [0.0] * 3


@pytest.mark.torchrun
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("mode", MODES)
def test_float32_first_update_matches_the_plain_sum(results, case, mode):
    variant = results["float32"][case][mode]
    assert agrees(variant, FLOAT32_FIRST_STEP_TOLERANCE, steps=1), variant


@pytest.mark.torchrun
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("mode", MODES)
def test_float64_every_step_matches_the_plain_sum(results, case, mode):
    steps, syncs = CASES[case]
    variant = results["float64"][case][mode]
    assert variant["steps"] == variant["reference_steps"] == steps
    assert variant["gradient_syncs"] == syncs[mode]
    assert agrees(variant, FLOAT64_TOLERANCE), variant


@pytest.mark.torchrun
@pytest.mark.parametrize(
    "case, broken",
    [
        ("full_windows", "broken_no_sync_on_wrong_micro_batch"),
        ("full_windows", "broken_loss_not_divided"),
        ("full_windows", "broken_step_inside_window"),
        ("partial_window", "broken_short_window_divided_by_accum_steps"),
    ],
)
def test_the_comparison_catches_a_broken_accumulation(results, case, broken):
    variant = results["float64"][case][broken]
    assert not agrees(variant, FLOAT64_TOLERANCE), variant
    # Not by a hair: a broken plan is off by orders of magnitude more than the tolerance.
    assert variant["steps"] != variant["reference_steps"] or max(variant["grad_relative"]) > 1e-3


@pytest.mark.torchrun
def test_a_short_last_micro_batch_is_normalized_per_sample(results):
    """Half a batch last (4 of 8 images per rank): train.py's divisors (experiment.sample_plan: the window's
    samples over the micro-batch's) give one process's mean over the window's samples in float64, every step, in
    both modes; the document's divisor (the window's length) weighs the short micro-batch's images twice."""
    case = results["float64"]["short_micro_batch"]
    for mode, syncs in (("every", 8), ("no_sync", 2)):
        assert case[mode]["steps"] == case[mode]["reference_steps"] == 2 and case[mode]["gradient_syncs"] == syncs
        assert agrees(case[mode], FLOAT64_TOLERANCE), case[mode]
    assert max(case["broken_short_micro_batch_divided_by_window_length"]["grad_relative"]) > 1e-3


@pytest.mark.torchrun
@pytest.mark.parametrize("mode", MODES)
def test_bfloat16_autocast_first_update_matches_the_plain_sum(results, mode):
    steps, syncs = CASES["full_windows"]
    variant = results["bfloat16_autocast"]["full_windows"][mode]
    assert variant["steps"] == variant["reference_steps"] == steps
    assert variant["gradient_syncs"] == syncs[mode]
    assert agrees(variant, BFLOAT16_AUTOCAST_FIRST_STEP_TOLERANCE, steps=1), variant


@pytest.mark.torchrun
@pytest.mark.parametrize(
    "broken", ["broken_no_sync_on_wrong_micro_batch", "broken_loss_not_divided", "broken_step_inside_window"]
)
def test_under_bfloat16_autocast_the_comparison_still_catches_a_broken_accumulation(results, broken):
    variant = results["bfloat16_autocast"]["full_windows"][broken]
    assert not agrees(variant, BFLOAT16_AUTOCAST_FIRST_STEP_TOLERANCE, steps=1), variant
    assert variant["steps"] != variant["reference_steps"] or max(variant["grad_relative"][:1]) > 0.1


@pytest.mark.torchrun
@pytest.mark.parametrize("mode", MODES)
def test_fsdp_float64_every_step_matches_the_plain_sum(results, mode):
    """--strategy fsdp (ddp_no_sync_lab/strategies/fsdp.py) in both modes: one process's updates to rounding, every
    step."""
    steps, syncs = CASES["full_windows"]
    variant = results["float64"]["fsdp"][mode]
    assert variant["steps"] == variant["reference_steps"] == steps
    assert variant["gradient_syncs"] == syncs[mode]
    assert agrees(variant, FLOAT64_TOLERANCE), variant


@pytest.mark.torchrun
def test_fsdp_equals_ddp_in_float32(results):
    """no_sync: each rank sums its window in the same order under both strategies, then DDP halves and adds
    (a / 2 + b / 2) where FSDP adds and halves ((a + b) / 2): with two ranks halving is exact, so the two are the
    same bits. every: FSDP adds each micro-batch's mean to its sharded sum, DDP averages the running sums:
    rounding apart, within the plain sum's own first-step tolerance."""
    fsdp = results["float32"]["fsdp"]
    assert fsdp["no_sync_vs_ddp"]["grad_relative"] == fsdp["no_sync_vs_ddp"]["param_relative"] == [0.0] * 3
    assert fsdp["every_vs_ddp"]["gradient_syncs"] == 12 and agrees(
        fsdp["every_vs_ddp"], FLOAT32_FIRST_STEP_TOLERANCE, 1
    )
    for mode in MODES:
        assert agrees(fsdp[mode], FLOAT32_FIRST_STEP_TOLERANCE, steps=1), fsdp[mode]


@pytest.mark.torchrun
def test_fsdps_own_reduction_is_twice_the_mean_where_gloo_sums(results):
    """FSDP hands gloo's reduce-scatter ReduceOp.AVG for float32 gradients; torch 2.8's gloo sums
    (pytorch/pytorch#162338, asked in the worker): without the lab's correction every gradient is then twice the
    mean (relative difference 1.0 from the reference), which AdamW barely notices. Where gloo averages (2.11) the
    uncorrected reduction agrees as the corrected one does."""
    fsdp = results["float32"]["fsdp"]
    uncorrected = fsdp["broken_uncorrected_reduction"]
    if fsdp["gloo_average"] == "sum":
        assert uncorrected["grad_relative"][0] == pytest.approx(1.0, abs=1e-5)
    else:
        assert fsdp["gloo_average"] == "mean" and agrees(uncorrected, FLOAT32_FIRST_STEP_TOLERANCE, steps=1)
