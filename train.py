"""Gradient accumulation under DDP, two ways, with every synchronization counted.

    torchrun --standalone --nnodes=1 --nproc-per-node=2 train.py --mode every   --output artifacts/every
    torchrun --standalone --nnodes=1 --nproc-per-node=2 train.py --mode no_sync --output artifacts/no_sync
    python verify.py

Two machines, one process each: the same command on both (README "Across machines"):

    torchrun --nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint=HOST_A:29500
             --rdzv-id=lab-every train.py --mode every --output artifacts/every

`every` all-reduces the gradients after every micro-batch and steps once per window of --accum-steps;
`no_sync` runs the forward AND backward of the first accum_steps - 1 micro-batches of each window inside
ddp_model.no_sync(), so DDP all-reduces once per window. A communication hook counts the syncs, their bytes
and time; an AuditedDDP counts DDP's own BatchNorm buffer broadcasts, which no hook sees.

Data come from data.py: by default (--loader tensor) decoded once, held on the training device and augmented
there in whole batches; --loader pil is the document's per-image PIL pipeline.

The document's next experiments: --profile-windows K records K windows of epoch 1 with the PyTorch profiler,
a second witness that verify.py holds against the audit; --activation-checkpointing recomputes the CNN's
stages in the backward (model.STAGES), with the same gradients, BatchNorm statistics and communication.

Measured (2 CPU ranks on 2 cores, gloo, BF16 autocast, channels_last, tensor loader, real CIFAR-10 as JPEG,
documented settings; per rank, totals over 5 epochs; README.md "Measured results" has the whole table):

    | mode    | steps/epoch | syncs/epoch | all-reduce MB | buffer-broadcast collectives | epoch s | test accuracy |
    | every   | 100         | 400         | 4468.3        | 4002                         | 432.8   | 0.7063        |
    | no_sync | 100         | 100         | 1117.1        | 1002                         | 419.5   | 0.7084        |

(whole-run epoch seconds vary with the shared machine: 334 to 501 s in six runs per mode.)

Stdout carries one JSON line per epoch and the final report (rank 0); progress goes to stderr.
"""
import os

# cuBLAS refuses deterministic mode without a fixed workspace; it must be set before CUDA initializes.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import json
import random
import socket
import sys
import tempfile
import threading
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from PIL import Image
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile, record_function, schedule

import data
import lab
import plots
from precision import PRECISIONS, choose_precision
from model import CLASSES, MEMORY_FORMAT, CifarCNN

SCRIPT = "train.py"
# Bounds a wait on a stuck (alive but silent) peer, each node's CIFAR-10 download (163 MB) included. A peer
# that dies is noticed at once: torchrun stops the other processes of its node, and the closed gloo
# connections stop the other nodes' processes.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)

class ArgumentParser(lab.ArgumentParser):
    """Raises its one-line error instead of exiting: under torchrun a node whose options do not parse must
    first tell the other nodes, or they would wait for it in the first collective until the timeout."""

    def error(self, message):
        raise self.usage_error(message)


def parse_args(argv=None):
    documented = lab.DOCUMENTED
    parser = ArgumentParser(prog=SCRIPT, description="Train CifarCNN under DDP in one accumulation mode.")
    parser.add_argument("--mode", choices=lab.MODES, required=True)
    parser.add_argument("--output", type=Path, required=True, help="run folder to write, e.g. artifacts/every")
    parser.add_argument("--epochs", type=lab.positive_int, default=documented["epochs"])
    parser.add_argument("--batch-size", type=lab.positive_int, default=documented["batch_size"], help="per rank")
    parser.add_argument("--accum-steps", type=lab.positive_int, default=documented["accum_steps"])
    parser.add_argument("--seed", type=int, default=documented["seed"])
    parser.add_argument("--expected-world-size", type=lab.positive_int, default=documented["world_size"])
    parser.add_argument(
        "--partial-window",
        choices=lab.PARTIAL_WINDOW_POLICIES,
        default=documented["partial_window"],
        help="a last window shorter than --accum-steps: stop (error) or divide its losses by its length (scale)",
    )
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="auto",
        help="auto: BF16 autocast where the device computes BF16 natively, float32 elsewhere (precision.py)",
    )
    parser.add_argument(
        "--loader",
        choices=data.LOADERS,
        default="tensor",
        help="tensor: images decoded once and augmented in batch on the training device; pil: the document's "
        "per-image PIL pipeline (data.py)",
    )
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=Path("data"),
        help="train/<class>/ and test/<class>/ image folders, or torchvision's CIFAR-10 (downloaded if absent)",
    )
    parser.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="recompute each stage of the CNN in the backward (torch.utils.checkpoint, non-reentrant) instead of "
        "keeping its activations: less memory, more compute, the same gradients and BatchNorm statistics",
    )
    parser.add_argument(
        "--profile-windows",
        type=lab.positive_int,
        metavar="K",
        help="profile K accumulation windows of epoch 1 (after one skipped and one of warm-up) with the PyTorch "
        "profiler: a trace and a summary in the run folder, checked by verify.py against the audit",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.add_argument(
        "--progress-every", type=lab.non_negative_float, default=5.0, metavar="SECONDS", help="seconds between progress lines"
    )
    return parser.parse_args(argv)


# ----------------------------------------------------------------------------- processes, nodes and devices


@dataclass(frozen=True)
class Place:
    """Where this process runs, as torchrun says: its global and local rank and its node (GROUP_RANK)."""

    rank: int
    local_rank: int
    node: int
    world_size: int
    local_world_size: int
    nodes: int


def launch_environment(expected_world_size):
    """This process's Place under torchrun; plain python is world size 1 and is refused. None: any size."""
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if world_size != (expected_world_size or world_size) or "RANK" not in os.environ:
        raise lab.LabError(
            f"expected world_size={expected_world_size}, got {world_size} (start it with torchrun: "
            f"torchrun --standalone --nnodes=1 --nproc-per-node={expected_world_size} train.py --mode ... "
            f"--output ...)",
            kind="ValueError",
        )
    return Place(
        rank=int(os.environ["RANK"]),
        local_rank=int(os.environ["LOCAL_RANK"]),
        node=int(os.environ.get("GROUP_RANK", 0)),
        world_size=world_size,
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", world_size)),
        nodes=int(os.environ.get("GROUP_WORLD_SIZE", 1)),
    )


def choose_device(requested, place):
    """'cuda' or 'cpu': lab.node_device's policy for --device auto; never NCCL quietly swapped for gloo."""
    policy, visible = lab.node_device(place.local_world_size)
    if requested == "auto":
        requested = policy
        if requested == "cpu" and place.local_rank == 0:
            print(
                f"{SCRIPT}: {visible} GPU(s) visible for {place.local_world_size} process(es) on node {place.node}; "
                f"running on CPU with the gloo backend",
                file=sys.stderr,
            )
    if requested == "cuda" and visible < place.local_world_size:
        raise lab.LabError(
            f"--device cuda needs one GPU per process: {place.local_world_size} processes on this node, {visible} "
            f"GPU(s) visible (check nvidia-smi and CUDA_VISIBLE_DEVICES, or run on CPU with --device cpu)"
        )
    return requested


def check_output(output):
    """Fail before any training if the run folder cannot be written or would overwrite something not ours."""
    if output.exists() and not output.is_dir():
        raise lab.LabError(f"--output {output} is a file; pass a folder path, e.g. --output artifacts/every")
    if not lab.is_replaceable_output(output):
        raise lab.LabError(
            f"--output {output} holds files that are not lab artifacts; pass a new or empty folder "
            f"(train.py replaces the whole folder it writes)"
        )
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=output.parent, prefix=f".{output.name}.probe-"):
            pass
    except OSError as error:
        raise lab.LabError(
            f"--output {output} is not writable ({error.strerror}: {error.filename}); pass a folder you can write to"
        ) from None


