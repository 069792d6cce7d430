"""For tests/test_packed.py, under torchrun (2 ranks, gloo, CPU): alone, or in the session's one start of
conftest.SHARED_WORKERS (tests/workers/several_workers.py).

The text task's proof: with the lab's own loop (train.train_epoch, train.wrap_model) and its per-token divisors
(packed.loss_plan), `every` and `no_sync` make the same updates as one process that takes each window's rows of
both ranks and divides the window's summed token losses by the window's target tokens, written out here
independently of the lab's plan. The rows are real packed rows of the corpus, chosen so that they hold unequal
numbers of target tokens (the short rows at documents' ends beside full ones), in micro-batches of 4 rows with a
short last micro-batch and a short last window. Prints (rank 0) one JSON object: per precision and variant the
relative differences from the reference after each step; in float64 also `micro-batch` normalization (the bias)
and a broken per-rank normalization (each rank's own window tokens), which must differ.
"""

import json
from contextlib import nullcontext
from functools import partial
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.nn import functional as F

import train
from ddp_no_sync_lab import cli, experiment
from ddp_no_sync_lab.audit import face, instruments
from ddp_no_sync_lab.precision import choose_precision
from ddp_no_sync_lab.tasks import packed
from ddp_no_sync_lab.tasks.language import ByteTransformer, TokenCrossEntropy
from equivalence import compare, new_optimizer, recorder  # the image proof's, beside this one

BATCH, ACCUM, SEED, SHORT_ROWS, FULL_ROWS = 4, 4, 47, 20, 16
CPU = torch.device("cpu")


def unequal_rows():
    """36 rows of the packed train part: 20 that end a document (fewer target tokens) and 16 full ones."""
    source = packed.load_corpus()
    train_part = packed.make_split(source, SEED, 0, 1).parts["train"]
    tokens = train_part.tokens
    short = (tokens < packed.ROW_LENGTH).nonzero().flatten()[:SHORT_ROWS]
    full = (tokens == packed.ROW_LENGTH).nonzero().flatten()[:FULL_ROWS]
    chosen = torch.cat([short, full])
    return packed.PackedRows(train_part.inputs[chosen], train_part.targets[chosen])


def new_model(initial_state, dtype):
    model = ByteTransformer().to(dtype)
    model.load_state_dict(initial_state)
    return model


def ddp_run(initial_state, rows, normalization, mode, rank, world_size, dtype, autocast, broken=None):
    model = new_model(initial_state, dtype)
    ddp_model, comm_audit = train.wrap_model(model, CPU, world_size)
    optimizer, criterion = new_optimizer(ddp_model), TokenCrossEntropy()
    record = recorder(ddp_model, optimizer)
    sampler = packed.train_sampler(len(rows.inputs), SEED, rank, world_size)
    loader = packed.RowLoader(rows, sampler, BATCH, CPU)
    plan = experiment.window_plan(len(loader), ACCUM, "scale")
    split = SimpleNamespace(parts={"train": rows})
    args = SimpleNamespace(loss_normalization=normalization, seed=SEED, batch_size=BATCH)
    place = SimpleNamespace(rank=rank, world_size=world_size)
    plan = broken(plan, rows, rank, world_size) if broken else packed.loss_plan(plan, split, args, place, 0)
    progress = cli.Progress(enabled=False, interval=0)
    audit = face.attach(ddp_model, optimizer, criterion, comm_audit, CPU)
    train.train_epoch(ddp_model, audit, loader, plan, mode, optimizer, criterion, CPU, autocast, progress)
    record["gradient_syncs"] = comm_audit.gradient_syncs
    gathered = [torch.empty_like(record["params"][-1]) for _ in range(world_size)]
    dist.all_gather(gathered, record["params"][-1])
    record["ranks_agree"] = all(torch.equal(gathered[0], other) for other in gathered[1:])
    return record


def per_rank_tokens(plan, rows, rank, world_size):
    """Broken on purpose: each rank divides by its own window's tokens (DDP then averages the ranks' means)."""
    own = packed.rank_micro_batch_tokens(rows.tokens, SEED, 0, rank, world_size, BATCH)
    divisors, window = [], []
    for index, micro_step in enumerate(plan):
        window.append(index)
        if micro_step.step:
            divisors += [sum(own[i] for i in window) / own[i] for i in window]
            window = []
    return [
        micro_step.__class__(micro_step.sync, divisor, micro_step.step) for micro_step, divisor in zip(plan, divisors)
    ]


def reference_run(initial_state, rows, world_size, dtype, autocast):
    """One process: each window's rows of every rank (their sampler orders, read here), the window's summed
    token cross-entropy divided by its target tokens, one step per window."""
    model = new_model(initial_state, dtype)
    optimizer = new_optimizer(model)
    record = recorder(model, optimizer)
    orders = []
    for rank in range(world_size):
        sampler = packed.train_sampler(len(rows.inputs), SEED, rank, world_size)
        orders.append([list(sampler)[start : start + BATCH] for start in range(0, len(sampler), BATCH)])
    micro_batches = len(orders[0])
    for window_start in range(0, micro_batches, ACCUM):
        window = [order[i] for order in orders for i in range(window_start, min(window_start + ACCUM, micro_batches))]
        targets_seen = sum(int(rows.targets[batch].ne(experiment.IGNORE_INDEX).sum()) for batch in window)
        for batch in window:
            with autocast():
                logits = model(rows.inputs[batch])
                loss = F.cross_entropy(logits.flatten(0, -2), rows.targets[batch].flatten(), reduction="sum")
            (loss / targets_seen).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return record


def main():
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(SEED)
    initial_state = ByteTransformer().state_dict()
    rows = unequal_rows()
    bfloat16 = partial(choose_precision("bf16", CPU).autocast, "cpu")
    results = {"row_tokens": rows.tokens.tolist()}
    for name, dtype, autocast in (
        ("float64", torch.float64, nullcontext),
        ("bfloat16_autocast", torch.float32, bfloat16),
    ):
        reference = reference_run(initial_state, rows, world_size, dtype, autocast)
        variants = {"every": ("tokens", "every", None), "no_sync": ("tokens", "no_sync", None)}
        if name == "float64":
            variants["micro_batch_normalization"] = ("micro-batch", "no_sync", None)
            variants["broken_per_rank_tokens"] = ("tokens", "no_sync", per_rank_tokens)
        results[name] = {
            variant: compare(
                ddp_run(initial_state, rows, norm, mode, rank, world_size, dtype, autocast, broken), reference
            )
            for variant, (norm, mode, broken) in variants.items()
        }
    if rank == 0:
        print(json.dumps(results), flush=True)
    instruments.settle_comm_hooks()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
