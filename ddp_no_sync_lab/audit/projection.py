"""The gradients' linear float64 projection, the checklist's way of reading every gradient at once: F = w . g over
the gradients laid end to end (w fixed, seeded, the same on every rank) and Q = g . g; whole (DDP's replicas,
FSDP's unsharded gradients) or a rank's shard placed where it lies in the whole (FSDP's). It holds only w, in
float32 (4 bytes per parameter); each parameter's gradient is projected in float64 on its own, as it is read."""

import math

import torch

from ddp_no_sync_lab.audit.memory import local
from ddp_no_sync_lab.audit.scale import UNIT_ROUNDOFF

PROJECTION_SEED = 47_000_047


def projection_weights(parameters, device):
    """A fixed Gaussian weight per gradient element, in the parameters' order, the same on every rank (seeded),
    held in float32 (the products are float64): F(g) = w . g over the gradients laid end to end."""
    generator = torch.Generator().manual_seed(PROJECTION_SEED)
    count = sum(p.numel() for p in parameters)
    return torch.randn(count, generator=generator, dtype=torch.float32).to(device)


class Projection:
    """The gradients' linear float64 projection [F, Q] (F = w . g, Q = g . g, zero exactly when all are) over the
    parameters laid end to end: of the gradients held now, and of one backward's own, summed as they arrive
    (DDP may later write the mean into the very tensor a first backward's gradient became)."""

    def __init__(self, parameters, device, world_size):
        self.parameters, self.device, self.world_size = parameters, device, world_size
        self.whole = {}  # FSDP's: each parameter's unsharded one, once FSDP made them
        self.weights = projection_weights(parameters, device)
        # Each parameter's element i pairs with the weight at its offset in memory as the parameter is laid out
        # (channels_last or not; a shard's whole parameter contiguous): its gradient is read element for element
        # by logical index into a float64 copy laid out so.
        self.slices, self.strides, start = [], [], 0
        for parameter in parameters:
            self.slices.append(slice(start, start + parameter.numel()))
            self.strides.append(
                torch.empty(parameter.shape, device="meta").stride()
                if parameter is not local(parameter)
                else parameter.stride()
            )
            start += parameter.numel()
        self.elements = start
        self.own = torch.zeros(2, dtype=torch.float64, device=device)
        # A float64 dot product of n terms errs by at most n u |w| |g| (Cauchy-Schwarz): per unit of |g|.
        self.dot_slack = start * UNIT_ROUNDOFF[torch.float64] * self.weights.norm(dtype=torch.float64).item()

    def part(self, weights, gradient):
        """[w . g, g . g] in float64 of one contiguous stretch of weights and the gradient laid out as they are."""
        weights = weights.to(torch.float64)
        return torch.stack([torch.dot(weights, gradient), torch.dot(gradient, gradient)])

    def project_parameter(self, index, gradient):
        """[F, Q] of one parameter's gradient, read by logical index as the parameter is laid out."""
        shape = self.parameters[index].shape
        laid_out = torch.empty_strided(shape, self.strides[index], dtype=torch.float64, device=self.device)
        laid_out.copy_(gradient)
        flat = laid_out.as_strided((laid_out.numel(),), (1,))
        return self.part(self.weights[self.slices[index]], flat)

    def copy_own(self, index, gradient):
        self.own += self.project_parameter(index, gradient)

    def begin_own(self):
        self.own = torch.zeros(2, dtype=torch.float64, device=self.device)

    def own_projection(self):
        """[F, Q] of the backward's own gradients (a parameter that got none: zero)."""
        return self.own

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
        whole = torch.zeros(2, dtype=torch.float64, device=self.device)
        for index, gradient in held:
            whole += self.project_parameter(index, gradient)
        if not shards:
            return whole, False, False
        parts = torch.zeros(2, dtype=torch.float64, device=self.device)
        for index, gradient in shards:  # FSDP's rank r holds rows [r ceil(d / W), ...) of the first dimension
            shard, rows, mesh = gradient.to_local(), gradient.shape[0], gradient.device_mesh
            row = math.prod(gradient.shape[1:])
            start = self.slices[index].start + mesh.get_local_rank() * math.ceil(rows / mesh.size()) * row
            parts += self.part(self.weights[start : start + shard.numel()], shard.reshape(-1).to(torch.float64))
        # A shard's F is this rank's part of the whole's: weighed world_size (the sum over ranks / W is the whole's).
        return torch.stack([whole[0] + parts[0] * self.world_size, whole[1] + parts[1]]), False, True