# ----------------------------------------------------------------------------- agreement between the ranks
# Before any training collective every rank must know that the others can go on, on the same settings,
# device and data: a rank that stopped alone would leave the others waiting in a collective until the
# timeout, and ranks on different data would train on different things without a word. Each step below runs
# on every rank, then the ranks exchange (over the gloo group, on every device) what happened.


def ranks_label(rank, node):
    return f"[rank {rank}, node {node}]"


def agree(place, step):
    """Run step() here; if it raised a LabError on any rank, every rank raises one for the first of them.

    An error that every rank met alike stays as it is; one met by some ranks only names its rank and node.
    """
    try:
        value, failure = step(), None
    except lab.LabError as error:
        value, failure = None, (str(error), error.kind)
    outcomes = [None] * place.world_size
    dist.all_gather_object(outcomes, (place.rank, place.node, failure))
    failed = [(rank, node, failure) for rank, node, failure in outcomes if failure is not None]
    if failed:
        rank, node, (message, kind) = failed[0]
        if len(failed) == place.world_size and len({failure for _, _, failure in failed}) == 1:
            raise lab.LabError(message, kind)
        raise lab.LabError(f"{ranks_label(rank, node)} {message}", kind)
    return value


def require_same(place, claims, what, remedy):
    """Every rank's claims (a dict) must equal rank 0's; else every rank stops naming the first that differs."""
    gathered = [None] * place.world_size
    dist.all_gather_object(gathered, (place.rank, place.node, claims))
    _, _, reference = gathered[0]
    for rank, node, theirs in gathered[1:]:
        differences = [f"{key} {theirs[key]} vs {reference[key]}" for key in reference if theirs[key] != reference[key]]
        if differences:
            raise lab.LabError(f"{ranks_label(rank, node)} {what} from rank 0's: {'; '.join(differences)}; {remedy}")


def shared_settings(args):
    """The options that must be the same on every node (--output and --data-dir are each node's own)."""
    return {
        f"--{name.replace('_', '-')}": getattr(args, name)
        for name in (
            "mode", "epochs", "batch_size", "accum_steps", "seed", "expected_world_size", "partial_window", "device", "loader",
            "precision", "activation_checkpointing", "profile_windows",
        )
    }


def start_up(args, place):
    """Settings, device, precision, output and data, agreed by every rank before training. Returns (device,
    precision, the hardware of every node, data source)."""

    def settle_here():
        device_type = choose_device(args.device, place)
        if place.rank == 0:  # only the rank that writes the artifacts touches the output folder
            check_output(args.output)
        return device_type

    device_type = agree(place, settle_here)
    if place.nodes > 1:  # torchrun numbers the nodes itself: say where the artifacts will be
        writer = [(socket.gethostname(), str(args.output.resolve()))]
        dist.broadcast_object_list(writer, src=0)
        if place.local_rank == 0:
            host, output = writer[0]
            print(f"{SCRIPT}: node {place.node} of {place.nodes}; rank 0 writes the artifacts on {host} into {output}", file=sys.stderr)
    require_same(
        place, shared_settings(args), "its train.py options differ", "start train.py with the same options on every node"
    )
    require_same(
        place,
        {"device": device_type},
        "its device differs",
        "give every node one GPU per process, or pass --device cpu on every node",
    )
    if device_type == "cuda":
        torch.cuda.set_device(place.local_rank)
    device = torch.device(device_type, place.local_rank if device_type == "cuda" else None)
    precision, hardware = agree_on_precision(args, place, device)
    # One process per node fetches the data for its node; the node's other processes wait here for it.
    agree(place, lambda: data.prepare_data(args.data_dir) if place.local_rank == 0 else None)
    source = agree(place, lambda: data.load_data(args.data_dir))
    require_same(
        place,
        source.summary(),
        f"its data in {args.data_dir}/ differ",
        "give every node the same copy of the dataset",
    )
    return device, precision, hardware, source


