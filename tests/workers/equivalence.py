"""For tests/test_equivalence.py, under torchrun (2 ranks, gloo, CPU): alone, or in the session's one start of
conftest.SHARED_WORKERS (tests/workers/several_workers.py).

Trains a few optimizer steps with the lab's own loop (train.train_epoch, train.wrap_model: DDP with the
counting hook) in `every` and `no_sync` mode, and in one process that runs both ranks' micro-batches in order
and accumulates their gradients by hand, its windows and divisors written out here independently of
experiment.window_plan. It records the synchronized gradients before each optimizer step and the parameters after
it, and prints (rank 0) one JSON object: per precision, case and variant, the relative differences from the
hand-made reference after each step. In float32 it also compares each mode with a reference that sums in
that mode's order; in float64 it also runs broken plans (no_sync on the wrong micro-batch, losses not
divided, a step inside the window, a short window divided by accum_steps), which must differ. Under BF16
autocast on float32 weights (precision.py's bf16) it runs the full windows with the broken plans too. Every
precision runs on 8x8 images, a sixteenth of CIFAR's compute (BF16 is emulated, 13x slower than float32, on CPUs
without BF16 instructions): what they check does not depend on the image size (the CNN ends in a global average).
"""

import json
from contextlib import nullcontext
from dataclasses import replace
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import train
from ddp_no_sync_lab import cli, experiment
from ddp_no_sync_lab.audit import face, instruments
from ddp_no_sync_lab.precision import choose_precision
from ddp_no_sync_lab.strategies import fsdp
from model import MEMORY_FORMAT, CifarCNN

BATCH, ACCUM, SEED = 8, 4, 47
IMAGE_SIZE = 8
CPU = torch.device("cpu")


def dataset(micro_batches, world_size, dtype, short=0):
    """micro_batches of BATCH images per rank; with `short` the last holds that many fewer."""
    generator = torch.Generator().manual_seed(0)
    count = (micro_batches * BATCH - short) * world_size
    inputs = torch.randn(count, 3, IMAGE_SIZE, IMAGE_SIZE, generator=generator, dtype=dtype)
    return TensorDataset(inputs, torch.randint(0, 10, (count,), generator=generator))


def sampler(data, rank, world_size):
    return DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=True, seed=SEED, drop_last=False)


def new_optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)


def flat(tensors):
    return torch.cat([t.detach().reshape(-1).clone() for t in tensors])


def recorder(model, optimizer):
    """Gradients just before each optimizer step (after DDP's synchronization), parameters just after."""
    record = {"grads": [], "params": []}
    optimizer.register_step_pre_hook(lambda *_: record["grads"].append(flat(p.grad for p in model.parameters())))
    optimizer.register_step_post_hook(lambda *_: record["params"].append(flat(model.parameters())))
    return record


def new_model(initial_state, dtype):
    model = CifarCNN().to(dtype, memory_format=MEMORY_FORMAT)  # as train.py holds it
    model.load_state_dict(initial_state)
    return model


def ddp_run(initial_state, data, plan, mode, rank, world_size, dtype, autocast):
    model = new_model(initial_state, dtype)
    ddp_model, comm_audit = train.wrap_model(model, CPU, world_size)
    optimizer, criterion = new_optimizer(ddp_model), nn.CrossEntropyLoss()
    record = recorder(ddp_model, optimizer)
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler(data, rank, world_size))
    progress = cli.Progress(enabled=False, interval=0)
    audit = face.attach(ddp_model, optimizer, criterion, comm_audit, CPU)
    train.train_epoch(ddp_model, audit, loader, plan, mode, optimizer, criterion, CPU, autocast, progress)
    record["gradient_syncs"] = comm_audit.gradient_syncs
    # Every rank's parameters after each step, to check that the replicas agree.
    gathered = [torch.empty_like(record["params"][-1]) for _ in range(world_size)]
    dist.all_gather(gathered, record["params"][-1])
    record["ranks_agree"] = all(torch.equal(gathered[0], other) for other in gathered[1:])
    return record


