"""The ten items of the document's checklist, each judged on its own from the ranks' loops as the watcher saw them
(watch/verdict.py's Context): a judge returns its mark and what it saw, or raises a Refusal that says where and
what."""

import math
from collections import Counter

import torch

from ddp_no_sync_lab.audit.scale import loss_scale_bounds
from ddp_no_sync_lab.experiment import from_progressions
from ddp_no_sync_lab.watch.report import PASS, UNSEEN, human_bytes

WEIGHT_TOLERANCE = 1e-4  # a window's weights are float32 values read back: far finer than any divisor's error


class Refusal(Exception):
    """One item broken: where (rank, window, micro-batch) and what was seen against what was expected."""


# Where a framework, not the script, divides a short window's losses by the full window's length: what it does.
FRAMEWORK_FIXED_DIVISORS = {
    "Accelerate": "Accelerate's backward() divides every loss by gradient_accumulation_steps, a short last window's "
    "too: give every epoch whole windows (drop_last=True, or a dataset a multiple of the window)",
    "Lightning": "Lightning divides every training_step loss by accumulate_grad_batches, a short last window's too "
    "(Lightning-AI/pytorch-lightning#19987): give every epoch whole windows",
}


def step_targets(loop):
    runs = loop.seen["step_samples"]
    return Counter({value: count for value, count in runs}).most_common(1)[0][0] if runs else 0


# ----------------------------------------------------------------------------- the items


def judge_processes(context):
    """1. Each rank its own process; on CUDA each its own GPU."""
    model, world_size = context.model, context.world_size
    if len(model["ranks"]) != world_size or model["processes"] != world_size:
        raise Refusal(f"{world_size} ranks ran in {model['processes']} processes")
    if model["device_type"] == "cuda" and model["devices"] != world_size:
        raise Refusal(f"{world_size} ranks shared {model['devices']} GPUs: one process per GPU")
    devices = f", {model['devices']} GPUs" if model["device_type"] == "cuda" else ""
    return PASS, f"{world_size} ranks in {model['processes']} processes{devices}"


def judge_samples(context):
    """2. The ranks' inputs differ (each forward's fingerprint); a shuffling DistributedSampler's every pass in a
    new epoch's order (set_epoch before it)."""
    for rank, mine in enumerate(context.observed["ranks"]):
        orders = {}  # per sampler, the orders its training passes delivered
        for sampler, epoch, shuffle, order, _, trained in mine["sampler_passes"]:
            if not (shuffle and trained):  # an evaluation's loader, or one peeked at, may repeat its order
                continue
            if order in orders.setdefault(sampler, set()):
                raise Refusal(
                    f"rank {rank}: a DataLoader began a training pass over a shuffling DistributedSampler in the "
                    f"order of an earlier one (epoch {epoch} again): call sampler.set_epoch(epoch) before each "
                    f"epoch, or every epoch repeats the first one's order"
                )
            orders[sampler].add(order)
    prints = [loop.seen["input_prints"] for loop in context.loops]
    for a in range(len(prints)):
        for b in range(a + 1, len(prints)):
            if prints[a] and prints[a] == prints[b]:
                raise Refusal(
                    f"ranks {a} and {b} trained on the same inputs in all {len(prints[a])} forwards: each rank must "
                    f"read its own shard (a DistributedSampler, or data split by rank)"
                )
    trained = [record for record in context.observed["ranks"][0]["sampler_passes"] if record[-1]]
    sampled = (
        f"; {len(trained)} training passes over a DistributedSampler on rank 0, each in a new order"
        if trained
        else "; no DistributedSampler in training"
    )
    # Who set the epoch before each later pass (the first runs at the sampler's own epoch 0): a framework's loop
    # that sets it leaves the script nothing to forget.
    firsts = {sampler: index for index, (sampler, *_) in reversed(list(enumerate(trained)))}
    setters = {record[4] for index, record in enumerate(trained) if firsts[record[0]] != index}
    if setters and None not in setters:
        sampled += f"; set_epoch: — ({' and '.join(sorted(setters))} set it before every pass, not the script)"
    return PASS, f"each rank's inputs its own in every forward{sampled}"