def agree_on_precision(args, place, device):
    """Every rank's --precision decision must be rank 0's: nodes of unlike CPUs would otherwise train in
    different numerics under `auto`. Returns the Precision and the distinct hardware of all ranks."""
    precision = agree(place, lambda: choose_precision(args.precision, device))
    gathered = [None] * place.world_size
    dist.all_gather_object(gathered, (place.rank, place.node, precision))
    reference = gathered[0][2]
    for rank, node, theirs in gathered[1:]:
        if theirs.name != reference.name:
            raise lab.LabError(
                f"{ranks_label(rank, node)} its precision differs from rank 0's: {theirs.name} on a {theirs.hardware} "
                f"vs {reference.name} on a {reference.hardware}; pass the same --precision on every node (fp32 runs "
                f"at full speed anywhere, bf16 only where every node has BF16 instructions)"
            )
    if place.local_rank == 0:
        print(f"{SCRIPT}: precision: {precision.reason}", file=sys.stderr)
    return precision, sorted({theirs.hardware for _, _, theirs in gathered})


@contextmanager
def c_stdout_to_stderr():
    """gloo prints its connection lines on the C++ stdout; send them to stderr, stdout is for the JSON lines."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def seed_everything(seed):
    random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)
    torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True)


# ----------------------------------------------------------------------------- the audit


def read_clock(device):
    """The wall clock once the device has finished the work queued so far (on GPU the host runs ahead)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class CollectiveClock:
    """Seconds from collectives' start to their completion on the device, summed.

    On CPU, gloo has finished a collective when its future's callback runs: wall time. On GPU the host only
    queues NCCL's work: CUDA events on the stream, read after a synchronize at the epoch's end. Callbacks of
    several buckets can run at once on gloo's threads, so the sum is taken under a lock.
    """

    def __init__(self, device_type="cpu"):
        self.on_cuda = device_type == "cuda"
        self.lock = threading.Lock()
        self.seconds = 0.0
        self.event_pairs = []  # on GPU: (start, end) events not yet read

    def start(self):
        if self.on_cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def stop(self, started):
        if self.on_cuda:
            ended = torch.cuda.Event(enable_timing=True)
            ended.record()  # in a future's callback, on the stream that ran the collective
            with self.lock:
                self.event_pairs.append((started, ended))
            return
        elapsed = time.perf_counter() - started
        with self.lock:
            self.seconds += elapsed

    def total(self):
        with self.lock:
            if self.event_pairs:
                torch.cuda.synchronize()
                self.seconds += sum(start.elapsed_time(end) for start, end in self.event_pairs) / 1000
                self.event_pairs.clear()
            return self.seconds


@dataclass
class CommAudit:
    """Per-rank running totals of what crosses between the ranks during training and evaluation."""

    world_size: int
    group: object = None  # the training collectives' process group (None: the default group)
    clock: CollectiveClock = field(default_factory=CollectiveClock)
    sync_bucket_calls: int = 0
    gradient_syncs: int = 0
    allreduce_bytes: int = 0
    buffer_broadcast_collectives: int = 0
    broadcast_bytes: int = 0
    rebuild_broadcast_collectives: int = 0

    COUNTS = (
        "sync_bucket_calls",
        "gradient_syncs",
        "allreduce_bytes",
        "buffer_broadcast_collectives",
        "broadcast_bytes",
        "rebuild_broadcast_collectives",
    )

    def totals(self):
        totals = {name: getattr(self, name) for name in self.COUNTS}
        totals["comm_seconds"] = self.clock.total()
        return totals


def counting_allreduce_hook(audit, bucket):
    """DDP's averaging all-reduce (divide by world size, then sum), counted and timed. An audit instrument.

    DDP calls the hook once per gradient bucket; bucket.is_last() marks the end of one synchronized backward.
    """
    audit.sync_bucket_calls += 1
    audit.gradient_syncs += bucket.is_last()
    tensor = bucket.buffer()
    audit.allreduce_bytes += tensor.numel() * tensor.element_size()
    tensor.div_(audit.world_size)
    started = audit.clock.start()

    def finished(future):
        audit.clock.stop(started)
        return future.value()[0]

    return dist.all_reduce(tensor, group=audit.group, async_op=True).get_future().then(finished)


def fingerprint(tensors):
    """The float64 sum and sum of squares of tensors: bit for bit the same on ranks that hold the same values."""
    flat = torch.cat([tensor.detach().reshape(-1) for tensor in tensors]).double()
    return torch.stack([flat.sum(), flat.square().sum()])


def ranks_agree(gradients_fingerprint, parameters, group):
    """One small all-reduce: did every rank step on the same gradients and end with the same parameters?

    The maxima of the fingerprints and of their negatives give each value's maximum and minimum over the
    ranks; they are equal where every rank holds the same. Returns a device tensor [gradients agreed,
    parameters agreed], read once per epoch.
    """
    mine = torch.cat([gradients_fingerprint, fingerprint(parameters)])
    extremes = torch.cat([mine, -mine])
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
    agreed = extremes[: mine.numel()] == -extremes[mine.numel() :]
    return torch.stack([agreed[:2].all(), agreed[2:].all()])


