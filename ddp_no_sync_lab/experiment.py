"""The fixed experiment and what it implies: the documented configuration, the accumulation window plan that
train.py executes and verify.py counts, and the arithmetic from a configuration to the exact communication of
each epoch. Each fact lives here once; train.py's defaults and verify.py's strict audit both come from here.
"""

import argparse
import math
from dataclasses import dataclass, replace

from ddp_no_sync_lab.cli import LabError
from ddp_no_sync_lab.options import TrainOptions

MODES, STRATEGIES = ("every", "no_sync"), ("ddp", "fsdp")  # DDP's replicas; FSDP2's shards (strategies/fsdp.py)
TASKS = ("cifar10", "text")  # the document's image task; packed sequences of text (tasks/packed.py, docs/packed.md)
# How the text task divides a micro-batch's mean token loss before backward(): by the window's global token
# count over its own (tokens: every token weighs the same), or by the window's length (micro-batch: the bias).
LOSS_NORMALIZATIONS = ("tokens", "micro-batch")
IGNORE_INDEX = -100  # torch's cross_entropy default: a target that counts for nothing (padding, boundaries)
PARTIAL_WINDOW_POLICIES = ("error", "scale")
BUCKET_CAP_MB = 25.0  # explicit: DDP's default would cap the first bucket at 1 MiB and split the gradients in two
# DDP holds the cap in bytes, int(MB * 2**20), as a signed 64-bit integer: caps from 2**43 MB on overflow it.
BUCKET_CAP_MB_LIMIT = 2**43
# torch's generators take seeds from 0 to 2**64 - 1; a run seeds rank r with seed + r and its sampler's epoch e
# with seed + e. (Negative seeds alias large ones modulo 2**64, two names for one run: refused too.)
SEED_LIMIT = 2**64
# DDP's gradient hooks train.py offers: its averaging all-reduce, torch's BF16 and FP16 compressions (cast,
# all-reduce, cast back), with the bytes each element costs on the wire.
SENT_ELEMENT_BYTES = {"allreduce": 4, "bf16": 2, "fp16": 2}
COMM_HOOKS = tuple(SENT_ELEMENT_BYTES)
# DDP's settings and gradient hook as documented (train.py's defaults; the audit derives counts from a run's own).
DDP_DEFAULTS = {
    "bucket_cap_mb": BUCKET_CAP_MB,
    "broadcast_buffers": True,
    "find_unused_parameters": False,
    "gradient_as_bucket_view": False,
    "static_graph": False,
    "comm_hook": "allreduce",
}

# The experiment of the document.
DOCUMENTED = {
    "world_size": 2,
    "batch_size": 50,
    "accum_steps": 4,
    "epochs": 5,
    "seed": 47,
    "partial_window": "error",
    "train_size": 40_000,
    "validation_size": 10_000,
    "test_size": 10_000,
    "learning_rate": 3e-3,  # AdamW's, with CosineAnnealingLR over the epochs
    "weight_decay": 1e-4,
    "augmentation": "RandomCrop(32, padding=4), RandomHorizontalFlip(0.5)",
    **DDP_DEFAULTS,
}
# The text task's documented configuration (docs/packed.md): 8 rows of 128 bytes per micro-batch; its sizes follow
# from the corpus of the Python that runs it (its data fingerprint); a short last window by its own tokens.
TEXT_DOCUMENTED = {
    **{key: DOCUMENTED[key] for key in ("world_size", "accum_steps", "seed", "learning_rate", "weight_decay")},
    **{"task": "text", "batch_size": 8, "epochs": 8, "partial_window": "scale", "loss_normalization": "tokens"},
    **{"augmentation": "none", **DDP_DEFAULTS},
}


def documented(task):  # the lab's task's documented experiment, which the strict audit holds
    return TEXT_DOCUMENTED if task == "text" else DOCUMENTED


