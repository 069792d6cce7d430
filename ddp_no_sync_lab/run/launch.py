"""The launch and the nodes' agreement: where this process runs (torchrun's environment), on which device, in
which precision, with which data; every rank agrees on all of it before any training collective, so that a
node that differs or cannot go on stops every node at once with one line naming it.

start_up() is train.py's whole set-up in one call: options agreed, device and precision chosen, output
checked, data prepared and loaded on each node, the seeded split and this rank's loaders.
"""

import hashlib
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import tempfile
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import IO

import torch
import torch.distributed as dist

from ddp_no_sync_lab import experiment
from ddp_no_sync_lab.cli import ArgumentParser, LabError
from ddp_no_sync_lab.files import claim_output, is_replaceable_output
from ddp_no_sync_lab.options import TrainOptions
from ddp_no_sync_lab.precision import Precision, choose_precision
from ddp_no_sync_lab.tasks import data, loaders, packed
from ddp_no_sync_lab.tasks.registry import Task, code_sha256, find_task, task_file

SCRIPT = "train.py"
# The start-up's group (gloo) waits up to 10 minutes for a stuck (alive but silent) peer, each node's CIFAR-10
# download included. On CPU the training runs in it too: a dead peer is noticed at once (torchrun stops its
# node's other processes, whose closed gloo connections stop the other nodes').
COLLECTIVE_TIMEOUT = timedelta(minutes=10)
# On GPUs the training collectives run over NCCL, whose survivors of a dead peer wait until its timeout: 45 s
# (its collectives take milliseconds; the longest gap is an evaluation pass), with asynchronous error handling
# on, so that the watchdog ends the process then. A dead peer ends a job on GPUs within a minute.
NCCL_TIMEOUT = timedelta(seconds=45)
NCCL_ENVIRONMENT = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
GPU_BACKENDS = ("nccl", "gloo")  # gloo carries CUDA tensors through host memory, and lets ranks share a GPU
# Closing the process groups can hang: a gloo thread needs the GIL to drop a finished hook callback while the
# main thread holds it, joining that thread. Beyond this many seconds a watchdog ends the process.
TEARDOWN_SECONDS = 10


class TorchrunArgumentParser(ArgumentParser):
    """Raises its one-line error instead of exiting: under torchrun a node whose options do not parse must
    first tell the other nodes, or they would wait for it in the first collective until the timeout."""

    def error(self, message):
        raise self.usage_error(message)


@dataclass(frozen=True)
class Place:
    """Where this process runs, as torchrun says: its global and local rank and its node (GROUP_RANK)."""

    rank: int
    local_rank: int
    node: int
    world_size: int
    local_world_size: int
    nodes: int
    start: int = 1  # the how-many-th start of this rank in this torchrun job (init_process_group: 2 on a restart)
    job: str = ""  # this torchrun job's own token, the same in all its attempts (init_process_group)


def world_size_error(expected, got):
    return LabError(
        f"expected world_size={expected}, got {got} (start it with torchrun: torchrun --standalone --nnodes=1 "
        f"--nproc-per-node={expected} train.py --mode ... --output ...)",
        kind="ValueError",
    )


def check_world_size(place, expected_world_size):
    """Under torchrun, every rank (launch.agree) refuses a world of another size than expected; None: any."""
    if expected_world_size not in (None, place.world_size):
        raise world_size_error(expected_world_size, place.world_size)


def launch_environment(expected_world_size):
    """This process's Place under torchrun; plain python (world size 1, no rank) is refused at once."""
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if "RANK" not in os.environ:
        raise world_size_error(expected_world_size, world_size)
    return Place(
        rank=int(os.environ["RANK"]),
        local_rank=int(os.environ["LOCAL_RANK"]),
        node=int(os.environ.get("GROUP_RANK", 0)),
        world_size=world_size,
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", world_size)),
        nodes=int(os.environ.get("GROUP_WORLD_SIZE", 1)),
    )