def settle_comm_hooks():
    """Wait until gloo's threads are done with the hook's Python callbacks, before the groups are torn down.

    A gloo thread needs the GIL to drop a finished callback, and a main thread that destroys a
    ProcessGroupGloo holds the GIL while it joins those threads: torn down right after a hooked all-reduce,
    a process can hang at exit (seen here about one run in three). The barrier waits for every earlier
    collective; the sleep releases the GIL so that the threads finish with their callbacks.
    """
    dist.barrier()
    time.sleep(0.1)


class AuditedDDP(DDP):
    """DDP that also counts DDP's own collectives, which no comm hook sees: the BatchNorm buffer broadcasts
    (broadcast_buffers=True), counted and timed, and the one-time broadcast of its rebuilt bucket order."""

    def _pre_forward(self, *inputs, **kwargs):
        rebuilt_before = self._has_rebuilt_buckets
        result = super()._pre_forward(*inputs, **kwargs)
        if self._has_rebuilt_buckets and not rebuilt_before:
            self.comm_audit.rebuild_broadcast_collectives += lab.REBUILD_BROADCASTS
        return result

    def _distributed_broadcast_coalesced(self, tensors, buffer_size, authoritative_rank=0):
        audit = self.comm_audit
        started = audit.clock.start()
        super()._distributed_broadcast_coalesced(tensors, buffer_size, authoritative_rank)
        audit.clock.stop(started)  # on GPU: the current stream waits for the broadcast
        # One collective per dtype: _broadcast_coalesced flattens same-dtype tensors into one bucket
        # (tests/test_comm_audit.py checks this against the profiler's c10d::broadcast_ events).
        audit.buffer_broadcast_collectives += len({tensor.dtype for tensor in tensors})
        audit.broadcast_bytes += sum(tensor.numel() * tensor.element_size() for tensor in tensors)


def wrap_model(model, device, world_size, group=None):
    ddp_model = AuditedDDP(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=lab.BUCKET_CAP_MB,
        broadcast_buffers=True,
        process_group=group,
    )
    audit = CommAudit(world_size=world_size, group=group, clock=CollectiveClock(device.type))
    ddp_model.comm_audit = audit
    ddp_model.register_comm_hook(audit, counting_allreduce_hook)
    check_ddp_settings(ddp_model)
    return ddp_model, audit


# What lab.expected_epoch_counts assumes of DDP: buffer broadcasts before synchronized forwards, every
# parameter used (no search for unused ones), one bucket rebuild after the first synchronized backward (no
# static graph), one 25 MB bucket for the 2.2 MB of gradients, the gradients all-reduced by the counting hook
# alone and the buffers broadcast by DDP itself (no buffer hook).
DDP_SETTINGS = {
    "broadcast_buffers": True,
    "find_unused_parameters": False,
    "static_graph": False,
    "bucket_bytes_cap": lab.BUCKET_CAP_MB * 1024 * 1024,
}


def check_ddp_settings(ddp_model):
    expected = {**DDP_SETTINGS, "gradient comm hooks": [counting_allreduce_hook.__name__], "buffer comm hook": False}
    actual = {name: getattr(ddp_model, name) for name in DDP_SETTINGS}
    actual["gradient comm hooks"] = [hook.__name__ for hook, _ in ddp_model._comm_hooks]
    actual["buffer comm hook"] = hasattr(ddp_model, "buffer_hook")
    changed = [f"{name} {actual[name]!r} (expected {value!r})" for name, value in expected.items() if actual[name] != value]
    if changed:
        raise lab.LabError(
            f"DDP is wrapped with settings the audit's expected counts do not assume: {'; '.join(changed)}; "
            f"restore them in train.wrap_model, or change lab.expected_epoch_counts with them"
        )


# ----------------------------------------------------------------------------- the profiler, a second witness


