"""For tests/test_comm_audit.py, under torchrun (2 ranks, gloo, CPU): alone, or in the session's one start of
conftest.SHARED_WORKERS (tests/workers/several_workers.py).

Runs two epochs of the lab's loop and evaluation per DDP setting (the documented one, then each of train.py's
levers alone) and mode under the PyTorch profiler and prints (rank 0) one JSON object: per setting, mode and
epoch, the audit's counts (the hook's and AuditedDDP's) next to the collectives the profiler saw
(c10d::allreduce_, c10d::broadcast_), which are the ground truth the audit must match; and the
hook calls per synchronized backward with DDP's default bucket size and with the lab's explicit 25 MB; and
whether every rank held rank 0's BatchNorm buffers after the training loop and after the evaluation (gathered);
and each rank's seconds and wait from the collective clock on calls of known seconds.
"""

import json
from collections import Counter
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import train
from ddp_no_sync_lab import cli, experiment
from ddp_no_sync_lab.audit import face, instruments
from model import CifarCNN

BATCH, ACCUM, MICRO_BATCHES, EPOCHS = 4, 4, 8, 2
CPU = torch.device("cpu")
# Each of DDP's rules for its own collectives, with levers combined to keep it short: a first sync in one
# bucket, then rebuilt ones; the evaluation's own buffer broadcast; the compression hook's calls; searching for
# unused parameters (buckets filled in the parameters' order, 3 of 0.99 MiB where the reverse order makes 2, no
# rebuild, a used-parameter all-reduce per sync); a static graph (its first two syncs in one bucket, one
# used-parameter all-reduce). static_graph inside no_sync() fails in torch 2.8 (tests/test_ddp_settings.py).
SETTINGS = {
    "documented": ({}, ("every", "no_sync")),
    "bucket_cap_mb=0.5, broadcast_buffers=False, comm_hook=bf16": (
        {"bucket_cap_mb": 0.5, "broadcast_buffers": False, "comm_hook": "bf16"},
        ("every", "no_sync"),
    ),
    "find_unused_parameters=True, bucket_cap_mb=0.99": (
        {"find_unused_parameters": True, "bucket_cap_mb": 0.99},
        ("every", "no_sync"),
    ),
    "static_graph=True, bucket_cap_mb=0.5": ({"static_graph": True, "bucket_cap_mb": 0.5}, ("every",)),
}


def hook_calls_per_sync(bucket_cap_mb, loader):
    """Hook calls in each of three synchronized backwards, the first before DDP rebuilds its buckets."""
    options = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}
    ddp_model = DDP(CifarCNN(), **options)
    comm_audit = instruments.CommAudit(world_size=dist.get_world_size())
    ddp_model.register_comm_hook(comm_audit, train.counting_allreduce_hook)
    calls = []
    for (inputs, targets), _ in zip(loader, range(3)):
        before = comm_audit.sync_bucket_calls
        nn.functional.cross_entropy(ddp_model(inputs), targets).backward()
        calls.append(comm_audit.sync_bucket_calls - before)
    return calls


def buffers_equal_rank_0s(model):
    """Every rank's BatchNorm buffers (running statistics and counters) gathered and compared with rank 0's."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, [buffer.clone() for buffer in model.buffers()])
    return all(all(torch.equal(mine, theirs) for mine, theirs in zip(gathered[0], other)) for other in gathered[1:])


def waits_of_known_calls():
    """CollectiveClock.seconds_and_waits on calls of known seconds: rank 0's two syncs took 1 and 3 s, rank 1's
    2 and 1 s, its second completing first; their all-gather 0.5 and 0.25 s. Then on ranks that timed different
    numbers of syncs."""
    rank = dist.get_rank()
    clock = instruments.CollectiveClock("cpu")
    completed = ([(1, 1.0), (2, 3.0)], [(2, 1.0), (1, 2.0)])[rank]  # (the call's order, its seconds)
    for order, seconds in completed:
        clock.add("sync", seconds, order)
    clock.add("all_gather", (0.5, 0.25)[rank], 3)
    timed = clock.seconds_and_waits(CPU, None)
    for _ in range(rank + 1):
        clock.add("sync", 1.0)
    try:
        clock.seconds_and_waits(CPU, None)
        refused = None
    except RuntimeError as error:
        refused = str(error)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"timed": timed, "refused": refused})
    return gathered


def main():
    dist.init_process_group("gloo")
    world_size = dist.get_world_size()
    torch.manual_seed(0)
    count = BATCH * MICRO_BATCHES * world_size
    data = TensorDataset(torch.randn(count, 3, 32, 32), torch.randint(0, 10, (count,)))
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler)
    evaluation = DataLoader(data, batch_size=BATCH)
    plan = experiment.window_plan(MICRO_BATCHES, ACCUM, "error")
    progress = cli.Progress(enabled=False, interval=0)
    criterion = nn.CrossEntropyLoss()
    rows = []
    runs = [(setting, changes, mode) for setting, (changes, modes) in SETTINGS.items() for mode in modes]
    for setting, changes, mode in runs:
        settings = {**experiment.DDP_DEFAULTS, **changes}
        ddp_model, comm_audit = train.wrap_model(CifarCNN(), CPU, world_size, settings=settings)
        optimizer = torch.optim.AdamW(ddp_model.parameters(), lr=3e-3)
        audit = face.attach(ddp_model, optimizer, criterion, comm_audit, CPU)
        for epoch in range(1, EPOCHS + 1):
            sampler.set_epoch(epoch)
            before = comm_audit.totals()
            with profile(activities=[ProfilerActivity.CPU]) as profiler:
                _, trace = train.train_epoch(
                    ddp_model, audit, loader, plan, mode, optimizer, criterion, CPU, nullcontext, progress
                )
                buffers_equal_after_training = buffers_equal_rank_0s(ddp_model.module)
                train.evaluate(ddp_model, evaluation, criterion, CPU, nullcontext, progress, "validation")
                buffers_equal_after_evaluation = buffers_equal_rank_0s(ddp_model.module)
            after = comm_audit.totals()
            # The raw events' names: profiler.events() would build an event tree of every op (about 28,000 an
            # epoch here, the witnesses' included), two thirds of this worker's time, for two counts. A torch
            # without them (a private attribute) gets the tree.
            raw = getattr(profiler.profiler, "kineto_results", None)
            names = [event.name() for event in raw.events()] if raw else [event.name for event in profiler.events()]
            events = Counter(names)
            rows.append(
                {
                    "setting": setting,
                    "settings": settings,
                    "mode": mode,
                    "epoch": epoch,
                    "audit": {key: after[key] - before[key] for key in experiment.COUNTS},
                    "profiler_allreduces": events["c10d::allreduce_"],
                    "profiler_broadcasts": events["c10d::broadcast_"],
                    "optimizer_steps": len(trace.step_positions),
                    "buffers_equal": {
                        "after training": buffers_equal_after_training,
                        "after evaluation": buffers_equal_after_evaluation,
                    },
                    "train_size": count,
                    "world_size": world_size,
                }
            )
    hook_calls = {
        "default": hook_calls_per_sync(None, loader),
        "25": hook_calls_per_sync(experiment.BUCKET_CAP_MB, loader),
    }
    waits = waits_of_known_calls()
    if dist.get_rank() == 0:
        print(json.dumps({"rows": rows, "hook_calls_per_sync": hook_calls, "waits": waits}), flush=True)
    instruments.settle_comm_hooks()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