def fsdp_run(initial_state, data, plan, mode, rank, world_size, dtype, autocast, corrected=True):
    """The lab's loop under --strategy fsdp (fsdp.wrap_sharded); the whole gradients and parameters gathered at
    each step. Each rank draws its own initial weights (as train.py seeds seed + rank), rank 0 the reference's:
    wrap_sharded must start every rank from rank 0's. corrected=False: FSDP's own reduction, the lab's correction
    undone."""
    with torch.random.fork_rng():
        torch.manual_seed(SEED + 1 + rank)
        model = CifarCNN().to(dtype)
    if rank == 0:
        model.load_state_dict(initial_state)
    config = {"validation_size": world_size, "test_size": world_size, "batch_size": BATCH, "world_size": world_size}
    fsdp_model, counted = fsdp.wrap_sharded(model, CPU, world_size, None, config)
    for module in fsdp_model.module.modules() if not corrected else ():
        if hasattr(module, "set_force_sum_reduction_for_comms"):
            module.set_force_sum_reduction_for_comms(False)
    optimizer, criterion = new_optimizer(fsdp_model), nn.CrossEntropyLoss()
    record = {"grads": [], "params": []}
    whole = lambda tensors: torch.cat([t.full_tensor().reshape(-1) for t in tensors])  # noqa: E731
    optimizer.register_step_pre_hook(lambda *_: record["grads"].append(whole(p.grad for p in model.parameters())))
    optimizer.register_step_post_hook(lambda *_: record["params"].append(whole(p.detach() for p in model.parameters())))
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler(data, rank, world_size))
    progress = cli.Progress(enabled=False, interval=0)
    audit = face.attach(fsdp_model, optimizer, criterion, counted, CPU)
    train.train_epoch(fsdp_model, audit, loader, plan, mode, optimizer, criterion, CPU, autocast, progress)
    record["gradient_syncs"], record["ranks_agree"] = counted.gradient_syncs, True  # one model, gathered
    record["reduce_scatters"] = counted.reduce_scatters
    return record


def nanogpt_idiom_run(initial_state, data, rank, world_size, dtype):
    """nanoGPT's form of no_sync, written out: `require_backward_grad_sync` set before each micro-batch's forward
    (true on the window's last only), no context manager; the lab's DDP with its counting hook."""
    ddp_model, audit = train.wrap_model(new_model(initial_state, dtype), CPU, world_size)
    optimizer = new_optimizer(ddp_model)
    record = recorder(ddp_model, optimizer)
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler(data, rank, world_size))
    ddp_model.train()
    for index, (inputs, targets) in enumerate(loader):
        ddp_model.require_backward_grad_sync = (index + 1) % ACCUM == 0
        loss = nn.functional.cross_entropy(ddp_model(train.to_device(inputs, CPU)), targets) / ACCUM
        loss.backward()
        if (index + 1) % ACCUM == 0:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    record["gradient_syncs"], record["ranks_agree"] = audit.gradient_syncs, True  # compared with no_sync's below
    return record


def reference_run(initial_state, data, world_size, dtype, summation, autocast, per_sample=False):
    """One process, by hand: each window's micro-batches of every rank, the mean over the window and over the
    ranks as the gradient, one optimizer step per window (the last window may be short).

    summation sets only the order of the floating-point sums:
      "one_sum": every micro-batch's loss / (window length x world size) backpropagated into one .grad (per_sample:
               its mean loss x its samples / the window's samples over every rank, the window's mean per sample);
      "every":   each rank adds its micro-batch's gradient to the window's running sum, then the ranks'
                 sums are averaged, after every micro-batch (what DDP does when every backward syncs);
      "no_sync": each rank sums its own window, then the ranks' sums are averaged once (no_sync's order).
    """
    model = new_model(initial_state, dtype)
    model.train()
    parameters = list(model.parameters())
    optimizer = new_optimizer(model)
    record = recorder(model, optimizer)
    criterion = nn.CrossEntropyLoss()
    rank_batches = []
    for rank in range(world_size):
        indices = list(sampler(data, rank, world_size))
        rank_batches.append([indices[start : start + BATCH] for start in range(0, len(indices), BATCH)])
    micro_batches = len(rank_batches[0])

    def gradient(rank, micro_batch, divisor):
        inputs, targets = data[rank_batches[rank][micro_batch]]
        inputs = inputs.contiguous(memory_format=MEMORY_FORMAT)  # as train.train_epoch passes them
        with autocast():
            loss = criterion(model(inputs), targets)
        return torch.autograd.grad(loss / divisor, parameters)

    def average(rank_sums):  # the counting hook: each rank's buffer divided by world size, then summed
        return [sum(rank_sums[rank][i] / world_size for rank in range(world_size)) for i in range(len(parameters))]

    for window_start in range(0, micro_batches, ACCUM):
        window = range(window_start, min(window_start + ACCUM, micro_batches))
        if summation == "one_sum":
            for micro_batch in window:
                for rank in range(world_size):
                    divisor = len(window) * world_size
                    if per_sample:
                        samples = [len(rank_batches[rank][index]) for index in window]
                        divisor = world_size * sum(samples) / len(rank_batches[rank][micro_batch])
                    for parameter, part in zip(parameters, gradient(rank, micro_batch, divisor)):
                        parameter.grad = part if parameter.grad is None else parameter.grad + part
        elif summation == "every":
            synchronized = None
            for micro_batch in window:
                rank_sums = [gradient(rank, micro_batch, len(window)) for rank in range(world_size)]
                if synchronized is not None:
                    rank_sums = [[a + b for a, b in zip(synchronized, parts)] for parts in rank_sums]
                synchronized = average(rank_sums)
            for parameter, value in zip(parameters, synchronized):
                parameter.grad = value
        else:
            rank_sums = []
            for rank in range(world_size):
                parts = [gradient(rank, micro_batch, len(window)) for micro_batch in window]
                rank_sums.append([sum(column[1:], column[0]) for column in zip(*parts)])
            for parameter, value in zip(parameters, average(rank_sums)):
                parameter.grad = value
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    record["ranks_agree"], record["gradient_syncs"] = True, None
    return record


