"""The document's checklist observed: witnesses that read what a run did (checks/certify.py checks each item).

Every witness reads an event of the run itself, never the window plan the loop follows:

    the model's training forwards     a forward pre-hook: the micro-batch index and the batch it was given
    the gradient at the logits        a hook on the criterion's input: each backward's start and its loss scale
    each parameter's own gradient     tensor hooks, before accumulation and before any sync: the local contribution
    the gradients' state              a linear float64 projection of every .grad (audit/projection.py) at each
                                      backward's start, as a synchronized backward ends (DDP's, in autograd's final
                                      callbacks) and at each step: resets (None or zero, however made),
                                      accumulation, alterations (a clip told by audit/clipping.py expected)
    the loss                          its value and the gradient reaching it (1 / the divisor), the samples (its
                                      targets) behind each step; the text task's tokens
    the optimizer                     its own step pre/post hooks, and its state's step counter
    the collective                    the hook's tensors handed to all_reduce (audit/tap.py)
    the average                       one SUM all-reduce per step of each rank's local projections: the synced
                                      gradient against the mean of the ranks' local gradients

Values stay on the device, read once per epoch; docs/audit.md says which witness shows what, the tolerances.
"""

import math
import uuid
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.profiler import record_function
from torch.utils import _pytree as pytree

from ddp_no_sync_lab import experiment
from ddp_no_sync_lab.audit.clipping import CLIPS
from ddp_no_sync_lab.audit.memory import held_bytes
from ddp_no_sync_lab.audit.projection import Projection
from ddp_no_sync_lab.audit.scale import CROSS_ENTROPY, UNIT_ROUNDOFF, divisor_runs, loss_scale, recorded_divisor
from ddp_no_sync_lab.experiment import IGNORE_INDEX, runs_of

AVERAGE_WITNESS_LABEL = "average witness"  # the profiler's label of the witness's all-reduce
# A Gaussian projection of an error vector exceeds 12 of its standard deviations with probability 4e-33.
SIGMAS = 12


PROCESS_ID = uuid.uuid4().hex  # each process's own name: a host name and a pid can repeat across containers


# ----------------------------------------------------------------------------- the witnesses (train.py)


@dataclass
class ChecklistTrace:
    """One rank's observations in one epoch (saved with a resumed epoch). Device tensors are read at its end."""

    micro_batches: int = 0  # training forwards seen
    samples: int = 0  # samples through them (each forward's batch; its loss's targets where it shows none)
    backwards: int = 0  # backwards whose gradient reached the logits
    state_steps_before: int = 0  # the optimizer state's step counter when the epoch began
    steps_before_backward: list = field(default_factory=list)  # micro-batches whose forward a step followed
    loss_positions: list = field(default_factory=list)  # the micro-batch of each backward
    loss_scales: list = field(default_factory=list)  # per backward, on the device: [divisor, residual]
    loss_short: list = field(default_factory=list)  # micro-batches whose loss took fewer samples than the forward
    state_points: list = field(default_factory=list)  # per observation: (point, micro-batch)
    gradient_states: list = field(default_factory=list)  # per observation, on the device: [fresh, off]
    averages: list = field(default_factory=list)  # per step: [synced, mean, bound, samples, forwards(, tokens)]
    micro_batch_tokens: list = field(default_factory=list)  # the text task: target tokens per loss, on the device
    clip_factors: list = field(default_factory=list)  # per step that took a clipped gradient: the factor, on device

    def to(self, device):
        """A copy with its device tensors on `device`, each list moved in one copy."""
        moved = ChecklistTrace(**vars(self))
        for name in ("loss_scales", "gradient_states", "averages", "micro_batch_tokens", "clip_factors"):
            values = getattr(self, name)
            setattr(moved, name, list(torch.stack(values).to(device).unbind()) if values else [])
        return moved


BACKWARD, STEP, EPOCH_END = 0, 1, 2  # where the gradients' state was read
# A window's sums, one float64 slot each, all-reduced at its step (Witness.reduce_window): the ranks' local
# gradients projected and their 2-norms, samples, forwards, syncs, the synced gradient projected (a rank's shard
# of it, FSDP's, weighs world_size: the sum over ranks / world_size is the whole's F); the text task: its tokens.
LOCAL_F, LOCAL_NORM, SAMPLES, FORWARDS, SYNCS, SYNCED_F, TOKENS = range(7)
# A step's row of trace.averages: the synced gradient's F and the mean of the ranks' local ones, the bound between
# them, then the window's samples and forwards over every rank (the text task: and tokens).
SYNCED, MEAN, BOUND, STEP_SAMPLES, STEP_FORWARDS, STEP_TOKENS = range(6)


