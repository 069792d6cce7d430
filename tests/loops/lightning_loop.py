"""A training loop in Lightning's documented style, nothing of the lab in it: run under the watcher by
tests/test_watch_frameworks.py (`torchrun --nproc-per-node=2 -m ddp_no_sync_lab.watch lightning_loop.py --case
CASE`).

A small MLP LightningModule on random vectors, Trainer(accelerator="cpu", devices=2, strategy="ddp",
accumulate_grad_batches=4), AdamW, F.cross_entropy in training_step, micro-batches of 4 samples, 2 epochs of 3
windows per rank. --case picks the loop:

    accumulate      the documented loop: training_step returns the micro-batch's mean loss
    divided         training_step returns the loss divided by 4 (Lightning divides it by 4 again)
    short_last      14 micro-batches per epoch: the last window's 2 losses divided by 4, by Lightning
                    (Lightning-AI/pytorch-lightning#19987)
"""

import argparse

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

ACCUM, BATCH, EPOCHS, WORLD_SIZE = 4, 4, 2, 2

parser = argparse.ArgumentParser()
parser.add_argument("--case", default="accumulate")
case = parser.parse_args().case


class Classifier(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        loss = F.cross_entropy(self.net(inputs), targets)
        return loss / ACCUM if case == "divided" else loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


torch.manual_seed(0)
micro_batches = 14 if case == "short_last" else 3 * ACCUM
count = WORLD_SIZE * micro_batches * BATCH
data = TensorDataset(torch.randn(count, 8), torch.randint(0, 4, (count,)))
trainer = L.Trainer(
    accelerator="cpu",
    devices=WORLD_SIZE,
    strategy="ddp",
    accumulate_grad_batches=ACCUM,
    max_epochs=EPOCHS,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)
trainer.fit(Classifier(), DataLoader(data, batch_size=BATCH, shuffle=True))