class WindowProfiler:
    """--profile-windows K: the PyTorch profiler over K accumulation windows of epoch 1.

    Window 1 is skipped and window 2 is the profiler's warm-up (DDP rebuilds its buckets in one of them, and a
    profiler's first steps run slow); windows 3 to K + 2 are recorded. The audit's totals are read at the edges
    of the recorded micro-batches, so that the two witnesses count the same collectives: the profiler sees the
    c10d calls (c10d::allreduce_, c10d::broadcast_) and their executions (gloo's threads on CPU, NCCL kernels on
    GPU), the audit its hook and AuditedDDP.
    """

    def __init__(self, windows, accum_steps, plan_length, device, audit):
        self.first, self.stop = 2 * accum_steps, (2 + windows) * accum_steps
        if self.stop > plan_length:
            most = plan_length // accum_steps - 2
            remedy = f"pass --profile-windows {most} or less" if most > 0 else "use more data or a smaller --accum-steps"
            raise lab.LabError(
                f"--profile-windows {windows} needs {2 + windows} windows of {accum_steps} micro-batches in an epoch "
                f"(one skipped, one of warm-up, {windows} profiled); an epoch here has {plan_length} micro-batches: "
                f"{remedy}"
            )
        self.device, self.audit = device, audit
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        recorded = schedule(skip_first=accum_steps, wait=0, warmup=accum_steps, active=windows * accum_steps, repeat=1)
        self.profiler = profile(activities=activities, schedule=recorded)

    def __enter__(self):
        self.profiler.__enter__()
        return self

    def __exit__(self, *exception):
        return self.profiler.__exit__(*exception)

    def span(self, name):
        return record_function(name)

    def after_micro_batch(self, index):
        if index == self.first - 1:
            read_clock(self.device)
            self.audit_before = self.audit.totals()
        elif index == self.stop - 1:
            read_clock(self.device)
            settle_comm_hooks()  # gloo's threads close their last events before the profiler stops
            self.audit_after = self.audit.totals()
        self.profiler.step()  # the schedule counts micro-batches: its step n is micro-batch n

    def summary(self, rank):
        """What this rank's profiler saw in the recorded micro-batches, and what its audit counted there.

        Times are seconds from the start of the first recorded micro-batch. Each c10d call is paired, in
        order, with its execution (gloo runs a group's collectives in the order they were called; NCCL's
        kernels run in stream order).
        """
        events = self.profiler.events()
        micro_batches = sorted((e for e in events if e.name.startswith(MICRO_BATCH_LABEL)), key=event_start)
        origin = event_start(micro_batches[0])
        agreement_spans = [e.time_range for e in events if e.name == RANK_AGREEMENT_LABEL]
        calls, executions, collectives = {}, {}, []
        for call_name, (gloo_name, nccl_word) in COLLECTIVE_EVENTS.items():
            called = sorted((e for e in events if e.name == call_name), key=event_start)
            executed = sorted((e for e in events if is_execution(e, gloo_name, nccl_word)), key=event_start)
            calls[call_name], executions[call_name] = len(called), len(executed)
            for call, execution in zip(called, executed):
                kind = "broadcast" if call_name == "c10d::broadcast_" else "gradient all-reduce"
                if any(span.start <= event_start(call) <= span.end for span in agreement_spans):
                    kind = "rank-agreement all-reduce"
                collectives.append([kind, *relative_span(execution, origin)])
        spans = [[int(e.name.removeprefix(MICRO_BATCH_LABEL)), *relative_span(e, origin)] for e in micro_batches]
        collective_seconds = {kind: 0.0 for kind in lab.COLLECTIVE_KINDS}
        for kind, start, end in collectives:
            collective_seconds[kind] += end - start
        # A micro-batch's compute: its span less the collectives' executions within it (on CPU the main thread
        # waits for them at the end of a synchronized backward).
        compute = [
            end - start - sum(max(0.0, min(end, stop) - max(start, begin)) for _, begin, stop in collectives)
            for _, start, end in spans
        ]
        return {
            "rank": rank,
            "calls": calls,
            "executions": executions,
            "collective_seconds": collective_seconds,
            "compute_seconds_per_micro_batch": sum(compute) / len(compute),
            "micro_batches": spans,
            "collectives": sorted(collectives, key=lambda collective: collective[1]),
            "audit": {key: self.audit_after[key] - self.audit_before[key] for key in self.audit_after},
        }

    def write(self, folder, place, windows):
        """Every rank's summary to rank 0, which writes them (profile.json) and its own trace (Perfetto)."""
        summaries = [None] * place.world_size
        dist.all_gather_object(summaries, self.summary(place.rank))
        if place.rank != 0:
            return
        with tempfile.TemporaryDirectory() as scratch:
            trace = Path(scratch) / lab.PROFILE_TRACE_FILE
            self.profiler.export_chrome_trace(str(trace))
            folder.write(lab.PROFILE_TRACE_FILE, trace.read_bytes())
        record = {"windows": windows, "micro_batches": [self.first, self.stop], "ranks": summaries}
        folder.write(lab.PROFILE_FILE, lab.json_bytes(record))


MICRO_BATCH_LABEL = "micro-batch "
RANK_AGREEMENT_LABEL = "rank agreement"
# Each c10d call the lab makes in training and the events that execute it: gloo's on CPU, NCCL's kernels
# (named ncclDevKernel_AllReduce_..., ..._Broadcast_...) on GPU.
COLLECTIVE_EVENTS = {"c10d::allreduce_": ("gloo:all_reduce", "AllReduce"), "c10d::broadcast_": ("gloo:broadcast", "Broadcast")}


def event_start(event):
    return event.time_range.start


def relative_span(event, origin):
    return [(event.time_range.start - origin) / 1e6, (event.time_range.end - origin) / 1e6]


def is_execution(event, gloo_name, nccl_word):
    on_gpu = event.device_type == torch.autograd.DeviceType.CUDA and event.name.startswith("nccl")
    return event.name == gloo_name or (on_gpu and nccl_word in event.name)


# ----------------------------------------------------------------------------- training and evaluation


class Progress:
    """Rank 0's progress on stderr, one line at most every `interval` seconds; stdout keeps the JSON lines."""

    def __init__(self, enabled, interval):
        self.enabled = enabled
        self.interval = interval
        self.prefix = ""

    def start(self, label, total, unit):
        self.label, self.total, self.unit = f"{self.prefix}{label}", total, unit
        self.started = self.last_line = time.perf_counter()

    def update(self, done, images):
        now = time.perf_counter()
        if not self.enabled or now - self.last_line < self.interval:
            return
        self.last_line = now
        elapsed = now - self.started
        left = elapsed / done * (self.total - done)
        print(
            f"{self.label}: {done}/{self.total} {self.unit}, {images / elapsed:.0f} img/s per rank, "
            f"about {left:.0f} s left",
            file=sys.stderr,
            flush=True,
        )


