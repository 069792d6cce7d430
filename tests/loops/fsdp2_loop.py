"""A training loop on FSDP2 (torch.distributed.fsdp.fully_shard) in its documented style, nothing of the lab in
it: run under the watcher by tests/test_watch_frameworks.py (`torchrun --nproc-per-node=2 -m
ddp_no_sync_lab.watch fsdp2_loop.py --case CASE`).

A small MLP, each Linear its own unit under the root, on random vectors, a DistributedSampler, AdamW, a window of 4
micro-batches of 4 samples, 2 epochs of 3 windows per rank; set_requires_gradient_sync(False) around the forward
and backward of each window's first 3 micro-batches, FSDP's counterpart of DDP's no_sync(). --case picks the loop:

    accumulate       the documented loop, each unit's reduction set to sum and divide by the world size itself
                     (set_force_sum_reduction_for_comms(True): torch 2.8 hands ReduceOp.AVG to gloo's
                     reduce-scatter, which sums, pytorch/pytorch#162338)
    gloo_sum         the documented loop without that setting: on gloo, the ranks' sum
    never_set_back   set_requires_gradient_sync(False) set once before the loop, never set back
    clipped          the documented loop, its gradients clipped to norm 0.01 before each step (every step clipped)
    teacher          the documented loop beside a frozen teacher under fully_shard, called first at each
                     micro-batch under torch.no_grad() (its logits unused)
"""

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

ACCUM, BATCH, EPOCHS = 4, 4, 2

parser = argparse.ArgumentParser()
parser.add_argument("--case", default="accumulate")
case = parser.parse_args().case

dist.init_process_group("gloo")
torch.manual_seed(0)  # every rank the same weights before fully_shard keeps its shard of them
count = dist.get_world_size() * 3 * ACCUM * BATCH
data = TensorDataset(torch.randn(count, 8), torch.randint(0, 4, (count,)))
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
for layer in (model[0], model[2]):
    fully_shard(layer)
fully_shard(model)
teacher = nn.Sequential(nn.Linear(8, 4)).requires_grad_(False)
if case == "teacher":
    fully_shard(teacher)
if case != "gloo_sum":
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
sampler = DistributedSampler(data, shuffle=True, seed=0)
loader = DataLoader(data, batch_size=BATCH, sampler=sampler)
if case == "never_set_back":
    model.set_requires_gradient_sync(False)

for epoch in range(EPOCHS):
    sampler.set_epoch(epoch)
    for index, (inputs, targets) in enumerate(loader):
        window_end = (index + 1) % ACCUM == 0
        if case != "never_set_back":
            model.set_requires_gradient_sync(window_end)
        if case == "teacher":
            with torch.no_grad():
                teacher(inputs)
        loss = F.cross_entropy(model(inputs), targets) / ACCUM
        loss.backward()
        if window_end:
            if case == "clipped":
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.01)
            optimizer.step()
            optimizer.zero_grad()
    if dist.get_rank() == 0:
        print(f"epoch {epoch}: last loss {loss.item() * ACCUM:.4f}")

dist.destroy_process_group()
