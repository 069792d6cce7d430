"""A plain DDP training loop as users write one, nothing of the lab in it: run under the watcher by
tests/test_watch.py (`torchrun --nproc-per-node=2 -m ddp_no_sync_lab.watch plain_ddp.py --case CASE`).

A small MLP on random vectors, a DistributedSampler, AdamW, nn.CrossEntropyLoss, a window of 4 micro-batches of 4
samples, 2 epochs of 3 windows per rank. --case picks the loop:

    no_sync          the document's loop: no_sync() around the forward and backward of the first 3 micro-batches
    every            no no_sync(): every micro-batch synchronizes (correct, 4x the traffic)
    bf16             no_sync under BF16 autocast
    short_last_by_k  14 micro-batches per epoch: the last window's 2 losses divided by 2
    backward_only    no_sync() around the backward only (the forward outside)
    first_synced     the window's first micro-batch synchronized instead of its last
    zero_grad_each   zero_grad() before every backward
    not_divided      the loss not divided by the window
    divided_twice    the loss divided by 4, twice
    short_last_by_4  14 micro-batches per epoch: the last window's 2 losses divided by 4
    extra_step       step() twice at each window's end
    skipped_step     no step at the end of the second window
    no_set_epoch     sampler.set_epoch(epoch) never called
    same_samples     no sampler: every rank reads the whole dataset in the same order
    two_optimizers   each layer its own optimizer, both stepped at each window's end
    logging_forward  a train-mode forward with gradients on and no backward before each step (a metric): DDP,
                     prepared for a backward that never comes, synchronizes the next window's first micro-batch
    resumed          the optimizer's state loaded from one that stepped before
    eval_sampler     an evaluation loader over a shuffling DistributedSampler, never set_epoch, each epoch
    mse              a regression: MSE against one-hot targets (a loss the watcher does not read)
    grad_scaler      no_sync under float16 autocast with a GradScaler from a scale of 2**20: its first 2 steps
                     skipped on inf gradients (the scale halved each time), the loss scaled, the gradients unscaled
    grad_scaler_not_divided  the same, the loss not divided by the window
    grad_scaler_fused  the grad_scaler loop with a fused AdamW (stepped by the scaler, it skips the update itself)
    grad_scaler_all_skipped  the grad_scaler loop from a scale of 2**40: every step skipped
    hook_halves      the optimizer's own step pre-hook halves the gradients before each update
    sgd_nesterov     SGD with Nesterov momentum, foreach (its step changes the gradients in place)
    manual_update    no optimizer: each window's mean gradient subtracted from the weights by hand
    compiled         the document's loop on the DDP model under torch.compile (its aot_eager backend: no C++
                     compiler needed), the loss computed outside it
    compiled_first_synced  the same, the window's first micro-batch synchronized instead of its last
"""

import argparse
import copy
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

ACCUM, BATCH, EPOCHS = 4, 4, 2

parser = argparse.ArgumentParser()
parser.add_argument("--case", default="no_sync")
case = parser.parse_args().case

dist.init_process_group("gloo")
world_size = dist.get_world_size()
torch.manual_seed(0)
micro_batches = 14 if case.startswith("short_last") else 3 * ACCUM
count = world_size * micro_batches * BATCH
data = TensorDataset(torch.randn(count, 8), torch.randint(0, 4, (count,)))
model = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
trained = torch.compile(model, backend="aot_eager") if case.startswith("compiled") else model
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
if case == "grad_scaler_fused":
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
if case == "hook_halves":
    optimizer.register_step_pre_hook(lambda *_: [p.grad.div_(2) for p in model.parameters()] and None)
if case == "sgd_nesterov":
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, nesterov=True, foreach=True)
optimizers = [optimizer]
if case == "two_optimizers":
    optimizers = [torch.optim.AdamW(model.module[index].parameters(), lr=1e-2) for index in (0, 2)]
if case == "resumed":  # the state a checkpoint would hold: made by an earlier model's optimizer, loaded
    earlier_model = copy.deepcopy(model.module)
    earlier = torch.optim.AdamW(earlier_model.parameters(), lr=1e-2)
    earlier_model(torch.randn(2, 8)).sum().backward()
    earlier.step()
    optimizer.load_state_dict(earlier.state_dict())
evaluation = DataLoader(data, batch_size=BATCH, sampler=DistributedSampler(data))
initial_scale = 2.0**40 if case == "grad_scaler_all_skipped" else 2.0**20
scaler = torch.amp.GradScaler("cpu", init_scale=initial_scale, enabled=case.startswith("grad_scaler"))
half = torch.float16 if case.startswith("grad_scaler") else torch.bfloat16
criterion = nn.CrossEntropyLoss()
if case == "mse":
    criterion = lambda logits, targets: nn.functional.mse_loss(logits, nn.functional.one_hot(targets, 4).float())  # noqa: E731
if case == "same_samples":
    sampler, loader = None, DataLoader(data, batch_size=BATCH)
else:
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler)

for epoch in range(EPOCHS):
    if sampler is not None and case != "no_set_epoch":
        sampler.set_epoch(epoch)
    steps = len(loader)
    for index, (inputs, targets) in enumerate(loader):
        window_end = (index + 1) % ACCUM == 0 or index + 1 == steps
        window_length = ACCUM if index < steps - steps % ACCUM else steps % ACCUM
        divisor = {
            "not_divided": 1,
            "grad_scaler_not_divided": 1,
            "divided_twice": ACCUM * ACCUM,
            "short_last_by_k": window_length,
        }.get(case, ACCUM)
        synced_here = (index % ACCUM == 0) if case in ("first_synced", "compiled_first_synced") else window_end
        skip = not synced_here and case not in ("every", "backward_only")
        if case == "zero_grad_each":
            optimizer.zero_grad()
        with model.no_sync() if skip else nullcontext():
            with torch.autocast("cpu", dtype=half) if case == "bf16" or scaler.is_enabled() else nullcontext():
                logits = trained(inputs)
            loss = criterion(logits.float(), targets) / divisor
            with model.no_sync() if case == "backward_only" and not window_end else nullcontext():
                scaler.scale(loss).backward()
        if window_end and case == "logging_forward":
            model(inputs).argmax(dim=1)
        if window_end and case == "manual_update":
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter -= 1e-2 * parameter.grad
                    parameter.grad = None
        elif window_end and not (case == "skipped_step" and index == 2 * ACCUM - 1):
            for stepped in optimizers:
                scaler.step(stepped)
            scaler.update()
            if case == "extra_step":
                optimizer.step()
            for stepped in optimizers:
                stepped.zero_grad(set_to_none=True)
    if case == "eval_sampler":
        with torch.no_grad():
            correct = sum((model(inputs).argmax(dim=1) == targets).sum() for inputs, targets in evaluation)
        if dist.get_rank() == 0:
            print(f"epoch {epoch}: {int(correct)} evaluation samples right on rank 0")
    if dist.get_rank() == 0:
        print(f"epoch {epoch}: last loss {loss.item() * divisor:.4f}")

dist.destroy_process_group()