@contextmanager
def saved_activations(model):
    """Count the bytes that a forward run inside this context leaves held for its backward; yields a dict
    {storage address: bytes} to sum afterwards.

    Autograd packs every tensor it saves for the backward through saved_tensors_hooks: each distinct storage is
    counted once, the model's parameters aside (they are held anyway). Inside a checkpointed stage the
    checkpoint's own hooks save nothing; the checkpoint holds the stage's input instead, seen here by a
    forward pre-hook on the stage's first layer. Independent of the allocator: the same on every device.
    """
    parameters = {parameter.untyped_storage().data_ptr() for parameter in model.parameters()}
    held = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            held[storage.data_ptr()] = storage.nbytes()
        return tensor

    entries = [stage[0] for stage in model.stages()] if model.activation_checkpointing else []
    handles = [entry.register_forward_pre_hook(lambda module, inputs: pack(inputs[0])) for entry in entries]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            yield held
    finally:
        for handle in handles:
            handle.remove()


@dataclass
class EpochTrace:
    """Where one rank's epoch synchronized and stepped, and whether the ranks agreed at each step."""

    saved_activation_bytes: int = 0  # held from micro-batch 0's forward for its backward (saved_activations)
    sync_positions: list = field(default_factory=list)  # micro-batches whose backward synchronized
    step_positions: list = field(default_factory=list)  # micro-batches after which the optimizer stepped
    agreement: list = field(default_factory=list)  # per step, on the device: [gradients agreed, parameters agreed]

    def rank_agreement(self):
        """Steps at which the ranks agreed, and the first at which they did not (one host read)."""
        verdicts = torch.stack(self.agreement).tolist() if self.agreement else []
        first = next((step for step, verdict in enumerate(verdicts, start=1) if not all(verdict)), None)
        if first is None:
            return len(verdicts), None
        gradients_agreed, parameters_agreed = verdicts[first - 1]
        what = [name for name, agreed in (("gradients", gradients_agreed), ("parameters", parameters_agreed)) if not agreed]
        return sum(map(all, verdicts)), {"optimizer_step": first, "differed": what}


def train_epoch(ddp_model, loader, plan, mode, optimizer, criterion, device, autocast, progress, profiler=None):
    """One epoch by the window plan (profiled in part when a WindowProfiler is given).

    Returns this rank's (loss sum, correct, count) as a float64 tensor, and its EpochTrace: the micro-batches
    whose backward synchronized (the hook saw the last bucket) and after which the optimizer stepped, and at
    each step whether every rank held the same gradients before it and the same parameters after it.
    """
    ddp_model.train()
    optimizer.zero_grad(set_to_none=True)
    audit = ddp_model.comm_audit
    parameters = list(ddp_model.parameters())
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    trace = EpochTrace()
    images = 0
    span = profiler.span if profiler else lambda name: nullcontext()
    progress.start("train", len(plan), "micro-batches")
    for index, ((inputs, targets), micro_step) in enumerate(zip(loader, plan, strict=True)):
        inputs = inputs.to(device, non_blocking=True, memory_format=MEMORY_FORMAT)
        targets = targets.to(device, non_blocking=True)
        # The forward belongs inside no_sync too: DDP's forward prepares the reducer for the backward.
        suppress_sync = mode == "no_sync" and not micro_step.sync
        syncs_before = audit.gradient_syncs
        with span(f"{MICRO_BATCH_LABEL}{index}"):
            with ddp_model.no_sync() if suppress_sync else nullcontext():
                # The first micro-batch of each epoch is measured: every full micro-batch holds the same.
                with saved_activations(ddp_model.module) if index == 0 else nullcontext() as held:
                    with autocast():
                        logits = ddp_model(inputs)
                        raw_loss = criterion(logits, targets)
                (raw_loss / micro_step.loss_divisor).backward()
            if index == 0:
                trace.saved_activation_bytes = sum(held.values())
            if micro_step.step:
                gradients = fingerprint(p.grad for p in parameters if p.grad is not None)
                optimizer.step()
                with span(RANK_AGREEMENT_LABEL):
                    trace.agreement.append(ranks_agree(gradients, parameters, audit.group))
                optimizer.zero_grad(set_to_none=True)
        if audit.gradient_syncs != syncs_before:
            trace.sync_positions.append(index)
        if micro_step.step:
            trace.step_positions.append(index)
        if profiler:
            profiler.after_micro_batch(index)
        # In place on the device: no host synchronization per micro-batch on GPU (read once per epoch).
        totals[0] += raw_loss.detach().double() * targets.size(0)
        totals[1] += logits.detach().argmax(dim=1).eq(targets).sum()
        totals[2] += targets.size(0)
        images += targets.size(0)
        progress.update(index + 1, images)
    return totals, trace


@torch.no_grad()
def evaluate(ddp_model, loader, criterion, device, autocast, progress, label, group=None):
    """Loss, accuracy and confusion matrix (rows true, columns predicted), summed over ranks.

    Through the DDP wrapper, as in training: its first forward broadcasts rank 0's BatchNorm buffers, so
    every rank evaluates the same model, the one saved in model.pt.
    """
    ddp_model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    confusion = torch.zeros(len(CLASSES), len(CLASSES), dtype=torch.int64, device=device)
    classes = torch.arange(len(CLASSES), device=device)
    progress.start(label, len(loader), "batches")
    images = 0
    for done, (inputs, targets) in enumerate(loader, start=1):
        inputs = inputs.to(device, non_blocking=True, memory_format=MEMORY_FORMAT)
        targets = targets.to(device, non_blocking=True)
        with autocast():
            logits = ddp_model(inputs)
            loss = criterion(logits, targets)
        predictions = logits.argmax(dim=1)
        totals[0] += loss.double() * targets.size(0)
        totals[1] += targets.size(0)
        # bincount would read its input's range on the host (a sync per batch on GPU); one-hot rows do not.
        confusion += ((targets[:, None, None] == classes[:, None]) & (predictions[:, None, None] == classes)).sum(0)
        images += targets.size(0)
        progress.update(done, images)
    dist.all_reduce(totals, group=group)
    dist.all_reduce(confusion, group=group)
    count = totals[1].item()
    return totals[0].item() / count, confusion.diagonal().sum().item() / count, confusion.cpu()


