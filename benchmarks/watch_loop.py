"""A user's no_sync loop on the lab's CNN, nothing of the lab's machinery in it: bench_watch.py runs it plain and
under the watcher (`-m ddp_no_sync_lab.watch`). Random CIFAR-shaped data already in memory, a DistributedSampler,
AdamW, nn.CrossEntropyLoss, windows of --accum-steps micro-batches of --batch-size, the document's no_sync() around
the forward and backward of each window's other micro-batches; --windows windows per rank after one warm-up
window. Rank 0 prints the timed windows' seconds as one JSON line.
"""

import argparse
import json
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from model import MEMORY_FORMAT, CifarCNN

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=50)
parser.add_argument("--accum-steps", type=int, default=4)
parser.add_argument("--windows", type=int, default=100)
options = parser.parse_args()

dist.init_process_group("gloo")
torch.manual_seed(0)
micro_batches = (options.windows + 1) * options.accum_steps
count = dist.get_world_size() * micro_batches * options.batch_size
data = TensorDataset(torch.randn(count, 3, 32, 32), torch.randint(0, 10, (count,)))
sampler = DistributedSampler(data, shuffle=True, seed=0)
loader = DataLoader(data, batch_size=options.batch_size, sampler=sampler)
model = DDP(CifarCNN().to(memory_format=MEMORY_FORMAT))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
criterion = nn.CrossEntropyLoss()

sampler.set_epoch(0)
started = None
for index, (images, labels) in enumerate(loader):
    if index == options.accum_steps:  # the warm-up window done: time the rest
        started = time.perf_counter()
    last = (index + 1) % options.accum_steps == 0
    with nullcontext() if last else model.no_sync():
        loss = criterion(model(images.contiguous(memory_format=MEMORY_FORMAT)), labels) / options.accum_steps
        loss.backward()
    if last:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
seconds = time.perf_counter() - started
if dist.get_rank() == 0:
    print(json.dumps({"loop_seconds": seconds, "micro_batches": micro_batches - options.accum_steps}), flush=True)
dist.destroy_process_group()