def judge_steps(context):
    """8. One step per window: the ranks step alike, no window longer than the others (a shorter one, an epoch's
    last, is judged by its divisors at item 4), none empty, the optimizer's own count of its updates where it keeps
    one."""
    counts = [len(loop.windows) for loop in context.loops]
    if len(set(counts)) > 1:
        raise Refusal(f"the ranks stepped {counts} times: every rank steps at every window's end")
    length = context.length
    for loop in context.loops:
        for number, window in enumerate(loop.windows, 1):
            if not window:
                raise Refusal(
                    f"rank {loop.rank}, optimizer step {number}: it followed step {number - 1} with no backward "
                    f"between (an extra step())"
                )
            if len(window) > length:
                loop.refuse(
                    window[-1],
                    f"its window held {len(window)} micro-batches where the others hold {length} (a step() skipped)",
                )
            # Two windows' syncs, each as the loop asked for a window's last, with one step after both: one skipped.
            asked = [index for index in window[:-1] if context.asked_sync(loop, index)]
            if asked and context.asked_sync(loop, window[-1]) and not context.every_backward_synced:
                loop.refuse(
                    asked[0],
                    f"it synchronized as a window's last micro-batch does (its forward and backward with DDP's sync "
                    f"on) and no step followed (a step() skipped): its window held {len(window)} micro-batches",
                )
        counted, skipped = loop.seen.get("optimizer_state_steps"), loop.seen["skipped_steps"]
        if loop.seen.get("optimizer_counts_steps") and counted != len(loop.windows) - skipped:
            raise Refusal(
                f"rank {loop.rank}: the optimizer's state counted {counted} updates, its step hooks "
                f"{len(loop.windows) - skipped} (an update inside step() run twice, or skipped)"
            )
        if skipped and loop.rank == 0:
            context.notes.append(
                f"{skipped} optimizer steps skipped by GradScaler (inf or NaN gradients): their windows ended with no "
                f"update, their averages not compared"
            )
        if loop.trailing and loop.rank == 0:
            context.notes.append(f"{len(loop.trailing)} micro-batches after the last step reached no step")
    return PASS, f"{counts[0]} steps per rank, one per window of {length}"


def judge_resets(context):
    """7. Each window's first backward starts on reset gradients, no other does; no step on reset gradients,
    none between a forward and its backward."""
    for loop in context.loops:
        seen = loop.seen
        if seen["steps_before_backward"]:
            loop.refuse(seen["steps_before_backward"][0], "the optimizer stepped between its forward and its backward")
        fresh = set(from_progressions(seen["fresh_at_backward"]))
        for number, window in enumerate([*loop.windows, loop.trailing]):
            backwards = [index for index in window if index in loop.losses]
            # FSDP keeps a window's unsynchronized gradients unsharded, beyond zero_grad()'s reach: item 6 names it.
            unsynced_before = number and loop.seen["sharded"] and loop.windows[number - 1][-1] not in loop.syncs
            if backwards and backwards[0] not in fresh and not unsynced_before:
                loop.refuse(
                    backwards[0], "its backward added onto the last window's gradients (no zero_grad() after the step)"
                )
            inside = [index for index in backwards[1:] if index in fresh]
            if inside:
                loop.refuse(
                    inside[0],
                    "its backward started on reset gradients inside a window (zero_grad() before the window's "
                    "last micro-batch: the window's earlier gradients were lost)",
                )
        fresh_at_step = from_progressions(seen["fresh_at_step"])
        if fresh_at_step:
            loop.refuse(fresh_at_step[0], "the optimizer stepped on reset gradients (zero_grad() before step())")
    return PASS, "reset at every window's start and nowhere else"


def judge_intermediate_syncs(context):
    """5. No micro-batch but a window's last synchronized; the gradients only added onto between backwards."""
    for loop in context.loops:
        altered = from_progressions(loop.seen["altered_at"])
        if altered:
            loop.refuse(altered[0], "the gradients were not what the backward before left (changed between backwards)")
    if context.every_backward_synced:
        length, per_sync = context.length, context.bytes_per_sync()
        if length > 1:
            context.notes.append(
                f"{length} syncs per window where 1 suffices: no_sync() around the forward and backward of the "
                f"first {length - 1} micro-batches would save {human_bytes((length - 1) * per_sync)} per window"
            )
        return UNSEEN, "no_sync() not used: every micro-batch synchronized (correct, and the most traffic)"
    for loop in context.loops:
        for window in loop.windows:
            for index in window[:-1]:
                if index not in loop.syncs:
                    continue
                if loop.flags_at_forward[index] and not loop.flags_at_backward.get(index, True):
                    loop.refuse(
                        index,
                        "it synchronized: its backward ran with DDP's sync off but its forward with it on (no_sync() "
                        "entered, or require_backward_grad_sync set False, after the forward), and DDP decides at "
                        "the forward: put the forward inside no_sync() too",
                    )
                if not loop.flags_at_forward[index] and not loop.flags_at_backward.get(index, True):
                    loop.refuse(
                        index,
                        "it synchronized although its forward and backward ran with DDP's sync off: an earlier "
                        "forward with the sync on and gradients enabled was followed by no backward, and left DDP "
                        "waiting for one (run such a forward under torch.no_grad(), or inside no_sync())",
                    )
                loop.refuse(index, "it synchronized, and it is not its window's last micro-batch")
    return PASS, "every other micro-batch's forward and backward without a sync"


