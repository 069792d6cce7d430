"""The gradients' linear float64 projection, the checklist's way of reading every gradient at once: F = w . g over
the gradients laid end to end (w fixed, seeded, the same on every rank) and Q = g . g; whole (DDP's replicas,
FSDP's unsharded gradients) or a rank's shard placed where it lies in the whole (FSDP's). It holds only w, in
float32 (4 bytes per parameter); each parameter's gradient is projected in float64 on its own, as it is read."""

import math

import torch

from ddp_no_sync_lab.audit.memory import local
from ddp_no_sync_lab.audit.scale import UNIT_ROUNDOFF

PROJECTION_SEED = 47_000_047
# The most elements projected at once: a read's float64 temporaries stay within 16 bytes times this, however
# large a parameter (a language model's embedding) is.
CHUNK = 1 << 22


def projection_weights(parameters, device):
    """A fixed Gaussian weight per gradient element, in the parameters' order, the same on every rank (seeded),
    held in float32 (the products are float64): F(g) = w . g over the gradients laid end to end. Drawn in float64
    (torch's float32 draw on a CPU depends on its vector instructions, the float64 one does not: nodes of unlike
    CPUs draw the same weights), a chunk at a time."""
    generator = torch.Generator().manual_seed(PROJECTION_SEED)
    weights = torch.empty(sum(p.numel() for p in parameters), dtype=torch.float32, device=device)
    for start in range(0, weights.numel(), CHUNK):
        chunk = weights[start : start + CHUNK]
        chunk.copy_(torch.randn(chunk.numel(), generator=generator, dtype=torch.float64))
    return weights


def dense_strides(parameter):
    """The strides a parameter's gradient is read in: the parameter's own where it is laid out densely
    (contiguous, channels_last), so that reading it is a straight copy; otherwise (a view with gaps, a DTensor
    shard's whole) contiguous ones."""
    layouts = {4: torch.channels_last, 5: torch.channels_last_3d}
    if parameter is local(parameter) and (
        parameter.is_contiguous()
        or (parameter.dim() in layouts and parameter.is_contiguous(memory_format=layouts[parameter.dim()]))
    ):
        return parameter.stride()
    return torch.empty(parameter.shape, device="meta").stride()


class Projection:
    """The gradients' linear float64 projection [F, Q] (F = w . g, Q = g . g, zero exactly when all are) over the
    parameters laid end to end: of the gradients held now, and of one backward's own, summed as they arrive
    (DDP may later write the mean into the very tensor a first backward's gradient became)."""

    def __init__(self, parameters, device, world_size):
        self.parameters, self.device, self.world_size = parameters, device, world_size
        self.whole = {}  # FSDP's: each parameter's unsharded one, once FSDP made them
        self.weights = projection_weights(parameters, device)
        # Each gradient element pairs with the weight at its offset in the parameter's memory, read in
        # dense_strides (a shard's whole parameter contiguous).
        self.slices, self.strides, start = [], [], 0
        for parameter in parameters:
            self.slices.append(slice(start, start + parameter.numel()))
            self.strides.append(dense_strides(parameter))
            start += parameter.numel()
        self.elements = start
        self.begin_own()
        # A float64 dot product of n terms errs by at most n u |w| |g| (Cauchy-Schwarz): per unit of |g|.
        self.dot_slack = start * UNIT_ROUNDOFF[torch.float64] * self.weights.norm(dtype=torch.float64).item()

    def part(self, weights, flat):
        """[w . g, g . g] in float64 of a stretch of weights and of gradient elements, a chunk at a time."""
        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        for start in range(0, flat.numel(), CHUNK):
            gradient = flat[start : start + CHUNK].to(self.device, torch.float64)
            weights_part = weights[start : start + CHUNK].to(torch.float64)
            total += torch.stack([torch.dot(weights_part, gradient), torch.dot(gradient, gradient)])
        return total

    def project_parameter(self, index, gradient):
        """[F, Q] of one parameter's gradient, its elements in the parameter's memory order (dense_strides)."""
        strides = self.strides[index]
        if gradient.stride() != strides:
            laid_out = torch.empty_strided(gradient.shape, strides, dtype=gradient.dtype, device=gradient.device)
            gradient = laid_out.copy_(gradient)
        return self.part(self.weights[self.slices[index]], gradient.as_strided((gradient.numel(),), (1,)))

    def copy_own(self, index, gradient):
        part = self.project_parameter(index, gradient)
        self.own[0] += part[0]
        earlier = self.own_squares.get(index)
        if earlier is None:
            self.own[1] += part[1]
            self.own_squares[index] = part[1]
        else:  # a second gradient for it in one backward (reentrant checkpointing): its norm at most the sum
            combined = (earlier.sqrt() + part[1].sqrt()) ** 2
            self.own[1] += combined - earlier
            self.own_squares[index] = combined

    def begin_own(self):
        self.own = torch.zeros(2, dtype=torch.float64, device=self.device)
        self.own_squares = {}

    def own_projection(self):
        """[F, Q] of the backward's own gradients (a parameter that got none: zero; one that got several: Q an
        upper bound, the square of their norms' sum)."""
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
            parts += self.part(self.weights[start : start + shard.numel()], shard.reshape(-1))
        # A shard's F is this rank's part of the whole's: weighed world_size (the sum over ranks / W is the whole's).
        return torch.stack([whole[0] + parts[0] * self.world_size, whole[1] + parts[1]]), False, True