def node_device(local_world_size):
    """The lab's one device policy, per node: CUDA when this node has a GPU for each of its processes
    (torchrun's LOCAL_WORLD_SIZE), else CPU. Returns the device type and the number of visible GPUs."""
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return ("cuda" if visible >= local_world_size else "cpu"), visible


def choose_device(requested, place, gpu_backend="nccl"):
    """'cuda' or 'cpu': node_device's policy for --device auto; never NCCL quietly swapped for gloo."""
    policy, visible = node_device(place.local_world_size)
    if requested == "auto":
        requested = policy
        if requested == "cpu" and place.local_rank == 0:
            print(
                f"{SCRIPT}: {visible} GPU(s) visible for {place.local_world_size} process(es) on node {place.node}; "
                f"running on CPU with the gloo backend",
                file=sys.stderr,
            )
    shared = gpu_backend == "gloo" and visible > 0
    if requested == "cuda" and visible < place.local_world_size and not shared:
        raise LabError(
            f"--device cuda needs one GPU per process: {place.local_world_size} processes on this node, {visible} "
            f"GPU(s) visible (check nvidia-smi and CUDA_VISIBLE_DEVICES, run on CPU with --device cpu, or share the "
            f"GPUs over gloo with --gpu-backend gloo)"
        )
    return requested


def check_output(output):
    """Fail before any training if the run folder cannot be written, would overwrite something not ours, or is
    being written by a run still going. Returns the output's claim (files.claim_output), held by rank 0 for
    the whole run."""
    if output.exists() and not output.is_dir():
        raise LabError(f"--output {output} is a file; pass a folder path, e.g. --output artifacts/every")
    if not is_replaceable_output(output):
        raise LabError(
            f"--output {output} holds files that are not lab artifacts; pass a new or empty folder "
            f"(train.py replaces the whole folder it writes)"
        )
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=output.parent, prefix=f".{output.name}.probe-"):
            pass
    except OSError as error:
        raise LabError(
            f"--output {output} is not writable ({error.strerror}: {error.filename}); pass a folder you can write to"
        ) from None
    return claim_output(output)


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
    except LabError as error:
        value, failure = None, (str(error), error.kind)
    outcomes = [None] * place.world_size
    dist.all_gather_object(outcomes, (place.rank, place.node, failure))
    failed = [(rank, node, failure) for rank, node, failure in outcomes if failure is not None]
    if failed:
        rank, node, (message, kind) = failed[0]
        if len(failed) == place.world_size and len({failure for _, _, failure in failed}) == 1:
            raise LabError(message, kind)
        raise LabError(f"{ranks_label(rank, node)} {message}", kind)
    return value


def require_same(place, claims, what, remedy):
    """Every rank's claims (a dict) must equal rank 0's; else every rank stops naming the first that differs."""
    gathered = [None] * place.world_size
    dist.all_gather_object(gathered, (place.rank, place.node, claims))
    _, _, reference = gathered[0]
    for rank, node, theirs in gathered[1:]:
        differences = [f"{key} {theirs[key]} vs {reference[key]}" for key in reference if theirs[key] != reference[key]]
        if differences:
            raise LabError(f"{ranks_label(rank, node)} {what} from rank 0's: {'; '.join(differences)}; {remedy}")


PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # this file is ddp_no_sync_lab/run/launch.py
LAB_ROOT = PACKAGE_ROOT.parent


def hashed_code():
    """What every node must share byte for byte: train.py, model.py, then the package's Python files at any depth."""
    return [LAB_ROOT / "train.py", LAB_ROOT / "model.py", *sorted(PACKAGE_ROOT.rglob("*.py"))]


def code_and_versions(task_code: Path | None = None):
    """What every node must run alike besides its options: the lab's code (the SHA-256 of hashed_code(), each
    file's path and bytes), a task's of its own outside the package (task_code, its file's SHA-256) and the versions
    of Python, torch, torchvision, CUDA and NCCL."""
    digest = hashlib.sha256()
    for path in hashed_code():
        digest.update(f"{path.relative_to(LAB_ROOT)}\n".encode() + path.read_bytes())
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.version.cuda else None  # the build's, GPU or not
    return {
        "code sha256": digest.hexdigest()[:16],
        **({"task code sha256": code_sha256(task_code)} if task_code else {}),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchvision": data.torchvision_version(),
        "cuda": torch.version.cuda,
        "nccl": nccl,
    }