def first_batched(positional, keywords):
    """A forward's first tensor argument with a batch dimension, positional or keyword, nested ones too (a
    framework's step hands the model its batch as a list or a dict); None where there is none."""
    leaves = pytree.tree_leaves((positional, keywords))
    return next((leaf for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.dim()), None)


class InertHook:
    """What a copy of a watched module or parameter holds in a witness's hook's place: nothing to observe."""

    def __call__(self, *_):
        return None


class HeldHook:
    """A witness's hook as the model's module or parameter holds it. A copy of the model (an EMA's deepcopy,
    torch.save of the whole module) gets an inert hook: the copy is not observed, and holds no process group."""

    def __init__(self, call):
        self.call = call

    def __call__(self, *event):
        return self.call(*event)

    def __deepcopy__(self, memo):
        return InertHook()

    def __reduce__(self):
        return InertHook, ()


class LossReading:
    """The loss as the loop used it: the criterion's value, the mean cross-entropy's computed alike, and the
    gradient that reached the value (1 / the divisor the loop applied)."""

    def __init__(self, counts_tokens):
        self.counts_tokens = counts_tokens
        self.value = self.reference = self.gradient = None

    def read(self, logits, targets, output, ignore_index=IGNORE_INDEX):
        self.value, self.gradient = output.detach().clone(), None
        if output.requires_grad and output.dim() == 0:
            with torch.no_grad():  # the mean cross-entropy's value as the criterion's would be, in its context
                flat = (logits.flatten(0, -2), targets.flatten()) if self.counts_tokens else (logits, targets)
                self.reference = CROSS_ENTROPY(*flat, ignore_index=ignore_index)
            output.register_hook(partial(setattr, self, "gradient"))

    def divisor(self, world_size, tokens):
        """The divisor the loop applied to this backward's loss, exactly (the gradient reaching the criterion's value
        is its inverse), times any other count the criterion divided by (its value against the mean's, computed
        alike); the text task's in the window's `tokens`. None where no gradient reached the criterion's value."""
        if self.gradient is None:
            return None
        read = self.reference.double() / (self.value.double() * self.gradient.double())
        self.gradient = None
        if self.counts_tokens:
            read = read * world_size * tokens
        return read