def relative(a, b):
    return ((a - b).norm() / b.norm()).item()


def compare(record, reference):
    """Per step: |difference| / |reference| (L2 norms) of the synchronized gradients and of the parameters."""
    steps = range(min(len(record["params"]), len(reference["params"])))
    return {
        "steps": len(record["params"]),
        "reference_steps": len(reference["params"]),
        "grad_relative": [relative(record["grads"][i], reference["grads"][i]) for i in steps],
        "param_relative": [relative(record["params"][i], reference["params"][i]) for i in steps],
        "ranks_agree": record["ranks_agree"],
        "gradient_syncs": record["gradient_syncs"],
    }


def hook_keeps_ddp_averaging(initial_state, data, rank, world_size, dtype):
    """One backward through plain DDP (its built-in averaging all-reduce) and through the lab's DDP with the
    counting hook: the synchronized gradients must be identical."""
    inputs, targets = data[list(sampler(data, rank, world_size))[:BATCH]]
    gradients = []
    for wrap in (
        lambda m: DDP(m, bucket_cap_mb=experiment.BUCKET_CAP_MB),
        lambda m: train.wrap_model(m, CPU, world_size)[0],
    ):
        ddp_model = wrap(new_model(initial_state, dtype))
        nn.functional.cross_entropy(ddp_model(inputs), targets).backward()
        gradients.append(flat(p.grad for p in ddp_model.parameters()))
    return (gradients[0] - gradients[1]).abs().max().item()


def variants(plan, partial_window):
    """The real plan in both modes; in float64 also the broken plans the comparison must catch."""
    chosen = {"every": (plan, "every"), "no_sync": (plan, "no_sync")}
    if partial_window == "error":
        chosen["broken_no_sync_on_wrong_micro_batch"] = ([replace(m, sync=not m.sync) for m in plan], "no_sync")
        chosen["broken_loss_not_divided"] = ([replace(m, loss_divisor=1) for m in plan], "no_sync")
        chosen["broken_step_inside_window"] = ([replace(m, step=True) for m in plan], "no_sync")
    else:
        chosen["broken_short_window_divided_by_accum_steps"] = (
            [replace(m, loss_divisor=ACCUM) for m in plan],
            "no_sync",
        )
    return chosen