# ----------------------------------------------------------------------------- one run


def run_config(args, place, sizes, source, device, backend, precision, hardware):
    """Everything that must match between the two runs for their comparison to mean anything."""
    return {
        "world_size": place.world_size,
        "nodes": place.nodes,
        "batch_size": args.batch_size,
        "accum_steps": args.accum_steps,
        "epochs": args.epochs,
        "seed": args.seed,
        "partial_window": args.partial_window,
        "train_size": sizes["train"],
        "validation_size": sizes["validation"],
        "test_size": sizes["test"],
        "data_layout": source.layout,
        "loader": args.loader,
        "data_fingerprint": source.fingerprint,
        "activation_checkpointing": args.activation_checkpointing,
        "device": device.type,
        "backend": backend,
        "precision": precision.name,
        "hardware": hardware,  # every node's (verify.py prints it; it may differ between the two runs)
        "bucket_cap_mb": lab.BUCKET_CAP_MB,
        "broadcast_buffers": True,
        "torch": torch.__version__,
    }


def epoch_row(epoch, mode, trace, train_totals, validation, before, after, phase_seconds, peak_bytes, run_id, device, group):
    """The epoch's JSON line: the document's fields first, then the rest of the audit.

    Losses, correct and counts are summed over ranks; the seconds are means over ranks; the counts are this
    rank's (every rank takes part in every collective, so they are the same on all).
    """
    comm_seconds = after["comm_seconds"] - before["comm_seconds"]
    seconds = torch.tensor([*phase_seconds, comm_seconds], dtype=torch.float64, device=device)
    summed = torch.cat([train_totals, seconds])
    dist.all_reduce(summed, group=group)
    loss_sum, correct, count, epoch_seconds_sum, validation_seconds_sum, comm_seconds_sum = summed.tolist()
    world_size = dist.get_world_size()
    validation_loss, validation_accuracy = validation
    agreed_steps, first_disagreement = trace.rank_agreement()
    return {
        "epoch": epoch,
        "mode": mode,
        "optimizer_steps": len(trace.step_positions),
        "gradient_syncs": after["gradient_syncs"] - before["gradient_syncs"],
        "train_loss": loss_sum / count,
        "train_accuracy": correct / count,
        "validation_loss": validation_loss,
        "validation_accuracy": validation_accuracy,
        **{key: after[key] - before[key] for key in CommAudit.COUNTS if key != "gradient_syncs"},
        "comm_seconds": comm_seconds_sum / world_size,
        "epoch_seconds": epoch_seconds_sum / world_size,
        "train_images_per_second": count / (epoch_seconds_sum / world_size),
        "validation_seconds": validation_seconds_sum / world_size,
        # Where, not only how many (rank 0's): micro-batch indices as [start, stop, step] runs.
        "gradient_sync_positions": lab.as_progressions(trace.sync_positions),
        "optimizer_step_positions": lab.as_progressions(trace.step_positions),
        "steps_with_ranks_agreed": agreed_steps,
        "first_rank_disagreement": first_disagreement,
        # Memory (rank 0's): activations held for the backward per micro-batch; on CUDA the allocator's peak.
        "saved_activation_bytes": trace.saved_activation_bytes,
        "peak_allocated_bytes": peak_bytes,
        "run_id": run_id,
    }


def write_results(folder, args, config, confusion, majority, model, test_image, test_metrics, run_id, started_at):
    """Rank 0: report, checkpoint, pictures, then publish the run folder. Returns the report."""
    matrix = confusion.tolist()
    test_size = config["test_size"]
    report = {
        "mode": args.mode,
        "baseline_class": CLASSES[majority],
        "baseline_accuracy": sum(matrix[majority]) / test_size,
        "model_test_loss": test_metrics[0],
        "model_test_accuracy": test_metrics[1],
        "confusion_matrix": matrix,
        "top_confusions": lab.top_confusions(matrix),
        "run_id": run_id,
        "config": config,
    }
    checkpoint = {
        "model": model.state_dict(),
        "classes": CLASSES,
        "seed": args.seed,
        "run_id": run_id,
        "mode": args.mode,
        "precision": config["precision"],
    }
    folder.write(lab.MODEL_FILE, lab.torch_bytes(checkpoint))
    folder.write(lab.REPORT_FILE, lab.json_bytes(report))
    folder.write(lab.SAMPLE_FILE, lab.png_bytes(Image.fromarray(test_image), {"run_id": run_id}))
    image, data = plots.confusion_matrix_image(matrix, CLASSES, f"{args.mode}: test confusion matrix")
    folder.write(lab.CONFUSION_FILE, lab.png_bytes(image, {"run_id": run_id, "data": json.dumps(data)}))
    folder.publish(
        {
            "run_id": run_id,
            "mode": args.mode,
            "config": config,
            "data_dir": str(args.data_dir),
            "started_at": started_at,
            "finished_at": lab.utc_now(),
        }
    )
    return report


def make_optimizer(parameters, device):
    """The document's AdamW; on GPU one fused kernel updates every parameter (on CPU the step is about 1 ms
    of a window's 850, whichever implementation)."""
    return torch.optim.AdamW(parameters, lr=3e-3, weight_decay=1e-4, fused=True if device.type == "cuda" else None)


