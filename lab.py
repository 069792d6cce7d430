"""What train.py, verify.py and infer.py share: the fixed experiment, the counts it implies, the artifact layout.

Each fact lives here once: the documented configuration (5 epochs, local batch 50, accum_steps 4, seed 47,
world size 2, a 40,000/10,000 split), the accumulation window plan that train.py executes and verify.py
counts, the arithmetic from a configuration to the exact communication per epoch, the names of the artifacts,
and the all-or-nothing way they are written.
"""
import argparse
import hashlib
import io
import json
import math
import os
import shutil
import socket
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
from PIL import Image, PngImagePlugin

from model import CLASSES

MODES = ("every", "no_sync")
PARTIAL_WINDOW_POLICIES = ("error", "scale")

# The experiment of the document; train.py's defaults and verify.py's strict audit both come from here.
DOCUMENTED = {
    "world_size": 2,
    "batch_size": 50,
    "accum_steps": 4,
    "epochs": 5,
    "seed": 47,
    "partial_window": "error",
    "train_size": 40_000,
    "validation_size": 10_000,
    "test_size": 10_000,
}
VALIDATION_FRACTION = 5  # the last fifth of the seeded permutation of the train source is validation
BUCKET_CAP_MB = 25  # explicit: DDP's default would cap the first bucket at 1 MiB and split the gradients in two
BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024  # DDP's broadcast_bucket_size for buffers
# Once, after its first synchronized backward, DDP rebuilds its buckets and broadcasts rank 0's bucket order:
# the bucket indices and the bucket sizes, two collectives (tests/test_comm_audit.py checks them against the
# profiler's c10d::broadcast_ events).
REBUILD_BROADCASTS = 2

# The two dataset layouts train.py reads: image folders train/<class>/ and test/<class>/ holding these files,
# or torchvision's CIFAR-10 (its pickled batches in this folder).
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
TORCHVISION_FOLDER = "cifar-10-batches-py"

# Artifact names inside one run folder (artifacts/every, artifacts/no_sync).
MODEL_FILE = "model.pt"
HISTORY_FILE = "history.json"
REPORT_FILE = "report.json"
SAMPLE_FILE = "sample_test.png"
CONFUSION_FILE = "confusion_matrix.png"
RUN_RECORD_FILE = "run.json"  # written last: the run's id, configuration and the checksum of every other file
RUN_FILES = (MODEL_FILE, HISTORY_FILE, REPORT_FILE, SAMPLE_FILE, CONFUSION_FILE)
# Written by train.py --profile-windows K: the profiled windows' summary (every rank) and rank 0's trace.
PROFILE_FILE = "profile.json"
PROFILE_TRACE_FILE = "profile_trace.json"
# The kinds of collective the profile tells apart in training: DDP's gradient all-reduce, the lab's own
# all-reduce of the ranks' fingerprints after each step, and DDP's broadcasts.
COLLECTIVE_KINDS = ("gradient all-reduce", "rank-agreement all-reduce", "broadcast")
# Pictures verify.py draws from both runs, next to the run folders.
CURVES_FILE = "curves.png"
COMMUNICATION_FILE = "communication.png"
TIMELINE_FILE = "timeline.png"


class LabError(Exception):
    """A mistake in the input or the environment: reported as one line that names the remedy, no traceback.

    kind, when given, is the exception name the document's troubleshooting uses for this case
    ("ValueError: expected world_size=2, got 1"), kept so that the message can be searched for.
    """

    exit_code = 2

    def __init__(self, message, kind=None):
        super().__init__(message)
        self.kind = kind

    def line(self, script):
        return f"{self.kind}: {self}" if self.kind else f"{script}: error: {self}"


