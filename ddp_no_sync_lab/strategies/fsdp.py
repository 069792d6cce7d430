"""FSDP2 beside DDP (train.py --strategy fsdp, docs/fsdp.md): the CNN under fully_shard, no_sync's sharded
counterpart, FSDP's collectives counted from the calls themselves, its reduction made the mean, and the exact
counts a configuration implies.

    the units      each convolution its own unit (99.3 % of the parameters: one layer gathered at a time), the root
                   holding BatchNorm's and the classifier's (3,850 parameters, kept gathered from its forward to
                   its backward, as FSDP does for the root)
    the layout     contiguous (NCHW) parameters and images: torch 2.8's fully_shard refuses channels_last ones
    no_sync        set_requires_gradient_sync(False) around the window's first forwards and backwards: no
                   reduce-scatter, each unit's gradient kept unsharded on every rank until the window's last one
    the reduction  torch 2.8 hands ReduceOp.AVG to gloo's reduce-scatter, which sums (pytorch/pytorch#162338):
                   every unit reduces with SUM and divides by the world size itself (set_force_sum_reduction_for_comms),
                   and the checklist's average witness holds the result to the mean of the ranks' own gradients
    the buffers    FSDP broadcasts none: evaluation and model.pt use rank 0's, broadcast once per evaluation, counted
    the start      rank 0's weights and buffers broadcast before fully_shard, as DDP's constructor does (not counted:
                   nor is DDP's)
"""

import argparse
import math
import threading
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ddp_no_sync_lab import experiment
from ddp_no_sync_lab.audit import instruments
from ddp_no_sync_lab.cli import LabError
from ddp_no_sync_lab.options import TrainOptions

# What --strategy fsdp has no counterpart for, refused by name: (option, its value under DDP's defaults, why).
DDP_ONLY = (
    ("comm_hook", "allreduce", "--comm-hook is DDP's gradient hook"),
    (
        "bucket_cap_mb",
        experiment.BUCKET_CAP_MB,
        "--bucket-cap-mb sizes DDP's buckets (FSDP reduces one unit at a time)",
    ),
    ("broadcast_buffers", True, "--no-broadcast-buffers is DDP's (FSDP never broadcasts buffers)"),
    ("static_graph", False, "--static-graph is DDP's"),
    ("find_unused_parameters", False, "--find-unused-parameters is DDP's"),
    ("gradient_as_bucket_view", False, "--gradient-as-bucket-view is DDP's"),
)
NOT_YET = (
    ("task", "cifar10", "--task {task}"),  # the text task, or a task of your own
    ("resume", False, "--resume"),
    ("checkpoint_every_windows", None, "--checkpoint-every-windows"),
    ("activation_checkpointing", False, "--activation-checkpointing"),
)


def fsdp_in_range(parser: argparse.ArgumentParser, options: TrainOptions) -> TrainOptions:
    """train.py's options that --strategy fsdp cannot take, refused at parse time with one line each."""
    if options.strategy != "fsdp":
        return options
    for name, default, why in DDP_ONLY:
        if getattr(options, name) != default:
            parser.error(f"argument --strategy fsdp: {why}; drop it, or run --strategy ddp")
    for name, default, option in NOT_YET:
        if getattr(options, name) != default:
            option = option.format(task=options.task)
            parser.error(f"argument --strategy fsdp: {option} runs under --strategy ddp only (docs/fsdp.md); drop it")
    return options


def units(model):
    """The modules fully_shard makes units of, before the root: the convolutions."""
    return [module for module in model.modules() if isinstance(module, nn.Conv2d)]


