"""The same no_sync epoch as benchmarks/watch_loop.py, written in Lightning: bench_watch.py runs it plain and under
the watcher. The lab's CNN in a LightningModule, Trainer(strategy="ddp", accumulate_grad_batches=--accum-steps)
on the CPU (Lightning's own no_sync() around each window's other micro-batches), random CIFAR-shaped data already
in memory, AdamW, F.cross_entropy; --windows windows per rank after one warm-up window. Rank 0 prints the timed
windows' seconds as one JSON line.
"""

import argparse
import json
import time

import lightning as L
import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from model import MEMORY_FORMAT, CifarCNN

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=50)
parser.add_argument("--accum-steps", type=int, default=4)
parser.add_argument("--windows", type=int, default=100)
options = parser.parse_args()
WORLD_SIZE = 2


class Classifier(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = CifarCNN().to(memory_format=MEMORY_FORMAT)

    def training_step(self, batch, batch_idx):
        images, labels = batch
        return F.cross_entropy(self.net(images.contiguous(memory_format=MEMORY_FORMAT)), labels)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class LoopClock(L.Callback):
    """The training loop's seconds after the warm-up window: from the first batch of the second window to the end."""

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if batch_idx == options.accum_steps:
            self.started = time.perf_counter()

    def on_train_end(self, trainer, module):
        self.seconds = time.perf_counter() - self.started


torch.manual_seed(0)
micro_batches = (options.windows + 1) * options.accum_steps
count = WORLD_SIZE * micro_batches * options.batch_size
data = TensorDataset(torch.randn(count, 3, 32, 32), torch.randint(0, 10, (count,)))
clock = LoopClock()
trainer = L.Trainer(
    accelerator="cpu",
    devices=WORLD_SIZE,
    strategy="ddp",
    accumulate_grad_batches=options.accum_steps,
    max_epochs=1,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    callbacks=[clock],
)
trainer.fit(Classifier(), DataLoader(data, batch_size=options.batch_size, shuffle=True))
if dist.get_rank() == 0:
    print(json.dumps({"loop_seconds": clock.seconds, "micro_batches": micro_batches - options.accum_steps}), flush=True)