def shared_settings(options: TrainOptions) -> dict:
    """The options that must be the same on every node (--output and --data-dir are each node's own)."""
    return {
        f"--{name.replace('_', '-')}": getattr(options, name)
        for name in (
            "mode",
            "strategy",
            "epochs",
            "batch_size",
            "accum_steps",
            "seed",
            "expected_world_size",
            "partial_window",
            "device",
            "loader",
            "precision",
            "activation_checkpointing",
            "profile_windows",
            "resume",
            "checkpoint_every_windows",
            "gpu_backend",
            "task",
            "loss_normalization",
            *experiment.DDP_DEFAULTS,
        )
    }


@dataclass
class Setup:
    """What train.py needs from its start-up, agreed by every rank."""

    device: torch.device
    group: dist.ProcessGroup | None  # the training collectives' group (None: the default, gloo)
    backend: str
    code: dict  # code_and_versions(), the same on every node
    precision: Precision
    hardware: list  # every node's, distinct
    output_claim: IO | None  # rank 0: the output's lock, held until the process ends; None elsewhere
    task: Task
    source: data.DataSource | packed.TextSource
    split: data.Split  # packed.TextSplit, a Split, for the text task
    loaders: loaders.Loaders


def start_up(options: TrainOptions, place: Place) -> Setup:
    """Settings, device, precision, output and data agreed by every rank; then the training group, the seeds,
    the seeded split and this rank's loaders. One call, before any training collective."""

    def settle_here():
        device_type = choose_device(options.device, place, options.gpu_backend)
        # Only the rank that writes the artifacts touches the output folder.
        return device_type, check_output(options.output) if place.rank == 0 else None

    device_type, output_claim = agree(place, settle_here)
    if place.nodes > 1:  # torchrun numbers the nodes itself: say where the artifacts will be
        writer = [(socket.gethostname(), str(options.output.resolve()))]
        dist.broadcast_object_list(writer, src=0)
        if place.local_rank == 0:
            host, output = writer[0]
            print(
                f"{SCRIPT}: node {place.node} of {place.nodes}; rank 0 writes the artifacts on {host} into {output}",
                file=sys.stderr,
            )
    # The code first: a task of your own decides some defaults (its documented options) in its own file.
    task = find_task(options.task)
    own_task_file = task_file(task)
    code = code_and_versions(own_task_file)
    remedy = "run one checkout of the lab with the same Python, torch, torchvision, CUDA and NCCL on every node"
    if own_task_file:
        remedy += f", and the same {own_task_file.name}"
    require_same(place, code, "its code or versions differ", remedy)
    require_same(
        place,
        shared_settings(options),
        "its train.py options differ",
        "start train.py with the same options on every node",
    )
    remedy = "give every node one GPU per process, or pass --device cpu on every node"
    require_same(place, {"device": device_type}, "its device differs", remedy)
    device = torch.device("cpu")
    if device_type == "cuda":  # a GPU per process, or with --gpu-backend gloo processes sharing them in turn
        device = torch.device("cuda", place.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    precision, hardware = agree_on_precision(options, place, device)
    # One process per node fetches the data for its node; the node's other processes wait here for it.
    agree(place, lambda: task.prepare_data(options) if place.local_rank == 0 else None)
    source = agree(place, lambda: task.load_source(options))
    where, remedy = task.source_place(options)
    require_same(place, source.summary(), f"its data in {where} differ", remedy)
    group = training_group(device, options.gpu_backend)
    seed_everything(options.seed + place.rank)
    split = task.make_split(source, options.seed, place.rank, place.world_size)
    rank_loaders = task.build_loaders(options, source, split, place.rank, place.world_size, device)
    backend = dist.get_backend(group)
    return Setup(device, group, backend, code, precision, hardware, output_claim, task, source, split, rank_loaders)


def training_group(device, gpu_backend="nccl"):
    """gloo carried the start-up exchange; on GPUs the training collectives (DDP, metrics) go over NCCL (unless
    --gpu-backend gloo), in a group that gives up on a dead peer within a minute. None: the default group (gloo)."""
    if device.type != "cuda" or gpu_backend == "gloo":
        return None
    for name, value in NCCL_ENVIRONMENT.items():
        os.environ.setdefault(name, value)  # read when the NCCL process group is made
    return dist.new_group(backend="nccl", timeout=NCCL_TIMEOUT)


def agree_on_precision(options: TrainOptions, place: Place, device: torch.device):
    """Every rank's --precision decision must be rank 0's: nodes of unlike CPUs would otherwise train in
    different numerics under `auto`. Returns the Precision and the distinct hardware of all ranks."""
    precision = agree(place, lambda: choose_precision(options.precision, device))
    gathered = [None] * place.world_size
    dist.all_gather_object(gathered, (place.rank, place.node, precision))
    reference = gathered[0][2]
    for rank, node, theirs in gathered[1:]:
        if theirs.name != reference.name:
            raise LabError(
                f"{ranks_label(rank, node)} its precision differs from rank 0's: {theirs.name} on a {theirs.hardware} "
                f"vs {reference.name} on a {reference.hardware}; pass the same --precision on every node (fp32 runs "
                f"at full speed anywhere, bf16 only where every node has BF16 instructions)"
            )
    if place.local_rank == 0:
        print(f"{SCRIPT}: precision: {precision.reason}", file=sys.stderr)
    return precision, sorted({theirs.hardware for _, _, theirs in gathered})


def init_process_group(place):
    """The default group, gloo, for the start-up's exchange (and on CPU for training). Returns the place with
    its start number.

    Under torchrun's restarts (--max-restarts) the rendezvous store can outlive the attempts, and its keys with
    them: gloo would read a dead attempt's addresses (Connection refused). And the nodes' agents need not
    agree on an attempt's number (TORCHELASTIC_RESTART_COUNT counts one agent's own failures, not a restart
    forced by another node's). So each attempt's keys go under a prefix every rank derives alike: the how-many-th
    start of its rank this store has seen, each rank starting once per attempt. A fresh store per attempt (other
    rendezvous backends) gives a restart another job token: it then trains again rather than skip anything.
    """
    store, rank, world_size = next(dist.rendezvous("env://", timeout=COLLECTIVE_TIMEOUT))
    start = store.add(f"lab/starts/rank-{rank}", 1)
    # The job's token: the first rank to ask sets it; --rdzv-id cannot serve, a later job may reuse it.
    job = store.compare_set("lab/job", "", uuid.uuid4().hex).decode()
    with c_stdout_to_stderr():
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore(f"start-{start}", store),
            rank=rank,
            world_size=world_size,
            timeout=COLLECTIVE_TIMEOUT,
        )
    return replace(place, start=start, job=job)


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


def raise_if(error):
    if error is not None:
        raise error


@contextmanager
def bounded_teardown(place):
    """Around the process groups' teardown: if it has not returned within TEARDOWN_SECONDS, a watchdog process (it
    needs no GIL, which the hung main thread holds) prints one line (from each node's first process) and ends
    this process. What the run wrote before stays as written."""
    seconds = TEARDOWN_SECONDS
    line = (
        f"{SCRIPT}: the process groups did not close within {seconds} s (gloo's threads still held the "
        f"communication hook's callbacks); ending the process (the run's artifacts were written before it)"
    )
    say = 'echo "$1" >&2; ' if place.local_rank == 0 else ""
    watchdog = subprocess.Popen(
        ["sh", "-c", f"sleep {seconds}; {say}kill -KILL {os.getpid()}", "teardown-watchdog", line],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        yield
    finally:
        # The whole session: its sleep would otherwise hold this process's stderr open for `seconds` more, and
        # whoever reads that pipe (a log, `| tee`, a test) would wait for it.
        os.killpg(watchdog.pid, signal.SIGKILL)
        watchdog.wait()