class Witness:
    """The checklist's witnesses on one rank, attached to the run's model, criterion, optimizer and audit: the
    events (forwards, losses, backwards, steps), what the gradients must hold between them, and each window's
    average, from the gradients' projection and the loss's reading.

    Without an optimizer or a criterion (the watcher's, which meets them later), nothing is hooked on them: the
    caller reports their events (on_step_begin, on_step_end, read_loss). The epoch's observations are gathered
    over `exchange_group` (None: the default group)."""

    held_hook = HeldHook  # what the model's module and parameters hold for the witnesses' hooks

    def __init__(self, ddp_model, optimizer, criterion, comm_audit, device, exchange_group=None):
        self.module, self.optimizer, self.comm_audit, self.device = ddp_model.module, optimizer, comm_audit, device
        self.exchange_group = exchange_group
        self.parameters = [p for p in self.module.parameters() if p.requires_grad]
        # FSDP's (strategies/fsdp.py): the unsharded parameters the forward computes with, hooked once FSDP made them.
        self.unsharded = getattr(ddp_model, "unsharded_parameters", None)
        self.projection = Projection(self.parameters, device, comm_audit.world_size)
        # Gradients accumulate in their parameters' dtype: float32's rounding at the least (a model held in BF16
        # rounds more).
        self.gradient_unit = max(
            UNIT_ROUNDOFF[torch.float32], *(UNIT_ROUNDOFF.get(p.dtype, 0) for p in self.parameters)
        )
        self.counts_tokens = getattr(criterion, "counts_tokens", False)
        self.loss = LossReading(self.counts_tokens)
        self.trace, self.awaiting_loss, self.forward_batch = None, False, None
        # What the gradients hold now: None (unknown), ("local", F, bound, norm): F within bound (their 2-norm at
        # most norm), ("synced",): the synchronized gradient, not yet read.
        self.expectation = None
        self.pending = None  # the backward under way: (micro-batch, [F, Q] before, syncs before)
        self.synced_read = None  # [F, Q] of the synchronized gradient, read as DDP's backward ended
        self.clippable = False  # the gradients held are the window's synchronized ones, read, untouched since
        self.clipped = None  # what a clip of them makes of the expectation, and its factor: held at the step alone
        self.held_shards = False  # the gradients last read were FSDP's shards of the synced one
        self.window = torch.zeros(TOKENS + 1 if self.counts_tokens else TOKENS, dtype=torch.float64, device=device)
        self.window_syncs, self.wire_dtype = 0, torch.float32
        self.module.register_forward_pre_hook(self.held_hook(self.on_forward), with_kwargs=True)
        if criterion is not None:
            criterion.register_forward_hook(self.on_loss)
        if self.unsharded is None:
            self.hook(self.parameters)
        if optimizer is not None:
            optimizer.register_step_pre_hook(self.on_step_begin)
            optimizer.register_step_post_hook(self.on_step_end)
        if comm_audit.on_sync is not None:
            raise ValueError("this CommAudit is attached to a witness already: give each Audit its own CommAudit")
        comm_audit.on_sync = self.on_sync
        CLIPS.listeners.add(self)

    def hook(self, tensors):
        for index, tensor in enumerate(tensors):
            tensor.register_hook(self.held_hook(partial(self.on_parameter_gradient, index)))

    # -- the epoch

    def begin_epoch(self, epoch_trace):
        """Observe into this epoch's trace (a resumed epoch's holds what the earlier start saw; a new process
        starts with nothing expected of the gradients, as a resume comes at a window's end)."""
        self.epoch_trace, self.trace = epoch_trace, epoch_trace.checklist
        epoch_trace.replicated = self.unsharded is None
        if self.trace.micro_batches == 0:
            self.trace.state_steps_before = self.state_steps()

    def state_steps(self):
        """The optimizer's own count of its updates (AdamW's state 'step'), 0 before the first."""
        state = self.optimizer.state.get(self.parameters[0], {}) if self.optimizer is not None else {}
        return int(state["step"].item()) if "step" in state else 0

    def end_epoch(self):
        """Close the epoch (a sync no step followed is checked here) and return its observations for the row."""
        self.close_backward()
        if self.window_syncs:  # the same on every rank: the syncs were collectives
            self.observe(EPOCH_END, self.trace.micro_batches - 1)
            self.reduce_window()
        # A GPU by its own UUID (two ranks on one GPU share it, whatever their hosts are called).
        device = str(torch.cuda.get_device_properties(self.device).uuid) if self.device.type == "cuda" else "cpu"
        mine = (PROCESS_ID, device, self.summary())
        gathered = [None] * dist.get_world_size(self.exchange_group)
        dist.all_gather_object(gathered, mine, group=self.exchange_group)  # host objects (train.py's: default, gloo)
        # Every rank's observations; processes and devices counted, not named (a repeated run's row is the same).
        return {
            "processes": len({process for process, _, _ in gathered}),
            "devices": len({device for _, device, _ in gathered}),
            "device_type": self.device.type,
            "ranks": [observed for _, _, observed in gathered],
        }

    def summary(self):
        """This rank's observations of the epoch, for its row (one host read of what the device holds)."""
        return summarize(self.trace, self.state_steps())

    # -- the events

    def training(self):
        return self.module.training and torch.is_grad_enabled()

    def on_forward(self, module, positional, keywords):
        if not self.training():
            return
        self.close_backward()
        held = held_bytes(self.parameters, self.projection.whole)  # between micro-batches: what the window keeps
        self.epoch_trace.held_bytes = [max(pair) for pair in zip(self.epoch_trace.held_bytes, held)]
        self.trace.micro_batches += 1
        # The forward's batch: its first tensor argument's leading dimension (where none shows, its loss's targets
        # count for it); the samples behind a step are counted at the loss (on_loss).
        first = first_batched(positional, keywords)
        batch = first.shape[0] if first is not None else None
        self.trace.samples += batch or 0
        self.forward_batch, self.awaiting_loss = batch, True  # the criterion's next call is on this forward's output
        self.window[FORWARDS] += 1

    def on_loss(self, criterion, inputs, output):
        self.read_loss(inputs[0], inputs[1], output)

    def read_loss(self, logits, targets, output, ignore_index=IGNORE_INDEX):
        """A loss computed as the mean cross-entropy of `logits` against `targets` (or a multiple of it), its value
        `output`: read where it is the first after a training forward and its gradient will reach the logits."""
        if self.awaiting_loss and self.training() and logits.requires_grad:
            if self.forward_batch is None:
                self.trace.samples += targets.shape[0]
            elif targets.shape[0] < self.forward_batch:  # a loss over part of the forward's batch
                self.trace.loss_short.append(self.trace.micro_batches - 1)
            self.awaiting_loss = False
            self.window[SAMPLES] += targets.shape[0]
            # What the loop divides the loss's value by, exactly: the gradient that reaches it is 1 / divisor.
            self.loss.read(logits, targets, output, ignore_index)
            if self.counts_tokens:  # the targets that count, as the loss took them
                tokens = targets.ne(IGNORE_INDEX).sum()
                self.trace.micro_batch_tokens.append(tokens)
                self.window[TOKENS] += tokens
            logits.register_hook(partial(self.on_logits_gradient, logits.detach(), targets.detach(), ignore_index))

    def on_logits_gradient(self, logits, targets, ignore_index, gradient):
        """The backward's first event in the model: read the gradients' state, and the loss scale (loss_scale: the
        divisor read at the loss, and the gradient at the logits against the mean cross-entropy's, recomputed)."""
        index = self.trace.micro_batches - 1
        if self.unsharded is not None and not self.projection.whole:  # FSDP made them in the first forward
            made = self.unsharded()
            self.projection.whole = {id(p): made[id(p)] for p in self.parameters}
            self.hook([made[id(p)] for p in self.parameters])
        before = self.observe(BACKWARD, index)
        self.trace.backwards += 1
        self.trace.loss_positions.append(index)
        world_size = self.comm_audit.world_size
        token_scale, tokens = (world_size, self.trace.micro_batch_tokens[-1]) if self.counts_tokens else (None, None)
        read = self.loss.divisor(world_size, tokens)
        self.trace.loss_scales.append(loss_scale(logits, targets, gradient, token_scale, read, ignore_index))
        self.projection.begin_own()
        self.pending = (index, before, self.comm_audit.gradient_syncs)

    def on_parameter_gradient(self, index, gradient):
        """A parameter's gradient from this backward alone, before it is accumulated or synchronized: copied,
        projected with the others in one pass when the backward ends."""
        if self.pending is not None:
            self.projection.copy_own(index, gradient)

    def on_sync(self):
        """The hook's last bucket of a backward (DDP's replicas): read the synchronized gradient once DDP has written
        it, in autograd's final callbacks: DDP queues its own after this call, so a callback queued now queues the
        reader behind it. Read there, at the sync, a clip between the backward and the step cannot change it."""
        # FSDP's shards, and a hook run outside a backward (DDP's Join runs it in a forward): read at the next event.
        if self.unsharded is not None or torch._C._current_graph_task_id() == -1:
            return
        engine = torch.autograd.Variable._execution_engine
        engine.queue_callback(lambda: engine.queue_callback(self.read_synced))

    def read_synced(self):
        if self.pending is not None:  # a backward the witnesses saw begin (at the logits)
            self.synced_read = self.projection.held()[0]
            self.window[SYNCED_F] += self.synced_read[0]

    def on_clip(self, clipped, factor):
        """torch scaled the gradients of `clipped` (parameter ids) to a norm, by `factor`: expected at the step of
        the window's synchronized gradient, read and untouched since, when every gradient the model holds was
        clipped; anywhere else (local gradients, part of the model, a backward next) the next read finds them
        altered."""
        self.close_backward()
        if isinstance(factor, DTensor):  # clip_grad_norm_ over FSDP's shards: its total norm is every rank's
            factor = factor.full_tensor()
        held = {id(p) for p in self.parameters if p.grad is not None}
        if self.expectation == ("synced",) and held and held <= clipped and torch.isfinite(factor):
            # FSDP's shards, first read here, clipped already: the synchronized gradient is what they hold over the
            # factor; what the step must take, what they hold.
            now, _, sharded = self.projection.held()
            factor = factor.to(self.device, torch.float64)
            self.window[SYNCED_F] += now[0] / factor
            self.clipped, self.clippable = (*self.as_read(now, sharded), factor), True
            return
        if self.clippable and held and held <= clipped and torch.isfinite(factor):
            _, expected, bound, norm, so_far = self.clipped or (*self.expectation, 1.0)
            factor = factor.to(self.device, torch.float64)
            # A shard's projection weighs world_size (Projection.held): so does its rounding.
            rounding = self.gradient_rounding(norm * factor) * (self.comm_audit.world_size if self.held_shards else 1)
            self.clipped = ("local", expected * factor, bound * factor + rounding, norm * factor, so_far * factor)

    def on_step_begin(self, optimizer, step_args, step_kwargs):
        self.observe(STEP, self.trace.micro_batches - 1)
        self.reduce_window()

    def on_step_end(self, optimizer, step_args, step_kwargs):
        """A step follows the last backward that began (a step between a forward and its backward belongs to
        the micro-batch before, and is recorded as such too)."""
        forward = self.trace.micro_batches - 1
        if self.trace.backwards < self.trace.micro_batches:
            self.trace.steps_before_backward.append(forward)
        self.epoch_trace.step_positions.append(self.trace.backwards - 1 if self.trace.backwards else forward)

    # -- the gradients' state

    def close_backward(self):
        """The backward under way has ended (the next event came): did it synchronize (the hook saw its last
        bucket), and what must the gradients hold now?"""
        if self.pending is None:
            return
        index, (before, sharded), syncs_before = self.pending
        self.pending = None
        own = self.projection.own_projection()
        # The local gradients now: before + this backward's own; their 2-norm at most the norms' sum. A shard of
        # the synced gradient held before weighs world_size (its sum over ranks is the whole).
        weight = self.comm_audit.world_size if sharded else 1  # a shard's F comes weighed; its norm part not yet
        local = torch.stack([before[0] + own[0], before[1].sqrt() * weight + own[1].sqrt()])
        if self.comm_audit.gradient_syncs != syncs_before:
            self.epoch_trace.sync_positions.append(index)
            self.window[LOCAL_F : LOCAL_NORM + 1] += local
            self.window[SYNCS] += 1
            self.window_syncs += 1
            self.wire_dtype = self.comm_audit.wire_dtype or torch.float32
            self.expectation = ("synced",)
            if self.synced_read is not None:  # read as the backward ended: from here on it must stay as read
                self.expectation = self.as_read(self.synced_read, sharded=False)
                self.synced_read, self.clippable = None, True
        else:  # accumulated locally in the gradients' dtype: each element rounded once, |e| <= u |local|, projected
            bound = self.gradient_rounding(local[1])
            self.expectation = ("local", local[0], bound, local[1])

    def observe(self, point, index):
        """Read the gradients at `point` of micro-batch `index`: fresh (None or all zero: a reset, whatever made
        it), or not what the last backward left (altered). Returns [F, Q] now."""
        self.close_backward()
        now, none_held, sharded = self.projection.held()
        fresh = torch.ones((), dtype=torch.bool, device=self.device) if none_held else now[1] == 0
        off = torch.zeros((), dtype=torch.bool, device=self.device)
        if point == STEP and self.clipped is not None:  # the synchronized gradient clipped: the step's to take
            self.expectation, factor = self.clipped[:4], self.clipped[4]
            self.trace.clip_factors.append(factor)
        self.clipped = None
        if self.expectation is not None and self.expectation[0] == "local":
            _, expected, bound, _ = self.expectation
            off = ~fresh & ((now[0] - expected).abs() > bound)
        elif self.expectation is not None and self.expectation[0] == "synced":
            self.window[SYNCED_F] += now[0]
        self.trace.state_points.append((point, index))  # on the host: no copy to the device
        self.trace.gradient_states.append(torch.stack([fresh, off]))
        self.expectation, self.clippable = self.as_read(now, sharded), False
        return now, sharded

    def gradient_rounding(self, norm):
        """The projection's bound on gradients of 2-norm at most `norm` whose every element was rounded once in the
        gradients' dtype (|e| <= u |g|: accumulated, or scaled by a clip), with the float64 dot products' own rounding."""
        return norm * (SIGMAS * self.gradient_unit + 3 * self.projection.dot_slack)

    def as_read(self, now, sharded):
        """From here on the gradients must stay as read (only a reset or a backward may change them): the same
        values projected again give the same sum, within the float64 sum's own rounding."""
        weight = self.comm_audit.world_size if sharded else 1
        self.held_shards = sharded
        norm = now[1].sqrt()
        return ("local", now[0], norm * 2 * self.projection.dot_slack * weight, norm)

    def reduce_window(self):
        """One SUM all-reduce of the window's local projections, samples, forwards and syncs (counted as the
        audit's witness_allreduces): the synced gradient must be the mean of the ranks' local gradients."""
        world_size = self.comm_audit.world_size
        summed = self.window.clone()
        with record_function(AVERAGE_WITNESS_LABEL):
            dist.all_reduce(summed, group=self.comm_audit.group)
        self.comm_audit.witness_allreduces += 1
        # Per element the hook's arithmetic (cast, divide, sum on the wire's dtype) errs by at most world_size + 2
        # roundings of the mean of magnitudes, plus half a gap where a value is flushed to zero: an error vector
        # e with |e| <= (W + 2) u sum_r |L_r| / W + (W + 1) h sqrt(n). Its projection on the fixed Gaussian
        # weights, drawn independently of the run, is N(0, |e|^2): SIGMAS standard deviations bound it
        # (docs/audit.md); the float64 dot products' own rounding beside it.
        wire = torch.finfo(self.wire_dtype)
        unit, gap = UNIT_ROUNDOFF[self.wire_dtype], wire.smallest_normal * wire.eps / 2  # half the subnormal gap
        slack, elements = self.projection.dot_slack, self.projection.elements
        bound = (SIGMAS * (world_size + 2) * unit + 3 * slack) * summed[LOCAL_NORM] / world_size + SIGMAS * (
            world_size + 1
        ) * gap * math.sqrt(elements) * summed[SYNCS]
        # A replica's synced gradient is its own to compare (a rank that reset it is named at its item); shards
        # make the whole only together.
        mean = summed[LOCAL_F] / world_size
        synced = self.window[SYNCED_F].clone() if self.unsharded is None else summed[SYNCED_F] / world_size
        counted = [*summed[SAMPLES : FORWARDS + 1], *summed[TOKENS:]]
        self.trace.averages.append(torch.stack([synced, mean, bound, *counted]))  # SYNCED .. STEP_TOKENS
        self.window.zero_()
        self.window_syncs = 0