def main():
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(SEED)
    initial_state = CifarCNN().state_dict()  # the same on every rank (same seed)

    bfloat16_autocast = partial(choose_precision("bf16", CPU).autocast, "cpu")  # as train.py --precision bf16
    cases = (("full_windows", 12, "error"), ("partial_window", 14, "scale"))
    precisions = (
        ("float64", torch.float64, nullcontext, cases),
        ("float32", torch.float32, nullcontext, cases),  # as train.py --precision fp32
        ("bfloat16_autocast", torch.float32, bfloat16_autocast, cases[:1]),
    )
    results = {}
    full_windows = {}  # per precision: the full windows' data, plan, reference and each mode's record
    for name, dtype, autocast, precision_cases in precisions:
        hook_data = dataset(1, world_size, dtype)
        results[name] = {
            "hook_max_difference": hook_keeps_ddp_averaging(initial_state, hook_data, rank, world_size, dtype)
        }
        for case, micro_batches, partial_window in precision_cases:
            data = dataset(micro_batches, world_size, dtype)
            plan = experiment.window_plan(micro_batches, ACCUM, partial_window)
            reference = reference_run(initial_state, data, world_size, dtype, "one_sum", autocast)
            with_broken = name != "float32"
            chosen = (
                variants(plan, partial_window)
                if with_broken
                else {"every": (plan, "every"), "no_sync": (plan, "no_sync")}
            )
            results[name][case] = {}
            if case == "full_windows":
                full_windows[name] = (data, plan, reference, {})
            for variant, (variant_plan, mode) in chosen.items():
                record = ddp_run(initial_state, data, variant_plan, mode, rank, world_size, dtype, autocast)
                results[name][case][variant] = compare(record, reference)
                if case == "full_windows" and variant in experiment.MODES:
                    full_windows[name][3][variant] = record
                if variant in experiment.MODES and name == "float32":  # the same mean, summed in the mode's order
                    same_order = reference_run(initial_state, data, world_size, dtype, mode, autocast)
                    results[name][case][f"{variant}_vs_same_order"] = compare(record, same_order)
                if variant == "no_sync" and name == "float32" and case == "full_windows":
                    idiom = nanogpt_idiom_run(initial_state, data, rank, world_size, dtype)
                    results[name][case]["nanogpt_idiom_vs_no_sync"] = compare(idiom, record)
    # FSDP (--strategy fsdp) on the full windows: both modes against the same reference; in float32 against DDP in
    # the same mode, and FSDP's own reduction (the lab's correction undone).
    for name, dtype in (("float64", torch.float64), ("float32", torch.float32)):
        data, plan, reference, ddp_records = full_windows[name]
        fsdp_records = {
            mode: fsdp_run(initial_state, data, plan, mode, rank, world_size, dtype, nullcontext)
            for mode in experiment.MODES
        }
        results[name]["fsdp"] = {mode: compare(record, reference) for mode, record in fsdp_records.items()}
        for mode in experiment.MODES if name == "float32" else ():
            results[name]["fsdp"][f"{mode}_vs_ddp"] = compare(fsdp_records[mode], ddp_records[mode])
        if name == "float32":  # FSDP hands gloo ReduceOp.AVG for float32 and BF16 gradients (float64: SUM, divided)
            uncorrected = fsdp_run(initial_state, data, plan, "no_sync", rank, world_size, dtype, nullcontext, False)
            results[name]["fsdp"]["broken_uncorrected_reduction"] = compare(uncorrected, reference)
            ones, output = torch.ones(world_size), torch.empty(1)
            dist.reduce_scatter_tensor(output, ones, op=dist.ReduceOp.AVG)  # what this torch's gloo does with AVG
            results[name]["fsdp"]["gloo_average"] = "mean" if output.item() == 1 else "sum"
    # A short last micro-batch (half a batch): train.py's per-sample divisors (experiment.sample_plan) against one
    # process taking the window's mean per sample; the document's divisors (the window's length) are off.
    data = dataset(8, world_size, torch.float64, short=BATCH // 2)
    config = {"train_size": len(data), "world_size": world_size, "batch_size": BATCH, "accum_steps": ACCUM}
    plan = experiment.window_plan(8, ACCUM, "error")
    reference = reference_run(initial_state, data, world_size, torch.float64, "one_sum", nullcontext, per_sample=True)
    chosen = {mode: (experiment.sample_plan(plan, config), mode) for mode in experiment.MODES}
    chosen["broken_short_micro_batch_divided_by_window_length"] = (plan, "no_sync")
    results["float64"]["short_micro_batch"] = {
        variant: compare(
            ddp_run(initial_state, data, variant_plan, mode, rank, world_size, torch.float64, nullcontext), reference
        )
        for variant, (variant_plan, mode) in chosen.items()
    }
    if rank == 0:
        print(json.dumps(results), flush=True)
    instruments.settle_comm_hooks()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