def judge_last_synced(context):
    """6. Each window's last micro-batch synchronized, and the gradient the step took the ranks' mean."""
    if context.world_size > 1:
        for loop in context.loops:
            for window in loop.windows:
                if not window or window[-1] in loop.syncs:
                    continue
                index = window[-1]
                if not loop.flags_at_forward[index] and loop.flags_at_backward.get(index):
                    loop.refuse(
                        index,
                        "it did not synchronize: its forward ran with DDP's sync off (the flag set back on only "
                        "after the forward; DDP decides at the forward), so the step took this rank's own gradients",
                    )
                if loop.seen["sharded"]:
                    loop.refuse(
                        index,
                        "it did not synchronize (its backward with FSDP's gradient sync off: "
                        "set_requires_gradient_sync(True) before it): the step did not take the ranks' mean gradient",
                    )
                loop.refuse(
                    index,
                    "it did not synchronize (its forward and backward inside no_sync()): the step took this rank's "
                    "own gradients, not the ranks' mean",
                )
    for loop in context.loops:
        off = loop.seen.get("first_average_off")
        if off is not None:
            raise Refusal(
                f"rank {loop.rank}, optimizer step {off['optimizer_step']}: the synchronized gradient's projection "
                f"{off['synced']!r} is not the mean of the ranks' local ones {off['mean_of_ranks']!r} (bound "
                f"{off['bound']!r}): the reduction did not average{summed(context, loop, off)}"
            )
    return (
        PASS,
        f"each window's last micro-batch synchronized: the ranks' mean, at {context.loops[0].seen['averages_checked']} steps",
    )


def summed(context, loop, off):
    """Where the synchronized gradient is the ranks' sum (world_size times their mean, within the bound): said,
    and on FSDP2 over gloo, why and the correction."""
    world_size = context.world_size
    if not abs(off["synced"] - world_size * off["mean_of_ranks"]) <= world_size * off["bound"]:
        return ""
    if loop.seen["sharded"] and context.observed["backend"] == "gloo":
        return (
            f": it is the {world_size} ranks' sum: torch's FSDP2 hands ReduceOp.AVG to gloo's reduce-scatter, which "
            f"sums (pytorch/pytorch#162338): call set_force_sum_reduction_for_comms(True) on every FSDP module (it "
            f"divides by the world size itself)"
        )
    return f": it is the {world_size} ranks' sum (a hook that sums without dividing by the world size)"


def judge_divisors(context):
    """4. Over a window and the ranks, the weights of its micro-batches' mean losses (1 / the divisor read at each
    loss) sum to one mean; weights unequal per item that still sum to one are a note."""
    loops, world_size = context.loops, context.world_size
    bound, residual_bound = loss_scale_bounds_any()
    for loop in loops:
        deviation, residual = loop.seen.get("loss_scale_deviation"), loop.seen.get("loss_scale_residual")
        if deviation is None or deviation > bound or residual is None or residual > residual_bound:
            context.notes.append(
                f"rank {loop.rank}: the gradient at the logits is not the cross-entropy's alone (deviation "
                f"{deviation!r}, residual {residual!r}): another term on the same logits; the divisors are read at "
                f"the cross-entropy's value"
            )
            break
    unequal = None
    for number in range(1, min(len(loop.windows) for loop in loops) + 1):
        weights = []  # (rank loop, micro-batch, weight of its mean loss, its items)
        for loop in loops:
            for index in loop.windows[number - 1]:
                read, items = loop.losses[index]
                weights.append((loop, index, 1 / read if read and math.isfinite(read) else math.nan, items))
        if not weights:
            continue
        total = sum(weight for _, _, weight, _ in weights) / world_size
        if not abs(total - 1) <= WEIGHT_TOLERANCE:
            loop, index, _, _ = weights[0]
            divisors = sorted(
                {f"{1 / weight:.4g}" if weight else "inf" for _, _, weight, _ in weights if weight == weight}
            )
            length = len(loop.windows[number - 1])
            loop.refuse(index, unweighed(context, weights, length, divisors, total))
        per_item = [weight / items for _, _, weight, items in weights if items]
        if per_item and max(per_item) > min(per_item) * (1 + WEIGHT_TOLERANCE) and unequal is None:
            unequal = number
    if unequal is not None:
        context.notes.append(
            f"window {unequal}: its items weigh unequally (a micro-batch's mean over fewer items weighs as much as "
            f"the others'): the losses still sum to one mean; per-item normalization would weigh every item alike"
        )
    return PASS, f"every window's losses weigh one mean ({len(loops[0].windows)} windows)"