def summarize(trace, state_steps):
    """One rank's observations of the epoch, for the row's `checklist` (one host read of everything it kept on
    the device); `state_steps` is the optimizer state's count now."""
    scales = torch.stack(trace.loss_scales).tolist() if trace.loss_scales else []
    states = torch.stack(trace.gradient_states).tolist() if trace.gradient_states else []
    averages = torch.stack(trace.averages).tolist() if trace.averages else []
    deviation = residual = 0.0
    for fitted, off, read in scales:  # the fit at the logits against the divisor recorded
        recorded = recorded_divisor(fitted, read)
        off_divisor = abs(fitted / recorded - 1) if recorded else math.inf
        deviation = max(deviation, off_divisor if math.isfinite(off_divisor) else math.inf)
        residual = max(residual, off if math.isfinite(off) else math.inf)
    off_average = [
        {"optimizer_step": number, "synced": step[SYNCED], "mean_of_ranks": step[MEAN], "bound": step[BOUND]}
        for number, step in enumerate(averages, 1)
        if not abs(step[SYNCED] - step[MEAN]) <= step[BOUND]
    ]

    def positions(keep):
        observed = zip(trace.state_points, states)
        return experiment.as_progressions(
            [index for (point, index), (fresh, off) in observed if keep(point, fresh, off)]
        )

    present = {}  # only where seen: the clipped steps' factors (train.py clips nothing); the text task's tokens
    if trace.clip_factors:
        present["clip_factors"] = torch.stack(trace.clip_factors).tolist()
    if trace.micro_batch_tokens:  # per micro-batch on this rank, per step over every rank
        present["micro_batch_tokens"] = runs_of(torch.stack(trace.micro_batch_tokens).tolist())
        present["step_tokens"] = runs_of([int(step[STEP_TOKENS]) for step in averages])
    return {
        **present,
        "micro_batches": trace.micro_batches,
        "samples": trace.samples,
        "backwards": trace.backwards,
        "backward_starts": positions(lambda point, fresh, off: point == BACKWARD),
        "fresh_at_backward": positions(lambda point, fresh, off: point == BACKWARD and fresh),
        "fresh_at_step": positions(lambda point, fresh, off: point != BACKWARD and fresh),
        "altered_at": positions(lambda point, fresh, off: off),
        "loss_divisors": divisor_runs(trace.loss_positions, scales),
        "loss_scale_deviation": deviation if math.isfinite(deviation) else None,
        "loss_scale_residual": residual if math.isfinite(residual) else None,
        "loss_short_of_samples": trace.loss_short,
        "step_samples": runs_of([int(step[STEP_SAMPLES]) for step in averages]),
        "step_micro_batches": runs_of([int(step[STEP_FORWARDS]) for step in averages]),
        "averages_checked": len(averages),
        "first_average_off": off_average[0] if off_average else None,
        "optimizer_state_steps": state_steps - trace.state_steps_before,
        "steps_before_backward": trace.steps_before_backward,
    }