# The strict audit's floor for the documented run's test accuracy. Every documented run measured reaches
# 0.70 to 0.71, in BF16 and in float32, on two CPU kinds; the majority baseline is 0.10, and a run whose
# gradients never reach its weights stays there. Half-way leaves room for other seeds and hardware.
DOCUMENTED_ACCURACY_FLOOR = 0.5
VALIDATION_FRACTION = 5  # the last fifth of the seeded permutation of the train source is validation
BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024  # DDP's broadcast_bucket_size for buffers
# Once, after its first synchronized backward, DDP rebuilds its buckets and broadcasts rank 0's bucket order:
# the bucket indices and the bucket sizes, two collectives (tests/test_comm_audit.py checks them against the
# profiler's c10d::broadcast_ events).
REBUILD_BROADCASTS = 2
# The kinds of collective the profile tells apart in training: DDP's gradient all-reduce, the lab's all-reduce of
# the ranks' fingerprints after each step, the checklist's of the local projections before it, the broadcasts, FSDP's.
COLLECTIVE_KINDS = (
    "gradient all-reduce",
    "rank-agreement all-reduce",
    "average-witness all-reduce",
    "broadcast",
    "all-gather",
    "reduce-scatter",
)
FSDP_COUNTS = ("all_gathers", "all_gather_bytes", "reduce_scatters", "reduce_scatter_bytes")  # DDP's: none
# What the audit counts per rank and epoch (train.py's history rows; expected_epoch_counts gives each exactly).
COUNTS = (
    "sync_bucket_calls",
    "gradient_syncs",
    "allreduce_bytes",
    "buffer_broadcast_collectives",
    "broadcast_bytes",
    "rebuild_broadcast_collectives",
    "used_map_allreduces",
    "witness_allreduces",
    *FSDP_COUNTS,
)


# ----------------------------------------------------------------------------- the accumulation window


@dataclass(frozen=True)
class MicroStep:
    """What one micro-batch does: all-reduce in its backward (in no_sync mode), divide its loss, step after it."""

    sync: bool
    loss_divisor: float  # the window's length, or per sample / per token (sample_plan, packed.loss_plan)
    step: bool


def seed_range_error(seed, epochs, world_size):
    """Why `seed` cannot seed a run of `epochs` epochs on `world_size` ranks, or None."""
    highest = SEED_LIMIT - max(epochs, world_size)
    if not 0 <= seed <= highest:
        return (
            f"must be from 0 to {highest} for {epochs} epochs on {world_size} ranks (torch seeds each rank and "
            f"epoch with seed + its number, below 2**64), got {seed}"
        )
    return None


def in_range(parser: argparse.ArgumentParser, options: TrainOptions, task_documented: dict) -> TrainOptions:
    """train.py's options whose range depends on torch's limits or on other options, checked at parse time;
    returned completed with the task's documented values (task_documented) for those not given."""
    given = {name: getattr(options, name) for name in ("epochs", "batch_size", "partial_window")}
    options = replace(options, **{name: task_documented[name] for name, value in given.items() if value is None})
    if options.task == "text" and options.loader != "tensor":
        parser.error("argument --loader: the text task has one loader (its packed rows on the device); drop --loader")
    seed_error = seed_range_error(options.seed, options.epochs, options.expected_world_size)
    if seed_error:
        parser.error(f"argument --seed: {seed_error}")
    if not options.bucket_cap_mb < BUCKET_CAP_MB_LIMIT:
        parser.error(
            f"argument --bucket-cap-mb: must be below 2**43 = {BUCKET_CAP_MB_LIMIT} (DDP holds the cap in "
            f"bytes as a 64-bit integer; any cap above the model's size makes one bucket), got {options.bucket_cap_mb:g}"
        )
    return options


def window_plan(num_micro_batches, accum_steps, partial_window):
    """The micro-batches of one epoch grouped into windows of accum_steps; the last one of each window syncs.

    With partial_window="error" a remainder stops the run (divided by accum_steps, a short last window would
    shrink its update); with "scale" the short window's losses are divided by its real length, so every
    update is the mean over its own micro-batches.
    """
    remainder = num_micro_batches % accum_steps
    if remainder and partial_window == "error":
        raise LabError(
            f"{num_micro_batches} micro-batch-uri nu se împart exact la accum_steps={accum_steps} "
            f"(a last window of {remainder} divided by {accum_steps} would shrink that update's gradient); "
            f"choose --accum-steps that divides {num_micro_batches}, or pass --partial-window scale",
            kind="RuntimeError",
        )
    plan = []
    for window_start in range(0, num_micro_batches, accum_steps):
        window_size = min(accum_steps, num_micro_batches - window_start)
        for position in range(window_size):
            closes_window = position == window_size - 1
            plan.append(MicroStep(sync=closes_window, loss_divisor=window_size, step=closes_window))
    return plan


