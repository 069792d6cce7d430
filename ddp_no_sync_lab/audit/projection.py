"""The gradients' linear float64 projection, the checklist's way of reading every gradient at once: F = w . g over
the gradients laid end to end (w fixed, seeded, the same on every rank) and Q = g . g; whole (DDP's replicas,
FSDP's unsharded gradients) or a rank's shard placed where it lies in the whole (FSDP's)."""

import math

import torch

from ddp_no_sync_lab.audit.memory import local
from ddp_no_sync_lab.audit.scale import UNIT_ROUNDOFF

PROJECTION_SEED = 47_000_047


def projection_weights(parameters, device):
    """A fixed float64 weight per gradient element, in the parameters' order, the same on every rank (seeded):
    F(g) = w . g over the gradients laid end to end."""
    generator = torch.Generator().manual_seed(PROJECTION_SEED)
    count = sum(p.numel() for p in parameters)
    return torch.randn(count, generator=generator, dtype=torch.float64).to(device)


class Projection:
    """The gradients' linear float64 projection [F, Q] (F = w . g, Q = g . g, zero exactly when all are) over the
    parameters laid end to end: of the gradients held now, and of one backward's own, copied as they arrive."""

    def __init__(self, parameters, device, world_size):
        self.parameters, self.device, self.world_size = parameters, device, world_size
        self.whole = {}  # FSDP's: each parameter's unsharded one, once FSDP made them
        self.weights = projection_weights(parameters, device)
        self.slices, start = [], 0
        for parameter in parameters:
            self.slices.append(slice(start, start + parameter.numel()))
            start += parameter.numel()
        self.elements = start
        self.flat = torch.empty(start, dtype=torch.float64, device=device)  # the gradients read, as float64
        # This backward's own gradients, copied as they arrive: DDP may later write the mean into the very tensor
        # a first backward's gradient became.
        self.own, self.own_arrived = torch.empty(start, dtype=torch.float64, device=device), set()
        # Each parameter's slice of both, laid out as the parameter is (channels_last or not; a shard's whole
        # parameter contiguous): its gradient is copied element for element by logical index.
        strides = [
            torch.empty(p.shape, device="meta").stride() if p is not local(p) else p.stride() for p in parameters
        ]
        self.flat_views, self.own_views = (
            [buffer[part].as_strided(p.shape, stride) for part, p, stride in zip(self.slices, parameters, strides)]
            for buffer in (self.flat, self.own)
        )
        # A float64 dot product of n terms errs by at most n u |w| |g| (Cauchy-Schwarz): per unit of |g|.
        self.dot_slack = start * UNIT_ROUNDOFF[torch.float64] * self.weights.norm().item()

    def project(self, flat):
        return torch.stack([torch.dot(flat, self.weights), torch.dot(flat, flat)])

    def copy_own(self, index, gradient):
        self.own_views[index].copy_(gradient)
        self.own_arrived.add(index)

    def begin_own(self):
        self.own_arrived = set()

    def own_projection(self):
        """[F, Q] of the backward's own gradients (a parameter that got none: zero)."""
        for missing in set(range(len(self.slices))) - self.own_arrived:
            self.own[self.slices[missing]].zero_()
        return self.project(self.own)

    def held(self):
        """[F, Q] of the gradients held now (a missing one is zero), whether none is held at all, and whether they
        are this rank's shards of the synced gradient (FSDP's, placed where they lie in the whole; F is then this
        rank's part of the sum) rather than whole gradients (DDP's, and FSDP's unsharded local ones)."""
        held, shards = [], []
        for index, p in enumerate(self.parameters):
            whole = self.whole.get(id(p))
            if whole is not None and whole.grad is not None:
                held.append((index, whole.grad))
            elif p.grad is not None:
                (shards if p.grad is not local(p.grad) else held).append((index, p.grad))
        if not held and not shards:
            return torch.zeros(2, dtype=torch.float64, device=self.device), True, False
        if len(held) < len(self.slices):
            self.flat.zero_()
        for index, gradient in held:
            self.flat_views[index].copy_(gradient)
        if not shards:
            return self.project(self.flat), False, False
        whole = self.project(self.flat) if held else torch.zeros(2, dtype=torch.float64, device=self.device)
        self.flat.zero_()
        for index, gradient in shards:  # FSDP's rank r holds rows [r ceil(d / W), ...) of the first dimension
            shard, rows, mesh = gradient.to_local(), gradient.shape[0], gradient.device_mesh
            row = math.prod(gradient.shape[1:])
            start = self.slices[index].start + mesh.get_local_rank() * math.ceil(rows / mesh.size()) * row
            self.flat[start : start + shard.numel()].copy_(shard.reshape(-1))
        # A shard's F is this rank's part of the whole's: weighed world_size (the sum over ranks / W is the whole's).
        parts = self.project(self.flat)
        return torch.stack([whole[0] + parts[0] * self.world_size, whole[1] + parts[1]]), False, True
