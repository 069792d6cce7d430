"""The loss scale of each backward, as the checklist's item 4 reads it (audit/checklist.py's witnesses): the divisor
the loop applied, read exactly at the loss, and the gradient that reached the logits fitted against the mean
cross-entropy's own; their bounds per precision, and how a divisor is recorded in an epoch's row.
"""

import math

import torch
from torch.nn import functional as F

from ddp_no_sync_lab import experiment
from ddp_no_sync_lab.experiment import IGNORE_INDEX

# Rounding of one operation, by dtype: half an ulp relative (unit roundoff).
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float64: 2.0**-53}
# The mean loss's gradient is recomputed with torch's own kernels on the same float32 logits, so the two differ
# only by the window's division (exact for a power of two, a few float32 roundings otherwise) and the rounding
# to the logits' dtype: 2**-20 bounds the float32 part with room.
FLOAT32_SLACK = 2.0**-20
WHOLE = 1e-6  # a divisor read is whole to float32's precision (2**-24 per rounding) when it is whole


def loss_scale_bounds(gradient_dtype):
    """(divisor's relative deviation, residual) allowed for a logits gradient held in `gradient_dtype`: each
    element of it is the recomputed one divided by the divisor, within u of its own size (u of the dtype, plus
    the float32 slack), so the fitted divisor moves by at most u / (1 - u) and the residual by at most twice."""
    unit = UNIT_ROUNDOFF[gradient_dtype] + FLOAT32_SLACK
    return 1.1 * unit, 2.2 * unit


CROSS_ENTROPY = F.cross_entropy  # taken at import: what the run's own code may wrap later is not the reference


def loss_scale(logits, targets, gradient, token_scale=None, read=None, ignore_index=IGNORE_INDEX):
    """[divisor fitted, residual, divisor read]. Fitted: the gradient at the logits as the mean cross-entropy's,
    recomputed by torch's kernels on the same float32 logits, over the divisor; the residual relative to it. Read:
    given (checklist.LossReading.divisor), else NaN; targets equal to `ignore_index` count for nothing. Text: the reference is token_scale x the token loss's sum, and
    the residual takes the divisor read."""
    with torch.enable_grad(), torch.autocast(logits.device.type, enabled=False):
        leaf = logits.detach().float().requires_grad_()
        if token_scale is None:
            reference = CROSS_ENTROPY(leaf, targets, ignore_index=ignore_index)
        else:  # the summed token loss: the text task's divisor is then the window's tokens
            summed = CROSS_ENTROPY(leaf.flatten(0, -2), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
            reference = token_scale * summed
        (mean_loss_gradient,) = torch.autograd.grad(reference, leaf)
    expected, seen = mean_loss_gradient.double(), gradient.double()
    fitted = expected.square().sum() / (seen * expected).sum()
    read = torch.full_like(fitted, math.nan) if read is None else read
    divisor = fitted if token_scale is None else read  # the text task: NaN where nothing was read, refused
    return torch.stack([fitted, (seen * divisor - expected).norm() / expected.norm(), read])


def recorded_divisor(fitted, read):
    """A backward's divisor as recorded: the one read, whole where whole to WHOLE, else to 6 decimals (a window of
    unequal micro-batches); where none was read, the fit rounded to a whole number; None where not finite."""
    if not math.isfinite(read):
        return round(fitted) if math.isfinite(fitted) else None
    return round(read) if abs(read - round(read)) <= WHOLE * abs(read) else round(read, 6)


def divisor_runs(positions, scales):
    """Per backward its micro-batch and [divisor fitted, residual, divisor read], as [start, stop, divisor] runs of
    consecutive micro-batches (stop exclusive), each divisor as recorded_divisor records it."""
    runs = []
    for index, (fitted, _, read) in zip(positions, scales):
        whole = recorded_divisor(fitted, read)
        if runs and runs[-1][1] == index and runs[-1][2] == whole:
            runs[-1][1] += 1
        else:
            runs.append([index, index + 1, whole])
    return runs


def token_weights(row, config):
    """Per micro-batch of every rank: how much each of its tokens weighed in its window's update against its share
    (1 / the window's tokens over every rank): the window's tokens over the divisor read at its loss."""
    windows, weights = experiment.window_indices(experiment.epoch_plan(config)), []
    for rank in row["checklist"]["ranks"]:
        divisors = {index: divisor for start, stop, divisor in rank["loss_divisors"] for index in range(start, stop)}
        totals = experiment.from_runs(rank["step_tokens"])
        weights += [total / divisors[index] for window, total in zip(windows, totals) for index in window]
    return weights