def planned_positions(plan, mode):
    """Where the plan puts the gradient syncs and the optimizer steps: micro-batch indices in the epoch."""
    return {
        "gradient_syncs": [index for index, micro_step in enumerate(plan) if mode == "every" or micro_step.sync],
        "optimizer_steps": [index for index, micro_step in enumerate(plan) if micro_step.step],
    }


def as_progressions(positions):
    """Sorted indices as arithmetic runs [start, stop, step] (stop exclusive, as in range()), each as long as
    it goes: every's 400 syncs of an epoch are [[0, 400, 1]], no_sync's 100 are [[3, 400, 4]]."""
    runs, index = [], 0
    while index < len(positions):
        start = positions[index]
        if index + 1 == len(positions):
            runs.append([start, start + 1, 1])
            break
        step, last = positions[index + 1] - start, index + 1
        if step <= 0:  # a position repeated (two steps after one micro-batch) or out of order: a run of its own
            runs.append([start, start + 1, 1])
            index += 1
            continue
        while last + 1 < len(positions) and positions[last + 1] - positions[last] == step:
            last += 1
        runs.append([start, positions[last] + 1, step])
        index = last + 1
    return runs


def from_progressions(runs):
    return [position for start, stop, step in runs for position in range(start, stop, step)]


def runs_of(values):
    """Consecutive equal values as [value, count] pairs."""
    runs = []
    for value in values:
        if runs and runs[-1][0] == value:
            runs[-1][1] += 1
        else:
            runs.append([value, 1])
    return runs


def from_runs(runs):  # runs_of's inverse
    return [value for value, count in runs for _ in range(count)]


def window_indices(plan):
    """The micro-batch indices of each window of the plan."""
    ends = [index + 1 for index, micro_step in enumerate(plan) if micro_step.step]
    return [list(range(start, end)) for start, end in zip([0, *ends], ends)]


