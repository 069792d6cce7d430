"""nanoGPT's training loop in miniature, nothing of the lab in it: run under the watcher by tests/test_watch.py
(`torchrun --nproc-per-node=2 -m ddp_no_sync_lab.watch nanogpt_style.py [--flag-after-forward]`).

As karpathy/nanoGPT's train.py: random batches per rank (no sampler, no epochs: iterations), the loss computed
inside the model with F.cross_entropy(..., ignore_index=-1) and divided by gradient_accumulation_steps, DDP's
`require_backward_grad_sync` set before each micro-step's forward instead of no_sync(), the next batch fetched
between the forward and the backward, gradients clipped to norm 1.0 before the step, an evaluation under
torch.no_grad() in eval mode. --flag-after-forward sets the flag after the forward (the mistake of
karpathy/build-nanogpt#30's family): DDP decides at the forward, so the window's first micro-batch syncs and its
last does not. --compile compiles the model before DDP wraps it, as nanoGPT does (torch.compile, its aot_eager
backend: no C++ compiler needed; the loss is then computed inside the compiled forward).
"""

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

VOCAB, BLOCK, BATCH, ACCUM, ITERS = 16, 8, 4, 4, 3

parser = argparse.ArgumentParser()
parser.add_argument("--flag-after-forward", action="store_true")
parser.add_argument("--compile", action="store_true")
options = parser.parse_args()
flag_after_forward = options.flag_after_forward


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, 16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, idx, targets=None):
        logits = self.head(torch.tanh(self.embedding(idx)))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(1337 + rank)  # nanoGPT's seed_offset: each rank its own random batches
tokens = torch.randint(VOCAB, (1000,))


def get_batch():
    ix = torch.randint(len(tokens) - BLOCK - 1, (BATCH,))
    x = torch.stack([tokens[i : i + BLOCK] for i in ix])
    y = torch.stack([tokens[i + 1 : i + 1 + BLOCK] for i in ix])
    y[:, :2] = -1  # positions that count for nothing (as a padded batch's)
    return x, y


torch.manual_seed(0)
model = TinyLM()
if options.compile:
    model = torch.compile(model, backend="aot_eager")
model = DDP(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
X, Y = get_batch()
for _ in range(ITERS):
    for micro_step in range(ACCUM):
        if not flag_after_forward:
            model.require_backward_grad_sync = micro_step == ACCUM - 1
        logits, loss = model(X, Y)
        loss = loss / ACCUM
        if flag_after_forward:
            model.require_backward_grad_sync = micro_step == ACCUM - 1
        X, Y = get_batch()
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
model.eval()
with torch.no_grad():
    _, evaluation = model(*get_batch())
if rank == 0:
    print(f"last loss {loss.item() * ACCUM:.4f}, evaluation {evaluation.item():.4f}")
dist.destroy_process_group()
