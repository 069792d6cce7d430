"""A training loop in Accelerate's documented style, nothing of the lab in it: run under the watcher by
tests/test_watch_frameworks.py (`torchrun --nproc-per-node=2 -m ddp_no_sync_lab.watch accelerate_loop.py --case
CASE`).

A small MLP on random vectors, Accelerator(gradient_accumulation_steps=4) on CPU, AdamW, nn.CrossEntropyLoss, a
window of 4 micro-batches of 4 samples, 2 epochs of 3 windows per rank. --case picks the loop:

    accumulate          the documented loop: `with accelerator.accumulate(model):` around each batch's forward,
                        backward, step and zero_grad
    divided_twice       the loss divided by 4 before accelerator.backward, which divides it by 4 again
                        (accelerate#3533)
    accumulate_outside  `with accelerator.accumulate(model):` entered once around the whole loop (accelerate#1211)
    short_last          14 micro-batches per epoch: the last window's 2 losses divided by 4, by Accelerate
"""

import argparse

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

ACCUM, BATCH, EPOCHS = 4, 4, 2

parser = argparse.ArgumentParser()
parser.add_argument("--case", default="accumulate")
case = parser.parse_args().case

accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUM)
torch.manual_seed(0)
micro_batches = 14 if case == "short_last" else 3 * ACCUM
count = accelerator.num_processes * micro_batches * BATCH
data = TensorDataset(torch.randn(count, 8), torch.randint(0, 4, (count,)))
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
loader = DataLoader(data, batch_size=BATCH, shuffle=True)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
criterion = nn.CrossEntropyLoss()


def train_batch(inputs, targets):
    loss = criterion(model(inputs), targets)
    if case == "divided_twice":
        loss = loss / ACCUM
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    return loss


for epoch in range(EPOCHS):
    if case == "accumulate_outside":
        with accelerator.accumulate(model):
            for inputs, targets in loader:
                loss = train_batch(inputs, targets)
    else:
        for inputs, targets in loader:
            with accelerator.accumulate(model):
                loss = train_batch(inputs, targets)
    accelerator.print(f"epoch {epoch}: last loss {loss.item():.4f}")

accelerator.end_training()
