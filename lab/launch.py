"""The launch and the nodes' agreement: where this process runs (torchrun's environment), on which device, in
which precision, with which data; every rank agrees on all of it before any training collective, so that a
node that differs or cannot go on stops every node at once with one line naming it.

start_up() is train.py's whole set-up in one call: options agreed, device and precision chosen, output
checked, data prepared and loaded on each node, the seeded split and this rank's loaders.
"""

import os
import random
import socket
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from lab import data
from lab.cli import ArgumentParser, LabError
from lab.precision import choose_precision
from lab.records import is_replaceable_output

SCRIPT = "train.py"
# Bounds a wait on a stuck (alive but silent) peer, each node's CIFAR-10 download (163 MB) included. A peer
# that dies is noticed at once: torchrun stops the other processes of its node, and the closed gloo
# connections stop the other nodes' processes.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)


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


def launch_environment(expected_world_size):
    """This process's Place under torchrun; plain python is world size 1 and is refused. None: any size."""
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if world_size != (expected_world_size or world_size) or "RANK" not in os.environ:
        raise LabError(
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


def node_device(local_world_size):
    """The lab's one device policy, per node: CUDA when this node has a GPU for each of its processes
    (torchrun's LOCAL_WORLD_SIZE), else CPU. Returns the device type and the number of visible GPUs."""
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return ("cuda" if visible >= local_world_size else "cpu"), visible


def choose_device(requested, place):
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
    if requested == "cuda" and visible < place.local_world_size:
        raise LabError(
            f"--device cuda needs one GPU per process: {place.local_world_size} processes on this node, {visible} "
            f"GPU(s) visible (check nvidia-smi and CUDA_VISIBLE_DEVICES, or run on CPU with --device cpu)"
        )
    return requested


def check_output(output):
    """Fail before any training if the run folder cannot be written or would overwrite something not ours."""
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


def shared_settings(args):
    """The options that must be the same on every node (--output and --data-dir are each node's own)."""
    return {
        f"--{name.replace('_', '-')}": getattr(args, name)
        for name in (
            "mode",
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
        )
    }


@dataclass
class Setup:
    """What train.py needs from its start-up, agreed by every rank."""

    device: torch.device
    group: object  # the training collectives' process group (None: the default, gloo)
    backend: str
    precision: object  # lab.precision.Precision
    hardware: list  # every node's, distinct
    source: data.DataSource
    split: data.Split
    loaders: data.Loaders


def start_up(args, place):
    """Settings, device, precision, output and data agreed by every rank; then the training group, the seeds,
    the seeded split and this rank's loaders. One call, before any training collective."""

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
            print(
                f"{SCRIPT}: node {place.node} of {place.nodes}; rank 0 writes the artifacts on {host} into {output}",
                file=sys.stderr,
            )
    require_same(
        place,
        shared_settings(args),
        "its train.py options differ",
        "start train.py with the same options on every node",
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
    # gloo carried the start-up exchange; on GPUs the training collectives (DDP, metrics) go over NCCL.
    group = dist.new_group(backend="nccl", timeout=COLLECTIVE_TIMEOUT) if device.type == "cuda" else None
    seed_everything(args.seed + place.rank)
    split = data.make_split(source, args.seed, place.rank, place.world_size)
    loaders = data.build_loaders(
        args.loader, source, split, args.batch_size, place.rank, place.world_size, device, args.seed + place.rank
    )
    return Setup(device, group, dist.get_backend(group), precision, hardware, source, split, loaders)


def agree_on_precision(args, place, device):
    """Every rank's --precision decision must be rank 0's: nodes of unlike CPUs would otherwise train in
    different numerics under `auto`. Returns the Precision and the distinct hardware of all ranks."""
    precision = agree(place, lambda: choose_precision(args.precision, device))
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
