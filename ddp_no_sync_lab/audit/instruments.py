"""The audit's instruments, beside the wrapper in every rank: the collective clock and the running counts, the
ranks' step fingerprints, the epoch's trace of where syncs and steps happened, which samples the ranks read. The
counting hook itself is in train.py, where the lesson is; DDP's own collectives are counted by
strategies/ddp.py's AuditedDDP."""

import functools
import hashlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from ddp_no_sync_lab.audit.checklist import ChecklistTrace
from ddp_no_sync_lab.audit.memory import local
from ddp_no_sync_lab.audit.orders import ORDERS
from ddp_no_sync_lab.experiment import COUNTS


def read_clock(device):
    """The wall clock once the device has finished the work queued so far (on GPU the host runs ahead)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


# The collectives the clock also times call by call (the gradient syncs: DDP's hook calls, FSDP's reduce-scatters;
# FSDP's all-gathers), so that an epoch's row can tell the link's time from the ranks' wait for one another.
PER_CALL_KINDS = ("sync", "all_gather")


class CollectiveClock:
    """Seconds from collectives' start to their completion on the device, summed; the syncs and all-gathers also
    call by call, while `per_call` (FSDP's evaluation turns it off: its all-gathers are not training's).

    On CPU, gloo has finished a collective when its future's callback runs: wall time. On GPU the host only
    queues NCCL's work: CUDA events on the stream, read after a synchronize at the epoch's end. Callbacks of
    several buckets can run at once on gloo's threads, so the sums are taken under a lock.
    """

    def __init__(self, device_type="cpu"):
        self.on_cuda = device_type == "cuda"
        self.lock = threading.Lock()
        self.seconds = 0.0
        self.per_call = True
        self.calls = {kind: [] for kind in PER_CALL_KINDS}  # since take_calls: (order, seconds) of each call
        self.started = 0  # calls started so far: each call's place in the order they were made
        self.event_pairs = []  # on GPU: (kind, order, start, end) events not yet read

    def start(self):
        """stop()'s token: the call's place in the order the calls were made (their callbacks can complete in
        another order on each rank), and its start."""
        with self.lock:
            self.started += 1
            order = self.started
        if self.on_cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return order, event
        return order, time.perf_counter()

    def stop(self, started, kind="other"):
        order, stamp = started
        kind = kind if self.per_call else "other"
        if self.on_cuda:
            ended = torch.cuda.Event(enable_timing=True)
            ended.record()  # in a future's callback, after the collective on its stream
            with self.lock:
                self.event_pairs.append((kind, order, stamp, ended))
            return
        self.add(kind, time.perf_counter() - stamp, order)

    def add(self, kind, elapsed, order=0):
        with self.lock:
            self.seconds += elapsed
            if kind in self.calls:
                self.calls[kind].append((order, elapsed))

    def total(self):
        if self.event_pairs:
            torch.cuda.synchronize()
            with self.lock:
                pairs, self.event_pairs = self.event_pairs, []
            for kind, order, start, end in pairs:
                self.add(kind, start.elapsed_time(end) / 1000, order)
        with self.lock:
            return self.seconds

    def take_calls(self):
        """Each sync's and all-gather's seconds since the last take, in the order the calls were made."""
        self.total()
        with self.lock:
            calls, self.calls = self.calls, {kind: [] for kind in PER_CALL_KINDS}
        return {kind: [elapsed for _, elapsed in sorted(timed)] for kind, timed in calls.items()}

    def seconds_and_waits(self, device, group):
        """Since the last call, for the syncs and then the all-gathers: this rank's seconds in them and, of those,
        its wait: in each call, its time beyond the least any rank spent there (that rank came last; the rest
        waited for it). Every rank made the same calls in the same order, or the run is broken: then this stops."""
        calls = list(self.take_calls().values())
        sizes = [len(kind) for kind in calls]
        bounds = torch.tensor(sizes + [-size for size in sizes], device=device)  # the most and, negated, the fewest
        dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=group)
        if bounds[: len(sizes)].tolist() != (-bounds[len(sizes) :]).tolist():
            raise RuntimeError(
                f"the ranks timed different numbers of syncs or all-gathers in an epoch: {bounds.tolist()}"
            )
        durations = torch.tensor([seconds for kind in calls for seconds in kind], dtype=torch.float64, device=device)
        least = durations.clone()
        dist.all_reduce(least, op=dist.ReduceOp.MIN, group=group)
        pairs = zip(durations.split(sizes), least.split(sizes))
        return [value for mine, fewest in pairs for value in (mine.sum().item(), (mine - fewest).sum().item())]


# torch's compressing gradient hooks, by train.py's --comm-hook name: each casts the bucket, all-reduces the
# cast and writes the mean back (experiment.SENT_ELEMENT_BYTES says what each sends).
COMPRESSION_HOOKS = {
    "bf16": default_hooks.bf16_compress_hook,
    "fp16": default_hooks.fp16_compress_hook,
}


@dataclass
class CommAudit:
    """Per-rank running totals of what crosses between the ranks during training and evaluation."""

    world_size: int
    group: object = None  # the training collectives' process group (None: the default group)
    comm_hook: str = "allreduce"  # the gradient hook the counting hook runs (experiment.COMM_HOOKS)
    find_unused_parameters: bool = False  # DDP's settings that add an all-reduce no hook sees
    static_graph: bool = False
    clock: CollectiveClock = field(default_factory=CollectiveClock)
    sync_bucket_calls: int = 0
    gradient_syncs: int = 0
    allreduce_bytes: int = 0
    buffer_broadcast_collectives: int = 0
    broadcast_bytes: int = 0
    rebuild_broadcast_collectives: int = 0
    used_map_allreduces: int = 0
    witness_allreduces: int = 0  # audit/checklist.py's, one per optimizer step: the synced gradient against the mean
    wire_dtype: torch.dtype = None  # the dtype the hook last handed to the collective (audit/tap.py)
    wrapper_syncs: int = 0  # this wrapper's own (a resumed run's totals include its predecessors')
    all_gathers: int = 0  # FSDP's collectives (strategies/fsdp.py), read from the calls
    all_gather_bytes: int = 0
    reduce_scatters: int = 0
    reduce_scatter_bytes: int = 0
    awaiting_sync: bool = False  # FSDP: a training forward ran, its backward's first reduce-scatter is a sync
    on_sync: Callable[[], None] | None = None  # the checklist's witness, told of each sync as it is counted

    def count_sync(self):
        """One synchronized backward ended (its last bucket's hook call); with it DDP's all-reduce of which
        parameters got gradients, which no hook sees: at every sync while it searches for unused parameters, at
        the wrapper's first under a static graph (tests/workers/comm_audit.py checks it against the profiler)."""
        self.gradient_syncs += 1
        self.wrapper_syncs += 1
        if self.on_sync is not None:
            self.on_sync()
        if self.static_graph:
            self.used_map_allreduces += self.wrapper_syncs == 1
        else:
            self.used_map_allreduces += self.find_unused_parameters

    def count_handed(self, handed):
        """The (dtype, element count) of each tensor a hook call handed to the collective (audit/tap.py)."""
        self.allreduce_bytes += sum(numel * dtype.itemsize for dtype, numel in handed)
        self.wire_dtype = handed[-1][0] if handed else None

    def totals(self):
        totals = {name: getattr(self, name) for name in COUNTS}
        totals["comm_seconds"] = self.clock.total()
        return totals


# The step fingerprint: for each of two primes below 2**31, the sum over all values of (the value's float32 bit
# pattern) x (a weight of its position), modulo the prime. Integer sums are exact, so ranks that hold the same
# values agree whatever their summation order or thread count; a value changed by one ulp, or two different
# values swapped, change it.
FINGERPRINT_PRIMES = (2_147_483_647, 2_147_483_629)
FINGERPRINT_MULTIPLIERS = (1, 48_271)


@functools.cache
def fingerprint_weights(count, device):
    """Each lane's position weights: (position x multiplier) mod prime, distinct and non-zero for every
    position below the prime."""
    positions = torch.arange(1, count + 1, dtype=torch.int64, device=device)
    return [positions * multiplier % prime for prime, multiplier in zip(FINGERPRINT_PRIMES, FINGERPRINT_MULTIPLIERS)]


def fingerprint(tensors):
    """[lane 1, lane 2, non-finite values] of the tensors (each rank's own shard of FSDP's), an int64 device tensor
    (no host read)."""
    flat = torch.cat([local(tensor).detach().reshape(-1) for tensor in tensors]).float()
    bits = flat.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    weights = fingerprint_weights(flat.numel(), flat.device)
    # bits < 2**32 and weight < prime < 2**31: their product fits in int64, so one reduction per lane suffices.
    lanes = [(bits * weight % prime).sum() % prime for prime, weight in zip(FINGERPRINT_PRIMES, weights)]
    return torch.stack([*lanes, (~torch.isfinite(flat)).sum()])


def before_step(parameters):
    """The gradients' and the parameters' fingerprints just before optimizer.step()."""
    return fingerprint(p.grad for p in parameters if p.grad is not None), fingerprint(parameters)


class Verdicts(NamedTuple):
    """ranks_agree's verdicts on one optimizer step, in the order of its device tensor."""

    gradients_agreed: bool
    parameters_agreed: bool
    gradients_finite: bool
    parameters_finite: bool
    parameters_changed: bool
    stop_requested: bool


STOP_REQUESTED = Verdicts._fields.index("stop_requested")  # read on the device where a save reads the request


def ranks_agree(before, parameters, group, stop_requested=False):
    """One small all-reduce after optimizer.step(): did every rank step on the same gradients, end with the same
    parameters, hold only finite values, did the step change its parameters, and does a rank ask to stop?

    The maxima of the values and of their negatives give each value's maximum and minimum over the ranks: a
    fingerprint lane is agreed where they are equal. Returns a device tensor [gradients agreed, parameters
    agreed, gradients finite, parameters finite, parameters changed, a rank asked to stop] (Verdicts), read once per epoch
    (and where a save reads it: run/resume.py).
    """
    gradients, parameters_before = before
    after = fingerprint(parameters)
    unchanged = (after[:2] == parameters_before[:2]).all()  # on the device: torch.equal would read it on the host
    # The request as a fill on the device: a tensor made from a host value would be a host-to-device copy per step.
    flags = torch.stack([unchanged.to(torch.int64), torch.full((), int(stop_requested), device=unchanged.device)])
    mine = torch.cat([gradients, after, flags])
    extremes = torch.cat([mine, -mine])
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
    highest, lowest = extremes[: mine.numel()], -extremes[mine.numel() :]
    agreed = highest == lowest
    return torch.stack(
        [agreed[0:2].all(), agreed[3:5].all(), highest[2] == 0, highest[5] == 0, highest[6] == 0, highest[7] > 0]
    )


def settle_comm_hooks():
    """Wait until gloo's threads are done with the hook's Python callbacks, before the groups are torn down.

    A gloo thread needs the GIL to drop a finished callback, and a main thread that destroys a
    ProcessGroupGloo holds the GIL while it joins those threads: torn down right after a hooked all-reduce,
    a process can hang at exit (seen here about one run in three). The barrier waits for every earlier
    collective; the sleep releases the GIL so that the threads finish with their callbacks. Under load that may
    not be enough: train.py bounds the teardown itself (launch.bounded_teardown).
    """
    dist.barrier()
    time.sleep(0.1)


@dataclass
class EpochTrace:
    """Where one rank's epoch synchronized and stepped, what each step did, and which samples the ranks read."""

    saved_activation_bytes: int = 0  # held from micro-batch 0's forward for its backward (saved_activations)
    # Filled by audit/checklist.py's witnesses from what happened: the backwards the hook saw synchronize, the
    # optimizer's own step hooks, and the rest of the checklist's observations.
    sync_positions: list = field(default_factory=list)  # micro-batches whose backward synchronized
    step_positions: list = field(default_factory=list)  # micro-batches after which the optimizer stepped
    checklist: ChecklistTrace = field(default_factory=ChecklistTrace)
    checklist_summary: dict = None  # the epoch's observations, read once at its end (Witness.end_epoch)
    replicated: bool = True  # DDP's replicas; FSDP's shards (set by the witness) have no copies to compare
    held_bytes: list = field(default_factory=lambda: [0, 0])  # most gradient, parameter bytes between micro-batches
    agreement: list = field(default_factory=list)  # per step, on the device: ranks_agree's Verdicts
    sample_shards: dict = field(default_factory=dict)  # shard_coverage's, once the epoch is over

    def step_verdicts(self):
        """From ranks_agree's verdicts (one host read): the steps at which the ranks agreed and the first at which
        they did not, the first step with non-finite values, and the steps that changed the parameters."""
        verdicts = [Verdicts(*verdict) for verdict in torch.stack(self.agreement).tolist()] if self.agreement else []
        first_disagreement = first_nonfinite = None
        for step, verdict in enumerate(verdicts, 1):
            nonfinite = [
                name
                for name, ok in (("gradients", verdict.gradients_finite), ("parameters", verdict.parameters_finite))
                if not ok
            ]
            differed = [
                name
                for name, ok in (("gradients", verdict.gradients_agreed), ("parameters", verdict.parameters_agreed))
                if not ok
            ]
            if nonfinite and first_nonfinite is None:
                first_nonfinite = {"optimizer_step": step, "in": nonfinite}
            if differed and first_disagreement is None and self.replicated:
                first_disagreement = {"optimizer_step": step, "differed": differed}
        agreed = sum(verdict.gradients_agreed and verdict.parameters_agreed for verdict in verdicts)
        return {
            "steps_with_ranks_agreed": agreed if self.replicated else None,
            "first_rank_disagreement": first_disagreement,
            "first_nonfinite_step": first_nonfinite,
            "steps_that_changed_parameters": sum(verdict.parameters_changed for verdict in verdicts),
        }


def shard_coverage(sampler, split_size):
    """Which samples the ranks read this epoch, as their samplers handed them to the loaders (audit/orders.py),
    gathered from every rank over the default group (CPU): how many each read, how many distinct ones all read
    together, of how many in the split, and the epoch's order over the ranks as a fingerprint (an epoch that read
    an earlier one's order shows its fingerprint again). Disjoint shards that cover the split read split_size
    distinct samples (DistributedSampler pads with repeats to equal shards)."""
    indices = torch.tensor(ORDERS.delivered(sampler), dtype=torch.int64)
    gathered = [torch.empty_like(indices) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, indices)
    read = torch.cat(gathered)
    inside = read[(read >= 0) & (read < split_size)]
    return {
        "samples_per_rank": indices.numel(),
        "distinct_samples": inside.unique().numel(),
        "split_size": split_size,
        "order": hashlib.sha256(read.numpy().tobytes()).hexdigest()[:16],
    }