def run(args, place):
    device, precision, hardware, source = start_up(args, place)
    # gloo carried the start-up exchange; on GPUs the training collectives (DDP, metrics) go over NCCL.
    group = dist.new_group(backend="nccl", timeout=COLLECTIVE_TIMEOUT) if device.type == "cuda" else None
    backend = dist.get_backend(group)
    seed_everything(args.seed + place.rank)
    split = data.make_split(source, args.seed, place.rank, place.world_size)
    loaders = data.build_loaders(
        args.loader, source, split, args.batch_size, place.rank, place.world_size, device, args.seed + place.rank
    )
    plan = lab.window_plan(len(loaders.train), args.accum_steps, args.partial_window)
    config = run_config(args, place, split.sizes, source, device, backend, precision, hardware)
    majority = data.majority_class([source.train_labels[index] for index in split.train])

    model = CifarCNN(activation_checkpointing=args.activation_checkpointing)
    ddp_model, audit = wrap_model(model.to(device, memory_format=MEMORY_FORMAT), device, place.world_size, group)
    criterion = nn.CrossEntropyLoss()
    optimizer = make_optimizer(ddp_model.parameters(), device)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    autocast = partial(precision.autocast, device.type)

    profiler = None
    if args.profile_windows:
        profiler = WindowProfiler(args.profile_windows, args.accum_steps, len(plan), device, audit)
    is_writer = place.rank == 0
    progress = Progress(enabled=is_writer and not args.quiet, interval=args.progress_every)
    run_id, started_at = lab.new_run_id(), lab.utc_now()
    folder = lab.RunFolder(args.output, run_id)
    if is_writer:
        folder.begin()

    history = []
    for epoch in range(1, args.epochs + 1):
        split.train_sampler.set_epoch(epoch - 1)
        progress.prefix = f"epoch {epoch}/{args.epochs} "
        before = audit.totals()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        epoch_started = read_clock(device)
        profiled = profiler if epoch == 1 else None
        try:
            with profiled or nullcontext():
                train_totals, trace = train_epoch(
                    ddp_model, loaders.train, plan, args.mode, optimizer, criterion, device, autocast, progress, profiled
                )
        except RuntimeError as error:
            raise explain_ddp_error(error) or error
        validation_started = read_clock(device)
        epoch_seconds = validation_started - epoch_started
        peak_bytes = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        validation_loss, validation_accuracy, _ = evaluate(
            ddp_model, loaders.validation, criterion, device, autocast, progress, "validation", group
        )
        validation_seconds = read_clock(device) - validation_started
        scheduler.step()
        row = epoch_row(
            epoch,
            args.mode,
            trace,
            train_totals,
            (validation_loss, validation_accuracy),
            before,
            audit.totals(),
            (epoch_seconds, validation_seconds),
            peak_bytes,
            run_id,
            device,
            group,
        )
        history.append(row)
        if is_writer:
            print(json.dumps(row), flush=True)
            folder.write(lab.HISTORY_FILE, lab.json_bytes(history))  # a killed run leaves its history so far
        if profiled:
            profiled.write(folder, place, args.profile_windows)

    progress.prefix = ""
    test_loss, test_accuracy, confusion = evaluate(
        ddp_model, loaders.test, criterion, device, autocast, progress, "test", group
    )
    if is_writer:
        report = write_results(
            folder, args, config, confusion, majority, ddp_model.module, source.test_images[0], (test_loss, test_accuracy), run_id, started_at
        )
        print(json.dumps({key: value for key, value in report.items() if key != "config"}), flush=True)
    settle_comm_hooks()


# DDP's errors when a parameter's gradient comes twice in one backward, or never: what reentrant activation
# checkpointing does (README "Activation checkpointing"). DDP's own advice for the second,
# find_unused_parameters=True, would hide it: the stages would train no more, silently.
DDP_GRADIENT_ERRORS = {
    "Expected to mark a variable ready only once": "DDP saw a parameter's gradient twice in one backward",
    "Expected to have finished reduction in the prior iteration": "DDP found parameters that got no gradient in the last backward",
}


def explain_ddp_error(error):
    """A LabError of one line for DDP's gradient errors (None for any other error)."""
    for marker, what in DDP_GRADIENT_ERRORS.items():
        if marker in str(error):
            return lab.LabError(
                f"{what} (\"{marker}\"): with activation checkpointing use torch.utils.checkpoint.checkpoint(..., "
                f"use_reentrant=False), as model.CifarCNN does for --activation-checkpointing; reentrant checkpointing "
                f"gives no gradient to a stage whose input needs none and, with find_unused_parameters=True, marks "
                f"its parameters ready twice",
                kind="RuntimeError",
            )
    return None


def raise_if(error):
    if error is not None:
        raise error


@record
def main():
    try:
        args, usage_error = parse_args(), None
    except lab.LabError as error:
        args, usage_error = None, error
    try:
        place = launch_environment(args.expected_world_size if args else None)
    except lab.LabError as error:
        lab.exit_with(usage_error or error, SCRIPT, show=os.environ.get("LOCAL_RANK", "0") == "0")
    try:
        with c_stdout_to_stderr():
            dist.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)
        try:
            agree(place, lambda: raise_if(usage_error))  # the options parsed on every node
            run(args, place)
        finally:
            dist.destroy_process_group()
    except lab.LabError as error:
        # Every rank stops on it together (see agree); one line per node, from its first process.
        lab.exit_with(error, SCRIPT, show=place.local_rank == 0)


if __name__ == "__main__":
    main()