def micro_batch_sizes(config):
    """The samples each micro-batch of a rank's epoch holds: the loader's batches over the rank's padded shard
    (every rank's the same: DistributedSampler pads the shards equal)."""
    shard = math.ceil(config["train_size"] / config["world_size"])
    sizes = [config["batch_size"]] * (shard // config["batch_size"])
    return sizes + ([shard % config["batch_size"]] if shard % config["batch_size"] else [])


def sample_plan(plan, config):
    """The image task's divisors under --loss-normalization tokens (per sample, the default): in a window of
    unequal micro-batches (a short last one) each mean loss is divided by the window's samples over its own, the
    window's update the mean over its samples; equal ones keep the plan's divisor (the document's, bit for bit)."""
    if config.get("task") == "text" or config.get("loss_normalization", "tokens") != "tokens":
        return plan
    sizes, normalized = micro_batch_sizes(config), list(plan)
    for window in window_indices(plan):
        counts = [sizes[index] for index in window]
        if len(set(counts)) > 1:
            normalized[window[0] : window[-1] + 1] = [
                replace(plan[i], loss_divisor=sum(counts) / sizes[i]) for i in window
            ]
    return normalized


def micro_batches_per_rank(train_size, world_size, batch_size):
    """DistributedSampler(drop_last=False) pads the split to a multiple of world_size; the loader keeps a short one."""
    return math.ceil(math.ceil(train_size / world_size) / batch_size)


def split_sizes(source_size):
    """(train, validation) sizes of a train source: the last fifth of the permutation is validation."""
    validation_size = source_size // VALIDATION_FRACTION
    return source_size - validation_size, validation_size


# ----------------------------------------------------------------------------- expected communication


@dataclass(frozen=True)
class CommSizes:
    """What one synchronization moves, read off the model: its gradients (each tensor's bytes, in the order of
    the parameters) and its buffers."""

    gradient_tensor_bytes: tuple
    buffer_bytes: int
    buffer_dtype_groups: int
    fsdp_unit_numels: tuple = ()  # under --strategy fsdp: each unit's padded elements (fsdp.unit_numels)

    @property
    def gradient_bytes(self):
        return sum(self.gradient_tensor_bytes)

    def gradient_buckets(self, bucket_cap_mb, order="backward"):
        """How many buckets DDP makes of the gradients: it fills one bucket with tensors until it holds
        int(bucket_cap_mb MiB) bytes or more, then starts the next (with the cap given explicitly, the first
        bucket's cap is the same). Its rebuilt buckets take the gradients in the order the backward readies
        them, the parameters' reverse ("backward"); the buckets it starts with when it searches for unused
        parameters take them in the parameters' order ("forward")."""
        cap, buckets, filled = int(bucket_cap_mb * 1024 * 1024), 0, 0
        sizes = self.gradient_tensor_bytes if order == "forward" else reversed(self.gradient_tensor_bytes)
        for size in sizes:
            if filled == 0:
                buckets += 1
            filled += size
            if filled >= cap:
                filled = 0
        return buckets

    def sent_bytes(self, comm_hook):
        """The bytes one synchronization puts on the wire per rank with this hook."""
        return self.gradient_bytes // 4 * SENT_ELEMENT_BYTES[comm_hook]


def comm_sizes(model):
    gradients = [p for p in model.parameters() if p.requires_grad]
    if not all(p.is_floating_point() and p.element_size() == 4 for p in gradients):
        raise ValueError("the gradients are not all float32; sent_bytes would miscount")
    buffers = list(model.buffers())
    buffer_bytes = sum(b.numel() * b.element_size() for b in buffers)
    if buffer_bytes > BROADCAST_BUCKET_BYTES:
        raise ValueError("the buffers exceed one broadcast bucket; buffer_dtype_groups would undercount")
    return CommSizes(
        gradient_tensor_bytes=tuple(p.numel() * p.element_size() for p in gradients),
        buffer_bytes=buffer_bytes,
        # DDP's _broadcast_coalesced flattens the buffers into one tensor per dtype (float32 running stats,
        # int64 num_batches_tracked): one broadcast collective each.
        buffer_dtype_groups=len({b.dtype for b in buffers}),
    )


def buffer_syncs_in_epoch(plan, mode, first_epoch, wrapper_starts=()):
    """How often DDP (broadcast_buffers=True) broadcasts the BatchNorm buffers in one epoch.

    DDP broadcasts before a forward when the forward before it was a synchronized training forward, and
    before a new wrapper's first forward (the run's very first; and a resumed run's first, at the micro-batches
    `wrapper_starts` of this epoch). Under no_sync only the forward after a window's last micro-batch
    qualifies; an evaluation forward (no grad) never does, so each epoch after the first starts without one,
    and its validation pass adds one (its first forward follows the last, synchronized training forward).
    """
    starts = set(wrapper_starts) | ({0} if first_epoch else set())
    previous_synchronized, count = False, 0
    for index, micro_step in enumerate(plan):
        count += previous_synchronized or index in starts
        previous_synchronized = mode == "every" or micro_step.sync
    return count + previous_synchronized


def wrapper_lives(plan, mode, starts, epochs):
    """For each DDP wrapper of a run whose wrappers started at `starts`, (epoch, micro-batch) in order (the run's
    first at (1, 0), then each resume): the training forwards it ran, before the next start and within the run,
    and the offsets among them of its synchronized ones."""
    positions = [(epoch, index) for epoch in range(1, epochs + 1) for index in range(len(plan))]
    synchronized = {index for index, micro_step in enumerate(plan) if mode == "every" or micro_step.sync}
    for number, start in enumerate(starts):
        end = starts[number + 1] if number + 1 < len(starts) else (epochs + 1, 0)
        lived = [position for position in positions if start <= position < end]
        yield lived, [offset for offset, (_, index) in enumerate(lived) if index in synchronized]


def bucket_rebuilds(plan, mode, starts, epochs, initial_syncs=1):
    """{epoch: rebuilds}: a wrapper rebuilds its buckets once, at its first training forward after the last of
    its `initial_syncs` synchronized backwards made with the buckets it started with (one; two under a static
    graph, whose first backward records no order), if it lives to that forward."""
    rebuilds = {}
    for lived, syncs in wrapper_lives(plan, mode, starts, epochs):
        if len(syncs) >= initial_syncs and syncs[initial_syncs - 1] + 1 < len(lived):
            epoch = lived[syncs[initial_syncs - 1] + 1][0]
            rebuilds[epoch] = rebuilds.get(epoch, 0) + 1
    return rebuilds


def syncs_before_rebuild(plan, mode, starts, epochs, initial_syncs=1):
    """{epoch: syncs}: each wrapper's first `initial_syncs` synchronized backwards, made in one bucket."""
    counts = {}
    for lived, syncs in wrapper_lives(plan, mode, starts, epochs):
        for offset in syncs[:initial_syncs]:
            counts[lived[offset][0]] = counts.get(lived[offset][0], 0) + 1
    return counts


def bucket_rebuild_epoch(plan, mode):
    """The epoch of DDP's bucket rebuild in a run that never stopped: at the first training forward after the
    first synchronized one, which falls in epoch 2 when epoch 1 has no training forward after its first sync."""
    (epoch,) = bucket_rebuilds(plan, mode, [(1, 0)], epochs=2)
    return epoch


def epoch_plan(config):
    """The window plan every epoch of a run with this configuration executes (the image task's divisors)."""
    micro_batches = micro_batches_per_rank(config["train_size"], config["world_size"], config["batch_size"])
    return sample_plan(window_plan(micro_batches, config["accum_steps"], config["partial_window"]), config)


def ddp_settings(config):
    """A run's DDP settings and gradient hook (a run recorded before an option existed ran with its default)."""
    return {name: config.get(name, default) for name, default in DDP_DEFAULTS.items()}


def expected_epoch_counts(config, mode, epoch, sizes, starts=((1, 0),)):
    """The exact per-rank counts of one epoch (1-based) of a run with this configuration whose DDP wrappers
    started at `starts` ((epoch, micro-batch), in order: (1, 0), then each resume).

    What DDP's settings change (torch 2.8's DistributedDataParallel and Reducer): a wrapper that does not search
    for unused parameters all-reduces its first sync in one bucket (a static graph its first two: its first
    backward records no order), then rebuilds its buckets by the cap; one that searches keeps the cap's buckets,
    filled in the parameters' order, from the start and never rebuilds, but all-reduces its map of the
    parameters that got gradients at every sync (a static graph does so at its first). Without
    broadcast_buffers DDP broadcasts no buffer; train.py's evaluation broadcasts rank 0's once, before the
    validation pass, so that every rank evaluates the model rank 0 saves. tests/test_comm_audit.py holds each
    rule against the profiler's record of the collectives.
    """
    plan = epoch_plan(config)
    settings = ddp_settings(config)
    gradient_syncs = len(plan) if mode == "every" else sum(m.sync for m in plan)
    wrapper_starts = [index for start_epoch, index in starts if start_epoch == epoch]
    buffer_syncs = (
        buffer_syncs_in_epoch(plan, mode, first_epoch=False, wrapper_starts=wrapper_starts)
        if settings["broadcast_buffers"]
        else 1
    )
    searches = settings["find_unused_parameters"] and not settings["static_graph"]
    initial = 2 if settings["static_graph"] else 1
    run = (plan, mode, list(starts), config["epochs"])
    if searches:
        buckets, one_bucket, rebuilds = sizes.gradient_buckets(settings["bucket_cap_mb"], "forward"), 0, 0
        used_maps = gradient_syncs
    else:
        buckets = sizes.gradient_buckets(settings["bucket_cap_mb"])
        one_bucket = syncs_before_rebuild(*run, initial).get(epoch, 0)
        rebuilds = bucket_rebuilds(*run, initial).get(epoch, 0)
        # A static graph all-reduces its used-parameter map once: at each wrapper's first sync.
        used_maps = syncs_before_rebuild(*run).get(epoch, 0) if settings["static_graph"] else 0
    return {
        "optimizer_steps": sum(m.step for m in plan),
        "gradient_syncs": gradient_syncs,
        "sync_bucket_calls": one_bucket + (gradient_syncs - one_bucket) * buckets,
        "allreduce_bytes": gradient_syncs * sizes.sent_bytes(settings["comm_hook"]),
        "buffer_broadcast_collectives": buffer_syncs * sizes.buffer_dtype_groups,
        "broadcast_bytes": buffer_syncs * sizes.buffer_bytes,
        "rebuild_broadcast_collectives": REBUILD_BROADCASTS * rebuilds,
        "used_map_allreduces": used_maps,
        # audit/checklist.py's SUM all-reduce of the ranks' local projections, one per optimizer step.
        "witness_allreduces": sum(m.step for m in plan),
        **dict.fromkeys(FSDP_COUNTS, 0),
    }
