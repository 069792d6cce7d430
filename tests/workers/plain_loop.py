"""Started by tests/test_face.py under torchrun (2 ranks, gloo, CPU).

A plain DDP loop written as a user writes one (a small MLP, DDP's own averaging hook, no_sync() around the first
micro-batches of each window of 4, the loss divided by 4, the gradient clipped to norm 0.05 between the sync and
the step), nothing of the lab in it but the audit's face, attached by hand to the objects the loop made. Each
variant runs one epoch of 3 windows per rank; rank 0 prints one JSON object: per variant, the norms the clips
returned, the syncs counted and every rank's observations.

    clipped              the loop as described
    static_graph         DDP's static_graph=True (its first sync in autograd's final callbacks), which takes no
                         no_sync(): every backward synchronizes
    bucket_view          gradient_as_bucket_view=True (the gradients are views of DDP's buckets)
    unused_parameter     find_unused_parameters=True with a layer the forward never uses, clipped where a
                         gradient is held
    split_api            torch's split clip: get_total_norm, then clip_grads_with_norm_
    keywords             the model called with its input as a keyword
    keywords_over_more   the same, its forward over the batch twice, the loss over the first half of the logits
    rescaled             the synchronized gradient halved by hand before the step (no clip call): the loss divided
                         twice, made at the gradient
    clipped_inside       clip_grad_norm_ after every backward, the window's local gradients too
    every_clipped_each   no no_sync(): every backward synchronizes, and each is clipped (a clip of part of the
                         window's gradient)
"""

import json
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from ddp_no_sync_lab.audit import face

ACCUM, BATCH, WINDOWS, MAX_NORM = 4, 4, 3, 0.05
DDP_SETTINGS = {
    "static_graph": {"static_graph": True},
    "bucket_view": {"gradient_as_bucket_view": True},
    "unused_parameter": {"find_unused_parameters": True},
}
VARIANTS = (
    "clipped",
    *DDP_SETTINGS,
    "split_api",
    "keywords",
    "keywords_over_more",
    "rescaled",
    "clipped_inside",
    "every_clipped_each",
)
SYNC_EVERY_BACKWARD = ("static_graph", "every_clipped_each")
CPU = torch.device("cpu")


class MLP(nn.Module):
    def __init__(self, unused):
        super().__init__()
        self.hidden, self.out = nn.Linear(8, 16), nn.Linear(16, 4)
        self.unused = nn.Linear(4, 4) if unused else None

    def forward(self, inputs):
        return self.out(torch.relu(self.hidden(inputs)))


def clip(parameters):
    return torch.nn.utils.clip_grad_norm_([p for p in parameters if p.grad is not None], MAX_NORM).item()


def run(variant, data, world_size):
    torch.manual_seed(0)
    ddp_model = DDP(MLP(unused=variant == "unused_parameter"), **DDP_SETTINGS.get(variant, {}))
    comm_audit = face.CommAudit(world_size)
    ddp_model.register_comm_hook((comm_audit, None), face.counting(default_hooks.allreduce_hook))
    optimizer = torch.optim.AdamW(ddp_model.parameters(), lr=1e-2)
    criterion = nn.CrossEntropyLoss()
    audit = face.attach(ddp_model, optimizer, criterion, comm_audit, CPU)
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    audit.begin_epoch(face.EpochTrace())
    norms = []
    for index, (inputs, targets) in enumerate(DataLoader(data, batch_size=BATCH, sampler=sampler)):
        last = (index + 1) % ACCUM == 0
        with nullcontext() if last or variant in SYNC_EVERY_BACKWARD else ddp_model.no_sync():
            if variant == "keywords_over_more":
                logits = ddp_model(inputs=torch.cat([inputs, inputs]))[: len(targets)]
            else:
                logits = ddp_model(inputs=inputs) if variant == "keywords" else ddp_model(inputs)
            loss = criterion(logits, targets) / ACCUM
            loss.backward()
        if variant in ("clipped_inside", "every_clipped_each"):
            norms.append(clip(ddp_model.parameters()))
        if last:
            if variant == "split_api":
                grads = [p.grad for p in ddp_model.parameters()]
                total = torch.nn.utils.get_total_norm(grads)
                torch.nn.utils.clip_grads_with_norm_(ddp_model.parameters(), MAX_NORM, total)
                norms.append(total.item())
            elif variant == "rescaled":
                for parameter in ddp_model.parameters():
                    parameter.grad.mul_(0.5)
            elif variant not in ("clipped_inside", "every_clipped_each"):
                norms.append(clip(ddp_model.parameters()))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return {"norms": norms, "observed": audit.end_epoch(), "syncs": comm_audit.gradient_syncs}


def main():
    face.install()
    dist.init_process_group("gloo")
    world_size = dist.get_world_size()
    generator = torch.Generator().manual_seed(1)
    count = world_size * WINDOWS * ACCUM * BATCH
    data = TensorDataset(torch.randn(count, 8, generator=generator), torch.randint(0, 4, (count,), generator=generator))
    results = {variant: run(variant, data, world_size) for variant in VARIANTS}
    if dist.get_rank() == 0:
        print(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
