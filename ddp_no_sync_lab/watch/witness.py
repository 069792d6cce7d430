"""The watcher's witness on one model of a script the lab did not write (the audit's Witness, extended), and what it
reads the model through: a DDP model's counting slot for the script's own hook, an FSDP2 root's view, the inputs'
fingerprint, the framework that made the model (read from the call stack)."""

import functools
import sys
import weakref

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from ddp_no_sync_lab.audit import face
from ddp_no_sync_lab.strategies import fsdp

# A forward's inputs fingerprinted: their float64 sum and a weighted sum of at most PRINT_SAMPLE of them, at a fixed
# stride on fixed weights: two ranks that read the same samples give equal prints, at a fixed cost per forward.
PRINT_SAMPLE, PRINT_WEIGHTS_SEED = 4096, 20_241


@functools.cache
def print_weights(count, device):
    generator = torch.Generator().manual_seed(PRINT_WEIGHTS_SEED)
    return torch.rand(count, generator=generator, dtype=torch.float64).to(device)


def inputs_print(tensor):
    """[sum, weighted sum of a strided sample] of a forward's input in float64, on its device."""
    flat = tensor.detach().reshape(-1)
    sample = flat[:: max(1, flat.numel() // PRINT_SAMPLE)][:PRINT_SAMPLE].double()
    return torch.stack([flat.sum(dtype=torch.float64), sample @ print_weights(sample.numel(), sample.device)])


class HookSlot:
    """The gradient hook the watcher's counting hook runs: DDP's own all-reduce until the script registers one."""

    def __init__(self, ddp_model):
        self.hook, self.state = default_hooks.allreduce_hook, ddp_model.process_group
        self.registered = False

    def run(self, _, bucket):
        return self.hook(self.state, bucket)


# The frameworks whose own code may make a script's DDP model and run its loop, by top-level package, as the
# report names them: read from the call stack, none of them imported.
FRAMEWORKS = {
    "accelerate": "Accelerate",
    "lightning": "Lightning",
    "pytorch_lightning": "Lightning",
    "transformers": "HF Trainer",
}


def framework_of(frame):
    """The framework whose code runs `frame`, or None."""
    return FRAMEWORKS.get(frame.f_globals.get("__name__", "").partition(".")[0])


def outermost_framework(frame):
    """The framework nearest the script among the callers of `frame` (HF's Trainer calls Accelerate), or None."""
    found = None
    while frame is not None:
        found = framework_of(frame) or found
        frame = frame.f_back
    return found


class ShardedView:
    """A model under FSDP2's fully_shard as the witnesses read a DDP model: its module (the root), process group,
    sync flag (every unit's, which set_requires_gradient_sync sets) and unsharded parameters."""

    def __init__(self, root):
        self.module = root
        self.process_group = next(root.parameters()).device_mesh.get_group()

    @property
    def require_backward_grad_sync(self):
        return all(group.reduce_grads for group in fsdp.param_groups(self.module))

    def unsharded_parameters(self):
        return fsdp.unsharded_parameters(self.module)


def local_sums(parameters):
    """Each parameter's sum in float64 (a shard's, FSDP's): the weights' print, which any update changes."""
    return torch.stack([(p.to_local() if isinstance(p, DTensor) else p).detach().double().sum() for p in parameters])


SLOTS = weakref.WeakKeyDictionary()  # each adopted DDP model's hook slot
DDP_REGISTER_COMM_HOOK = DistributedDataParallel.register_comm_hook  # DDP's own, beneath the watcher's patch


class UntracedHook(face.HeldHook):
    """A witness's hook run as Python where the script compiles its model: a graph break at the hook, never traced
    (made here, not in the audit: torch.compiler's import costs a lab run nothing it uses)."""

    @torch.compiler.disable
    def __call__(self, *event):
        return self.call(*event)


class LoopWitness(face.Witness):
    """The checklist's witnesses on one DDP model of a script the lab did not write, and what the watcher infers
    its windows and divisors from: DDP's sync flag at each training forward and backward, each loss's items (the
    targets it averages), each forward's inputs' fingerprint, the DataLoader passes its batches came from."""

    held_hook = UntracedHook

    def __init__(self, ddp_model, watch, comm_audit, device):
        super().__init__(ddp_model, None, None, comm_audit, device, watch.group)
        self.ddp_model, self.watch = ddp_model, watch
        self.flags_at_forward, self.flags_at_backward = [], []
        self.losses_read = {}  # micro-batch: the items its loss averaged (on the device)
        self.input_prints = []  # per training forward, on the device
        self.unreadable_losses = 0  # cross-entropies read as no plain mean (weights, smoothing, probabilities)
        self.last_step = None  # (forwards seen, optimizer) at the last step taken: a second optimizer's joins it
        self.made_by = outermost_framework(sys._getframe())  # the framework that made the DDP model, if one did
        self.scaled_by = None  # a GradScaler's scale on the last loss read, until its backward reads it
        self.weights_at_start = local_sums(self.parameters)  # an update made without a torch optimizer shows
        self.skipped_steps = 0  # steps a GradScaler skipped on inf or NaN gradients: windows ended, no update
        self.window_ended = False  # a step ended a window since the last training forward

    def on_forward(self, module, positional, keywords):
        if self.training() and self.window_ended:  # the first forward after a step: its window whole, its step done
            self.window_ended = False
            self.watch.window_ended(self)
        if self.training():
            self.comm_audit.awaiting_sync = True  # FSDP's: the backward's first reduce-scatter is its sync
            self.flags_at_forward.append(bool(self.ddp_model.require_backward_grad_sync))
            first = face.first_batched(positional, keywords)
            if first is not None:
                self.input_prints.append(inputs_print(first))
            if self.watch.current_pass is not None:
                self.watch.trained_passes.add(self.watch.current_pass)
        super().on_forward(module, positional, keywords)

    def read_loss(self, logits, targets, output, ignore_index=-100):
        if self.awaiting_loss and self.training() and logits.requires_grad:
            self.losses_read[self.trace.micro_batches - 1] = targets.ne(ignore_index).sum()
        super().read_loss(logits, targets, output, ignore_index)

    def skip_loss(self):
        """A loss after a training forward that the witnesses cannot read as a mean cross-entropy."""
        if self.awaiting_loss and self.training():
            self.unreadable_losses += 1
            self.awaiting_loss = False

    def on_logits_gradient(self, logits, targets, ignore_index, gradient):
        self.flags_at_backward.append(bool(self.ddp_model.require_backward_grad_sync))
        super().on_logits_gradient(logits, targets, ignore_index, gradient)
        if self.scaled_by is not None:  # a GradScaler multiplied the loss: its divisor read that many times smaller
            scale = self.scaled_by.to(self.device, torch.float64)
            self.trace.loss_scales[-1] = self.trace.loss_scales[-1] * torch.stack([scale, scale.new_ones(()), scale])
            self.scaled_by = None

    def on_skipped_step(self, optimizer, ended):
        """A GradScaler's step skipped on inf or NaN gradients: the window ends (where the step's hooks did not end
        it) with no update, and its average (of gradients the step did not take) is not compared."""
        if not ended:
            self.on_step_begin(optimizer, (), {})
            self.on_step_end(optimizer, (), {})
        self.trace.averages.pop()
        self.skipped_steps += 1

    def bind(self, optimizer):
        """The first optimizer seen stepping this model's parameters: its own update count from here on."""
        self.optimizer = optimizer
        self.trace.state_steps_before = self.state_steps()

    def joins_last_step(self, optimizer):
        """A second optimizer stepping with no forward since another's step (parts of one model, each its own
        optimizer): the same window's end."""
        last = self.last_step
        return last is not None and last[0] == self.trace.micro_batches and last[1] is not optimizer

    def on_step_end(self, optimizer, step_args, step_kwargs):
        """The step follows the last backward (a forward of no loss read since, a logging one, is the next
        window's); it came between a forward and its backward where that forward's loss was read but not yet
        backpropagated."""
        forward, backwards = self.trace.micro_batches - 1, self.trace.loss_positions
        if forward in self.losses_read and (not backwards or backwards[-1] != forward):
            self.trace.steps_before_backward.append(forward)
        self.epoch_trace.step_positions.append(backwards[-1] if backwards else forward)
        self.last_step = (self.trace.micro_batches, optimizer)
        self.window_ended = True

    def summary(self):
        observed = super().summary()
        reads = [scale[2] for scale in torch.stack(self.trace.loss_scales).tolist()] if self.trace.loss_scales else []
        read = self.losses_read
        items = dict(zip(read, torch.stack(list(read.values())).tolist())) if read else {}
        slot = SLOTS.get(self.ddp_model)
        return {
            **observed,
            "losses": [[index, value, items.get(index)] for index, value in zip(self.trace.loss_positions, reads)],
            "unreadable_losses": self.unreadable_losses,
            "flags_at_forward": self.flags_at_forward,
            "flags_at_backward": self.flags_at_backward,
            "sync_positions": self.epoch_trace.sync_positions,
            "step_positions": self.epoch_trace.step_positions,
            "input_prints": torch.stack(self.input_prints).tolist() if self.input_prints else [],
            "bytes_handed": self.comm_audit.allreduce_bytes + self.comm_audit.reduce_scatter_bytes,
            "sharded": self.unsharded is not None,
            "syncs": self.comm_audit.gradient_syncs,
            "optimizer_counts_steps": self.optimizer is not None
            and "step" in self.optimizer.state.get(self.parameters[0], {}),
            "script_hook": getattr(slot.hook, "__name__", "?") if slot is not None and slot.registered else None,
            "made_by": self.made_by,
            "skipped_steps": self.skipped_steps,
            "weights_changed": bool((local_sums(self.parameters) != self.weights_at_start).any()),
        }