def exit_with(error, script, show=True):
    if show:
        print(error.line(script), file=sys.stderr, flush=True)
    sys.exit(error.exit_code)


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors: the problem and where to look, without the usage block."""

    def usage_error(self, message):
        return LabError(f"{message} (see: python {self.prog} --help)")

    def error(self, message):
        # A script under torchrun (the benchmarks) parses the same options in every process: one line per node.
        exit_with(self.usage_error(message), self.prog, show=os.environ.get("LOCAL_RANK", "0") == "0")


def positive_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_float(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of at least 0, got {text}")
    return value


def node_device(local_world_size):
    """The lab's one device policy, per node: CUDA when this node has a GPU for each of its processes
    (torchrun's LOCAL_WORLD_SIZE), else CPU. Returns the device type and the number of visible GPUs."""
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return ("cuda" if visible >= local_world_size else "cpu"), visible


def free_loopback_port():
    """A TCP port free on 127.0.0.1 now, for the rendezvous of a run emulated on one machine."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def loopback_node_command(node, nodes, port, script_args):
    """The torchrun command of node `node` of a multi-node run emulated on one machine (the tests, the
    network benchmark): one process per node, c10d rendezvous hosted by node 0, all traffic on 127.0.0.1.
    On real machines only the endpoint and the node's own address differ (README "Across machines")."""
    return [
        sys.executable, "-m", "torch.distributed.run",
        f"--nnodes={nodes}", f"--node-rank={node}", "--nproc-per-node=1",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=lab-{port}",
        f"--rdzv-conf=is_host={int(node == 0)}", "--local-addr=127.0.0.1",
        *map(str, script_args),
    ]  # fmt: skip


def is_image_folder_tree(data_dir):
    """Image folders take precedence: a data folder with train/ or test/ is read as one."""
    return (Path(data_dir) / "train").exists() or (Path(data_dir) / "test").exists()


# ----------------------------------------------------------------------------- the accumulation window


@dataclass(frozen=True)
class MicroStep:
    """What one micro-batch does: all-reduce in its backward (in no_sync mode), divide its loss, step after it."""

    sync: bool
    loss_divisor: int
    step: bool


def window_plan(num_micro_batches, accum_steps, partial_window):
    """The micro-batches of one epoch grouped into windows of accum_steps; the last one of each window syncs.

    With partial_window="error" a remainder stops the run (divided by accum_steps, a short last window would
    shrink its update); with "scale" the short window's losses are divided by its real length, so every
    update is the mean over its own micro-batches.
    """
    remainder = num_micro_batches % accum_steps
    if remainder and partial_window == "error":
        raise LabError(
            f"{num_micro_batches} micro-batch-uri nu se împart exact la accum_steps={accum_steps} "
            f"(a last window of {remainder} divided by {accum_steps} would shrink that update's gradient); "
            f"choose --accum-steps that divides {num_micro_batches}, or pass --partial-window scale",
            kind="RuntimeError",
        )
    plan = []
    for window_start in range(0, num_micro_batches, accum_steps):
        window_size = min(accum_steps, num_micro_batches - window_start)
        for position in range(window_size):
            closes_window = position == window_size - 1
            plan.append(MicroStep(sync=closes_window, loss_divisor=window_size, step=closes_window))
    return plan


def planned_positions(plan, mode):
    """Where the plan puts the gradient syncs and the optimizer steps: micro-batch indices in the epoch."""
    return {
        "gradient_syncs": [index for index, micro_step in enumerate(plan) if mode == "every" or micro_step.sync],
        "optimizer_steps": [index for index, micro_step in enumerate(plan) if micro_step.step],
    }


def as_progressions(positions):
    """Sorted indices as arithmetic runs [start, stop, step] (stop exclusive, as in range()), each as long as
    it goes: every's 400 syncs of an epoch are [[0, 400, 1]], no_sync's 100 are [[3, 400, 4]]."""
    runs, index = [], 0
    while index < len(positions):
        start = positions[index]
        if index + 1 == len(positions):
            runs.append([start, start + 1, 1])
            break
        step, last = positions[index + 1] - start, index + 1
        while last + 1 < len(positions) and positions[last + 1] - positions[last] == step:
            last += 1
        runs.append([start, positions[last] + 1, step])
        index = last + 1
    return runs


def from_progressions(runs):
    return [position for start, stop, step in runs for position in range(start, stop, step)]


def micro_batches_per_rank(train_size, world_size, batch_size):
    """DistributedSampler(drop_last=False) pads the split to a multiple of world_size; the loader keeps a last
    short batch."""
    return math.ceil(math.ceil(train_size / world_size) / batch_size)


def split_sizes(source_size):
    """(train, validation) sizes of a train source: the last fifth of the permutation is validation."""
    validation_size = source_size // VALIDATION_FRACTION
    return source_size - validation_size, validation_size


# ----------------------------------------------------------------------------- expected communication


@dataclass(frozen=True)
class CommSizes:
    """What one synchronization moves, read off the model: its gradients and its buffers."""

    gradient_bytes: int
    gradient_buckets: int
    buffer_bytes: int
    buffer_dtype_groups: int


def comm_sizes(model):
    gradient_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    buffers = list(model.buffers())
    buffer_bytes = sum(b.numel() * b.element_size() for b in buffers)
    if buffer_bytes > BROADCAST_BUCKET_BYTES:
        raise ValueError("the buffers exceed one broadcast bucket; buffer_dtype_groups would undercount")
    return CommSizes(
        gradient_bytes=gradient_bytes,
        gradient_buckets=math.ceil(gradient_bytes / (BUCKET_CAP_MB * 1024 * 1024)),
        buffer_bytes=buffer_bytes,
        # DDP's _broadcast_coalesced flattens the buffers into one tensor per dtype (float32 running stats,
        # int64 num_batches_tracked): one broadcast collective each.
        buffer_dtype_groups=len({b.dtype for b in buffers}),
    )


def buffer_syncs_in_epoch(plan, mode, first_epoch):
    """How often DDP (broadcast_buffers=True) broadcasts the BatchNorm buffers in one epoch.

    DDP broadcasts before a forward when the forward before it was a synchronized training forward (and
    before the very first forward). Under no_sync only the forward after a window's last micro-batch
    qualifies; an evaluation forward (no grad) never does, so each epoch after the first starts without one,
    and its validation pass adds one (its first forward follows the last, synchronized training forward).
    """
    previous_synchronized = first_epoch
    count = 0
    for micro_step in plan:
        count += previous_synchronized
        previous_synchronized = mode == "every" or micro_step.sync
    return count + previous_synchronized


def bucket_rebuild_epoch(plan, mode):
    """The epoch of DDP's bucket rebuild: at the first training forward after the first synchronized one,
    which falls in epoch 2 when epoch 1 has no training forward after its first sync."""
    first_synchronized = next(index for index, micro_step in enumerate(plan) if mode == "every" or micro_step.sync)
    return 1 if first_synchronized + 1 < len(plan) else 2


def epoch_plan(config):
    """The window plan every epoch of a run with this configuration executes."""
    return window_plan(
        micro_batches_per_rank(config["train_size"], config["world_size"], config["batch_size"]),
        config["accum_steps"],
        config["partial_window"],
    )


def expected_epoch_counts(config, mode, epoch, sizes):
    """The exact per-rank counts of one epoch (1-based) of a run with this configuration."""
    plan = epoch_plan(config)
    gradient_syncs = len(plan) if mode == "every" else sum(m.sync for m in plan)
    buffer_syncs = buffer_syncs_in_epoch(plan, mode, first_epoch=epoch == 1)
    return {
        "optimizer_steps": sum(m.step for m in plan),
        "gradient_syncs": gradient_syncs,
        "sync_bucket_calls": gradient_syncs * sizes.gradient_buckets,
        "allreduce_bytes": gradient_syncs * sizes.gradient_bytes,
        "buffer_broadcast_collectives": buffer_syncs * sizes.buffer_dtype_groups,
        "broadcast_bytes": buffer_syncs * sizes.buffer_bytes,
        "rebuild_broadcast_collectives": REBUILD_BROADCASTS if epoch == bucket_rebuild_epoch(plan, mode) else 0,
    }


# ----------------------------------------------------------------------------- results


def top_confusions(matrix, limit=5):
    """The most frequent off-diagonal (true, predicted, count) pairs: count descending, then class order."""
    pairs = [
        (count, true, predicted)
        for true, row in enumerate(matrix)
        for predicted, count in enumerate(row)
        if true != predicted and count > 0
    ]
    pairs.sort(key=lambda pair: (-pair[0], pair[1], pair[2]))
    return [{"true": CLASSES[true], "predicted": CLASSES[predicted], "count": count} for count, true, predicted in pairs[:limit]]


# ----------------------------------------------------------------------------- artifacts, all or nothing


def new_run_id():
    return datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ-") + os.urandom(3).hex()


def utc_now():
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def write_atomic(path, data):
    """Write bytes to path so that a reader sees the old file or the whole new one, never a part."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(temporary, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)  # a full disk or an interrupt leaves nothing half-written behind
        raise


def json_bytes(value):
    return (json.dumps(value, indent=2) + "\n").encode("utf-8")


def png_bytes(image, text):
    """PNG bytes with text chunks (run_id, plotted data) that verify.py and the tests read back."""
    info = PngImagePlugin.PngInfo()
    for key, value in text.items():
        info.add_text(key, value)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", pnginfo=info)
    return buffer.getvalue()


def png_text(path):
    with Image.open(path) as image:
        image.load()
        return dict(image.text)


def torch_bytes(value):
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def sha256_file(path):
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def unfinished_runs(output):
    """Hidden folders of runs into `output` that started and never finished (killed, crashed)."""
    output = Path(output)
    return sorted(output.parent.glob(f".{output.name}.partial-*"))


def replaced_runs(output):
    """Hidden folders of runs that a newer run replaced, left when publishing was interrupted."""
    output = Path(output)
    return sorted(output.parent.glob(f".{output.name}.replaced-*"))


def is_replaceable_output(output):
    """A folder train.py may replace: absent, empty, or holding nothing but lab artifacts."""
    output = Path(output)
    if not output.exists():
        return True
    if not output.is_dir():
        return False
    allowed = set(RUN_FILES) | {RUN_RECORD_FILE, PROFILE_FILE, PROFILE_TRACE_FILE}
    return all(entry.name in allowed for entry in output.iterdir())


class RunFolder:
    """The artifacts of one run, written into a hidden sibling folder and moved into place when complete.

    While a run is going, `.every.partial-<run id>/` beside `every/` holds what it has written so far (its
    history after each epoch). Publishing writes run.json last, with the size and SHA-256 of every file, and
    renames the folder into place: a reader finds the previous complete run or the new complete run, never a
    mix. A killed run leaves only its partial folder, which the next run into the same output removes.

    Replacing a run takes two renames (the old folder aside as `.every.replaced-<new run id>`, the new one into
    place) and a removal. A crash between them leaves both hidden folders and no `every/`; a crash during the
    removal leaves part of the replaced folder. verify.py names each such leftover, and the next run into the
    same output removes them before it starts.
    """

    def __init__(self, output, run_id):
        self.output = Path(output)
        self.run_id = run_id
        self.partial = self.output.parent / f".{self.output.name}.partial-{run_id}"

    def begin(self):
        for stale in unfinished_runs(self.output) + replaced_runs(self.output):
            shutil.rmtree(stale)
        self.partial.mkdir(parents=True)

    def write(self, name, data):
        write_atomic(self.partial / name, data)

    def publish(self, record):
        files = {
            path.name: {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
            for path in sorted(self.partial.iterdir())
        }
        self.write(RUN_RECORD_FILE, json_bytes({**record, "files": files}))
        replaced = None
        if self.output.exists():
            replaced = self.output.parent / f".{self.output.name}.replaced-{self.run_id}"
            os.rename(self.output, replaced)
        os.rename(self.partial, self.output)
        if replaced is not None:
            shutil.rmtree(replaced)