def unweighed(context, weights, length, divisors, total):
    """Why a window's losses weigh `total` means, not one: the framework's fixed divisor of a short window, a
    per-item normalization over a count the losses do not hold, or the divisors themselves."""
    framework = context.loops[0].seen.get("made_by")
    if length < context.length and divisors == [str(context.length)] and framework in FRAMEWORK_FIXED_DIVISORS:
        return (
            f"the window's {length} micro-batch losses were each divided by {context.length}, the full window's "
            f"length: they weigh {total:.4g} means over the window and the ranks: {FRAMEWORK_FIXED_DIVISORS[framework]}"
        )
    items = [count for _, _, _, count in weights]
    per_item = [weight / count for _, _, weight, count in weights if count]
    if (
        len(per_item) == len(weights)
        and len(set(items)) > 1
        and max(per_item) <= min(per_item) * (1 + WEIGHT_TOLERANCE)
    ):  # every item weighed alike: a per-item normalization, over a count other than the losses' items
        assumed = context.world_size / per_item[0]
        return (
            f"the window's {length} micro-batch losses weighed every item alike, as 1 of {assumed:.6g} items over "
            f"the window and the ranks, where its losses count {sum(items)}: they weigh {total:.4g} means (normalize "
            f"by the items the loss counts: a count with targets the loss ignores or shifts out weighs the window "
            f"short)"
        )
    return (
        f"the window's {length} micro-batch losses were each divided by {' or '.join(divisors) or 'nothing read'}: "
        f"they weigh {total:.4g} means over the window and the ranks, where they must weigh one (divide each "
        f"mean loss by {length}, the window's length, or normalize by its items over the window and the ranks)"
    )


def loss_scale_bounds_any():
    """The loss scale's bounds where the logits' gradient may be BF16 (autocast): the loosest the lab allows."""
    return loss_scale_bounds(torch.bfloat16)


def judge_samples_in_loss(context):
    """3. Every forward's batch reached its loss."""
    for loop in context.loops:
        if loop.seen["loss_short_of_samples"]:
            loop.refuse(loop.seen["loss_short_of_samples"][0], "its loss took fewer samples than its forward")
    return PASS, f"{step_targets(context.loops[0])} loss targets per step over all ranks"


def judge_sync_count(context):
    """9. One sync per window."""
    per_window = [sum(index in loop.syncs for index in window) for loop in context.loops for window in loop.windows]
    if context.every_backward_synced:
        return UNSEEN, f"{context.length} syncs per window (every micro-batch)"
    if set(per_window) != {1}:
        loop = context.loops[0]
        raise Refusal(f"rank {loop.rank}: syncs per window {sorted(set(per_window))}, one per window expected")
    return PASS, f"1 per window: {context.loops[0].seen['syncs']} syncs for {len(context.loops[0].windows)} steps"


def judge_artifacts(context):
    """10. The lab's own report.json: nothing of a foreign script's."""
    return UNSEEN, "the lab's own artifacts: not a foreign script's"


ITEM_JUDGES = {
    1: judge_processes,
    2: judge_samples,
    3: judge_samples_in_loss,
    4: judge_divisors,
    5: judge_intermediate_syncs,
    6: judge_last_synced,
    7: judge_resets,
    8: judge_steps,
    9: judge_sync_count,
    10: judge_artifacts,
}