def padded_numel(parameter, world_size):
    """FSDP pads each parameter's first dimension to a multiple of the world size, one equal shard per rank."""
    rows = parameter.shape[0]
    return math.ceil(rows / world_size) * world_size * (parameter.numel() // rows)


def unit_numels(model, world_size):
    """The padded elements of each unit (the convolutions', then the root's: every parameter left)."""
    inner = [sum(padded_numel(p, world_size) for p in unit.parameters()) for unit in units(model)]
    in_units = {id(p) for unit in units(model) for p in unit.parameters()}
    root = sum(padded_numel(p, world_size) for p in model.parameters() if id(p) not in in_units)
    return (*inner, root)


def gathered_bytes(numels, world_size):
    """The bytes each rank hands to the all-gathers of one training micro-batch: every unit's shard in the forward,
    all but the root's again in the backward."""
    shard_bytes = [numel // world_size * 4 for numel in numels]
    return 2 * sum(shard_bytes) - shard_bytes[-1]


def eval_batches(size, batch_size, world_size):
    """Each rank's evaluation batches (loaders.rank_share: every world_size-th sample), or None where the ranks'
    counts differ (FSDP's all-gathers need every rank in every forward)."""
    counts = {math.ceil(len(range(rank, size, world_size)) / batch_size) for rank in range(world_size)}
    return counts.pop() if len(counts) == 1 else None


def check_split(config):
    for name in ("validation_size", "test_size"):
        if eval_batches(config[name], config["batch_size"], config["world_size"]) is None:
            raise LabError(
                f"--strategy fsdp: the {config[name]} {name.split('_')[0]} samples give the {config['world_size']} "
                f"ranks unequal numbers of batches of {config['batch_size']}, and every rank must join each forward's "
                f"all-gathers; choose --batch-size so that they are equal, or run --strategy ddp"
            )


def epoch_counts(config):
    """The function that gives a run's exact counts per epoch, by its strategy."""
    return expected_epoch_counts if config.get("strategy") == "fsdp" else experiment.expected_epoch_counts


def expected_epoch_counts(config, mode, epoch, sizes, starts=((1, 0),)):
    """The exact per-rank counts of one epoch of an fsdp run (tests/test_sharded.py holds them to the calls).

    U units, each pass begun sharded (ShardedModel.train and eval): a training forward gathers all U; its backward
    gathers the U - 1 others again (resharded after the forward) and, where it synchronizes, reduce-scatters all
    U. Validation gathers the root once (FSDP keeps the root gathered after a forward) and the others at every
    batch. Rank 0's buffers are broadcast once, before validation.
    """
    world_size = config["world_size"]
    numels = sizes.fsdp_unit_numels
    shard_bytes = [numel // world_size * 4 for numel in numels]
    plan = experiment.epoch_plan(config)
    syncs = len(plan) if mode == "every" else sum(m.sync for m in plan)
    validation = eval_batches(config["validation_size"], config["batch_size"], world_size)
    all_gathers = len(plan) * (2 * len(numels) - 1) + (len(numels) - 1) * validation + 1
    gathered = len(plan) * gathered_bytes(numels, world_size)
    return {
        "optimizer_steps": sum(m.step for m in plan),
        "gradient_syncs": syncs,
        "sync_bucket_calls": 0,
        "allreduce_bytes": 0,
        "buffer_broadcast_collectives": sizes.buffer_dtype_groups,
        "broadcast_bytes": sizes.buffer_bytes,
        "rebuild_broadcast_collectives": 0,
        "used_map_allreduces": 0,
        "witness_allreduces": sum(m.step for m in plan),
        "all_gathers": all_gathers,
        "all_gather_bytes": gathered + validation * sum(shard_bytes[:-1]) + shard_bytes[-1],
        "reduce_scatters": syncs * len(numels),
        "reduce_scatter_bytes": syncs * sum(numels) * 4,
    }


# ----------------------------------------------------------------------------- FSDP's collectives, counted


# FSDP2's entry points into torch.distributed, by kind: torch 2.8 calls the first of each, newer ones the second.
ENTRY_POINTS = {
    "all_gather": ("all_gather_into_tensor", "all_gather_single"),
    "reduce_scatter": ("reduce_scatter_tensor", "reduce_scatter_single"),
}


class CollectiveCounter:
    """FSDP's all-gathers and reduce-scatters, read from the calls themselves: FSDP calls torch.distributed's
    collectives through the package at call time, and no hook of FSDP's sees them. Installed once per process;
    counts into the audit each owner gave last (the lab's run, the watcher's); a call made inside another counted
    one is not counted again."""

    def __init__(self):
        self.audits, self.depth = {}, threading.local()
        for kind, names in ENTRY_POINTS.items():
            for name in names:
                if hasattr(dist, name):
                    setattr(dist, name, self.counted(kind, getattr(dist, name)))

    def counted(self, kind, collective):
        def call(*args, **kwargs):
            audits = list(self.audits.values()) if getattr(self.depth, "value", 0) == 0 else []
            handed = kwargs.get("input_tensor", kwargs.get("input", args[1] if len(args) > 1 else None))
            for audit in audits:
                self.count(audit, kind, handed)
            started = [(audit, audit.clock.start()) for audit in audits]
            self.depth.value = getattr(self.depth, "value", 0) + 1
            try:
                result = collective(*args, **kwargs)
            finally:
                self.depth.value -= 1
            clocked = "sync" if kind == "reduce_scatter" else "all_gather"  # a reduce-scatter is FSDP's sync

            def stop(_=None):
                for audit, start in started:
                    audit.clock.stop(start, clocked)

            if started and kwargs.get("async_op"):  # timed to its completion, not its launch
                result.get_future().then(stop)
            else:
                stop()
            return result

        return call

    @staticmethod
    def count(audit, kind, handed):
        size = handed.numel() * handed.element_size()
        if kind == "all_gather":
            audit.all_gathers += 1
            audit.all_gather_bytes += size
            return
        if audit.awaiting_sync:  # a backward synchronized at its first reduce-scatter (the witness reads it)
            audit.awaiting_sync = False
            audit.count_sync()
        audit.reduce_scatters += 1
        audit.reduce_scatter_bytes += size
        audit.wire_dtype = handed.dtype


COUNTER = None


def param_groups(root):
    """The FSDP parameter groups of `root`'s units (the root's own among them where it holds parameters)."""
    states = (module._get_fsdp_state() for module in root.modules() if hasattr(module, "_get_fsdp_state"))
    return [state._fsdp_param_group for state in states if state._fsdp_param_group is not None]


def unsharded_parameters(root):
    """{sharded parameter's id: the unsharded parameter the forward computes with}, once FSDP made them."""
    return {
        id(fsdp_param.sharded_param): fsdp_param._unsharded_param
        for group in param_groups(root)
        for fsdp_param in group.fsdp_params
        if hasattr(fsdp_param, "_unsharded_param")
    }


def counting_into(comm_audit, owner="lab"):
    """FSDP's collectives in this process counted into `comm_audit` from here on, in place of the audit `owner`
    gave before (the counter installed once)."""
    global COUNTER
    COUNTER = COUNTER or CollectiveCounter()
    COUNTER.audits[owner] = comm_audit


# ----------------------------------------------------------------------------- the model under fully_shard


class ShardedModel:
    """What train.py asks of its DDP wrapper, for a model under fully_shard: its call, no_sync(), train/eval,
    its parameters, rank 0's buffers broadcast on request, the audit, and the whole model gathered for model.pt."""

    broadcast_buffers = False  # FSDP broadcasts none: train.evaluate broadcasts rank 0's, as for DDP without it

    def __init__(self, module, comm_audit, group):
        self.module, self.comm_audit, self.group = module, comm_audit, group

    def __call__(self, inputs):
        if self.module.training and torch.is_grad_enabled():
            self.comm_audit.awaiting_sync = True
        return self.module(inputs)

    @contextmanager
    def no_sync(self):
        """FSDP's no_sync (its documented equivalent): no reduce-scatter in a backward run inside."""
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)

    def parameters(self):
        return self.module.parameters()

    def train(self):
        self.module.reshard()  # every pass starts sharded, the root too (a forward without backward keeps it)
        self.module.train()
        self.comm_audit.clock.per_call = True

    def eval(self):
        self.module.reshard()
        self.module.eval()
        self.comm_audit.clock.per_call = False  # evaluation's all-gathers are not the training's

    def broadcast_rank_0_buffers(self):
        """One broadcast per dtype of every buffer (DDP's own coalescing), counted as AuditedDDP counts DDP's."""
        buffers = list(self.module.buffers())
        started = self.comm_audit.clock.start()
        group = self.group or dist.distributed_c10d._get_default_group()
        dist._broadcast_coalesced(group, buffers, experiment.BROADCAST_BUCKET_BYTES, 0)
        self.comm_audit.clock.stop(started)
        self.comm_audit.buffer_broadcast_collectives += len({buffer.dtype for buffer in buffers})
        self.comm_audit.broadcast_bytes += sum(buffer.numel() * buffer.element_size() for buffer in buffers)

    def unsharded_parameters(self):
        return unsharded_parameters(self.module)

    def full_state_dict(self):
        """The whole model's state, gathered on every rank (a collective: every rank calls it), as plain tensors:
        model.pt loads into the document's CifarCNN."""
        return {
            name: value.full_tensor() if isinstance(value, DTensor) else value
            for name, value in self.module.state_dict().items()
        }


def wrap_sharded(model, device, world_size, group, config):
    """The model under fully_shard (its units, then the root), no_sync's counterpart and the counted collectives."""
    check_split(config)
    model = model.to(memory_format=torch.contiguous_format)
    process_group = group or dist.distributed_c10d._get_default_group()
    # Every rank starts from rank 0's weights, as DDP's constructor makes it: each rank drew its own (seed + rank),
    # and fully_shard would keep each rank's slice of its own draw, a mix that no seed names.
    dist._broadcast_coalesced(process_group, list(model.state_dict().values()), experiment.BROADCAST_BUCKET_BYTES, 0)
    # Imported here: torch.distributed.fsdp imports torch._dynamo, about 0.8 s a process that a ddp run spares.
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(process_group, device.type)
    for unit in units(model):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # Each unit reduces with SUM and divides by the world size itself (tests/inject: LAB_TEST_FSDP_UNCORRECTED).
    for module in model.modules():
        if hasattr(module, "set_force_sum_reduction_for_comms"):
            module.set_force_sum_reduction_for_comms(True)
    comm_audit = instruments.CommAudit(world_size, group, clock=instruments.CollectiveClock(device.type))
    counting_into(comm_audit)
    return ShardedModel(model, comm_audit, group), comm_audit
