"""How close the lab runs to its compute floor, and what each of its parts costs, in one run on one machine.

    .venv/bin/python benchmarks/bench_speed.py --data-dir /tmp/cifar10-jpeg            # as make lab: 2 ranks
    .venv/bin/python benchmarks/bench_speed.py --data-dir data --nproc-per-node 1 --device cuda    # one GPU

Back to back, on the same machine:
1. the compute floor: CifarCNN's forward, backward and AdamW step (train.make_optimizer) on random tensors
   already on the device, at the lab's micro-batch (--batch-size: the documented 50) and numerics (--precision,
   channels_last), one process per rank running at once as in the lab (torchrun: one thread each on CPU), no
   DDP, no data; and the
   evaluation forward alone;
2. the audit's overhead: on those tensors, the document's no_sync loop on plain DDP against the lab's loop
   (train.train_epoch on the audited DDP: counts, sync and step positions, the ranks' fingerprints at every
   optimizer step, the checklist's witnesses), and the lab's loop without the witnesses, taking turns; the
   witnesses' hooks' own time summed;
3. the lab itself: `train.py --mode no_sync --epochs 1` with each loader, the whole process timed, its
   training phase (epoch_seconds) and validation (validation_seconds) read from its history.
Efficiency = floor / measured. The table is printed and written with everything measured to
artifacts/bench/speed.json. The image-folder decode cache is built first (timed), so neither loader's run
pays for it.
"""

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from functools import partial
from pathlib import Path

import torch

from ddp_no_sync_lab import cli, experiment, files
from ddp_no_sync_lab.audit import checklist, face, instruments
from ddp_no_sync_lab.precision import PRECISIONS, choose_precision
from ddp_no_sync_lab.run import launch
from ddp_no_sync_lab.tasks import data, loaders

REPO = Path(__file__).resolve().parents[1]

SCRIPT = "bench_speed.py"
RUN_TIMEOUT = 1800


def parse_args(argv=None):
    documented = experiment.DOCUMENTED
    parser = cli.ArgumentParser(prog=SCRIPT, description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, default=Path("data"), help="the dataset the lab's runs read")
    parser.add_argument("--nproc-per-node", type=cli.positive_int, default=documented["world_size"])
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--precision", choices=PRECISIONS, default="auto", help="as train.py --precision")
    parser.add_argument(
        "--batch-size", type=cli.positive_int, default=documented["batch_size"], help="images per micro-batch"
    )
    parser.add_argument("--windows", type=cli.positive_int, default=10, help="accumulation windows per floor sample")
    parser.add_argument("--repeats", type=cli.positive_int, default=3, help="samples per floor and audit variant")
    parser.add_argument("--output", type=Path, default=Path("artifacts/bench/speed.json"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # the torchrun part, 1 and 2
    return parser.parse_args(argv)


# ----------------------------------------------------------------------------- 1 and 2: under torchrun


def worker(args):
    """Each rank measures the floor and the audit's overhead; rank 0 prints one JSON line."""
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import train
    from model import MEMORY_FORMAT, CifarCNN

    place = launch.launch_environment(None)
    with launch.c_stdout_to_stderr():
        dist.init_process_group("gloo")
    device_type = launch.choose_device(args.device, place)
    if device_type == "cuda":
        torch.cuda.set_device(place.local_rank)
    device = torch.device(device_type, place.local_rank if device_type == "cuda" else None)
    group = dist.new_group(backend="nccl") if device.type == "cuda" else None
    batch, accum = args.batch_size, experiment.DOCUMENTED["accum_steps"]
    micro_batches = args.windows * accum
    torch.manual_seed(place.rank)
    inputs = torch.randn(batch, 3, 32, 32, device=device).contiguous(memory_format=MEMORY_FORMAT)
    targets = torch.randint(0, 10, (batch,), device=device)
    criterion = nn.CrossEntropyLoss()
    precision = choose_precision(args.precision, device)
    autocast = partial(precision.autocast, device.type)
    initial_state = CifarCNN().state_dict()

    def fresh_model():
        model = CifarCNN()
        model.load_state_dict(initial_state)
        return model.to(device, memory_format=MEMORY_FORMAT)

    def timed(body):
        dist.barrier()  # every rank starts together: they share the machine as in the lab
        started = instruments.read_clock(device)
        body()
        return instruments.read_clock(device) - started

    model = fresh_model()
    optimizer = train.make_optimizer(model.parameters(), device)

    def train_windows():
        for micro_batch in range(micro_batches):
            with autocast():
                loss = criterion(model(inputs), targets)
            (loss / accum).backward()
            if (micro_batch + 1) % accum == 0:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

    @torch.no_grad()
    def evaluate_batches():
        model.eval()
        for _ in range(micro_batches):
            with autocast():
                criterion(model(inputs), targets)
        model.train()

    plan = experiment.window_plan(micro_batches, accum, "error")
    loader = [(inputs, targets)] * micro_batches
    progress = cli.Progress(enabled=False, interval=0)

    def document_loop():
        """The document's no_sync loop on plain DDP: nothing counted, traced or compared across ranks."""
        ddp_model = DDP(
            fresh_model(), device_ids=device_ids(device), bucket_cap_mb=experiment.BUCKET_CAP_MB, process_group=group
        )
        ddp_optimizer = train.make_optimizer(ddp_model.parameters(), device)

        def body():
            for micro_step in plan:
                with ddp_model.no_sync() if not micro_step.sync else nullcontext():
                    with autocast():
                        loss = criterion(ddp_model(inputs), targets)
                    (loss / micro_step.loss_divisor).backward()
                if micro_step.step:
                    ddp_optimizer.step()
                    ddp_optimizer.zero_grad(set_to_none=True)

        return body

    def lab_loop(witnesses):
        """train.train_epoch on the audited DDP: counts, positions and the ranks' fingerprints at every step,
        with the checklist's witnesses (their hooks' own time summed) or without them."""
        ddp_model, comm_audit = train.wrap_model(fresh_model(), device, place.world_size, group)
        ddp_optimizer = train.make_optimizer(ddp_model.parameters(), device)
        audit = face.Audit(comm_audit, witnesses(ddp_model, ddp_optimizer, criterion, comm_audit, device))
        return lambda: train.train_epoch(
            ddp_model, audit, loader, plan, "no_sync", ddp_optimizer, criterion, device, autocast, progress
        )

    bodies = {
        "train": train_windows,
        "evaluate": evaluate_batches,
        "document loop": document_loop(),
        "lab loop": lab_loop(TimedWitness),
        "lab loop without the checklist": lab_loop(Unwitnessed),
    }
    for body in bodies.values():  # warm-up: first-call allocations and kernel choices
        body()
    samples = {name: [] for name in bodies}
    for _ in range(args.repeats):  # in turn, so that a drift of the machine's speed touches every variant
        for name, body in bodies.items():
            samples[name].append(timed(body) / micro_batches)
    timed_micro_batches = (args.repeats + 1) * micro_batches
    samples["checklist hooks"] = (TimedWitness.seconds - TimedWitness.collective_seconds) / timed_micro_batches
    samples["checklist collective"] = TimedWitness.collective_seconds / timed_micro_batches
    gathered = [None] * place.world_size
    dist.all_gather_object(gathered, samples)
    if place.rank == 0:
        # Per variant, the median over repeats of the slowest rank (the lab waits for its slowest rank).
        medians = {
            name: statistics.median(
                max(rank_samples[name][repeat] for rank_samples in gathered) for repeat in range(args.repeats)
            )
            for name in bodies
        }
        hooks, collective = (max(rank_samples[part] for rank_samples in gathered) for part in CHECKLIST_PARTS)
        print(
            json.dumps(
                {
                    "seconds_per_micro_batch": medians,
                    "checklist_hook_seconds_per_micro_batch": hooks,
                    "checklist_collective_seconds_per_micro_batch": collective,
                    "threads": torch.get_num_threads(),
                    "device": str(device),
                    "precision": precision.name,
                    "precision_reason": precision.reason,
                }
            )
        )
    instruments.settle_comm_hooks()
    dist.destroy_process_group()


class TimedWitness(checklist.Witness):
    """The checklist's witnesses with the host time spent in their hooks summed, and apart the time of their
    all-reduce at each step (which includes waiting for the slower rank, a wait the step's next collective would
    otherwise absorb)."""

    seconds = collective_seconds = 0.0

    def reduce_window(self):
        started = time.perf_counter()
        try:
            return super().reduce_window()
        finally:
            TimedWitness.collective_seconds += time.perf_counter() - started


CHECKLIST_PARTS = ("checklist hooks", "checklist collective")


def timed_hook(hook):
    def timed(self, *args):
        started = time.perf_counter()
        try:
            return hook(self, *args)
        finally:
            TimedWitness.seconds += time.perf_counter() - started

    return timed


for name in (
    "on_forward",
    "on_loss",
    "on_logits_gradient",
    "on_parameter_gradient",
    "on_sync",
    "read_synced",
    "on_step_begin",
    "on_step_end",
):
    setattr(TimedWitness, name, timed_hook(getattr(checklist.Witness, name)))


class Unwitnessed:
    """No witnesses: train_epoch's call to begin an epoch does nothing (the loop otherwise the lab's)."""

    def __init__(self, *args):
        pass

    def begin_epoch(self, trace):
        pass


def device_ids(device):
    return [device.index] if device.type == "cuda" else None


# ----------------------------------------------------------------------------- 3 and the table


def torchrun(nproc, *script_args, env=None):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", f"--nproc-per-node={nproc}"]
    started = time.perf_counter()
    result = subprocess.run(
        [*command, *map(str, script_args)], capture_output=True, text=True, cwd=REPO, timeout=RUN_TIMEOUT, env=env
    )
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        lines = result.stderr.strip().splitlines()
        reason = [line for line in lines if ": error:" in line] or lines[-15:]  # the script's own line first
        raise cli.LabError(
            f"{' '.join(map(str, script_args[:3]))} failed (exit {result.returncode}): {' '.join(reason)}"
        )
    return result, seconds


def lab_run(args, loader, workspace):
    """One no_sync epoch of train.py with this loader: whole-process seconds, and its history and config."""
    output = workspace / loader
    options = ["--mode", "no_sync", "--epochs", "1", "--output", output, "--data-dir", args.data_dir.resolve()]
    options += ["--device", args.device, "--precision", args.precision, "--loader", loader, "--quiet"]
    options += ["--batch-size", args.batch_size]
    _, seconds = torchrun(
        args.nproc_per_node, REPO / "train.py", *options, "--expected-world-size", args.nproc_per_node
    )
    (row,) = json.loads((output / files.HISTORY_FILE).read_text())
    config = json.loads((output / files.RUN_RECORD_FILE).read_text())["config"]
    micro_batches = experiment.micro_batches_per_rank(config["train_size"], config["world_size"], config["batch_size"])
    validation_batches = math.ceil(math.ceil(config["validation_size"] / config["world_size"]) / config["batch_size"])
    return {
        "process_seconds": seconds,
        "epoch_seconds": row["epoch_seconds"],
        "validation_seconds": row["validation_seconds"],
        "train_micro_batches_per_rank": micro_batches,
        "validation_batches_per_rank": validation_batches,
        "train_seconds_per_micro_batch": row["epoch_seconds"] / micro_batches,
        "validation_seconds_per_batch": row["validation_seconds"] / validation_batches,
        "train_images_per_second": row["train_images_per_second"],
        "gradient_syncs": row["gradient_syncs"],
        "optimizer_steps": row["optimizer_steps"],
        "device": config["device"],
        "precision": config["precision"],
        "world_size": config["world_size"],
    }


def table_rows(floor, runs):
    """(part, measured ms, floor ms) per line; efficiency = floor / measured."""
    rows = []
    for loader, run in runs.items():
        rows.append((f"training, no_sync, {loader} loader", run["train_seconds_per_micro_batch"], floor["train"]))
    for loader, run in runs.items():
        rows.append((f"validation, {loader} loader", run["validation_seconds_per_batch"], floor["evaluate"]))
    rows.append(
        ("lab loop with its audit, no_sync (vs the document's loop)", floor["lab loop"], floor["document loop"])
    )
    rows.append(
        (
            "lab loop with the checklist's witnesses (vs without them)",
            floor["lab loop"],
            floor["lab loop without the checklist"],
        )
    )
    return rows


def print_table(rows, runs, cache_seconds):
    print("| part | measured ms per micro-batch | floor ms | efficiency |")
    print("|---|---:|---:|---:|")
    for part, measured, floor in rows:
        print(f"| {part} | {measured * 1000:.1f} | {floor * 1000:.1f} | {floor / measured:.1%} |")
    print()
    print("| loader | whole process s (1 epoch, evaluation included) | training s | img/s (all ranks) |")
    print("|---|---:|---:|---:|")
    for loader, run in runs.items():
        print(
            f"| {loader} | {run['process_seconds']:.1f} | {run['epoch_seconds']:.1f} | {run['train_images_per_second']:.0f} |"
        )
    if cache_seconds is not None:
        print(f"\nimage folders decoded into the cache once, before the runs: {cache_seconds:.1f} s")


def machine(device):
    name = torch.cuda.get_device_name(0) if device == "cuda" else platform.processor() or platform.machine()
    return {
        "device": device,
        "name": name,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def main():
    args = parse_args()
    if args.worker:
        return worker(args)
    cache_seconds = None
    try:
        started = time.perf_counter()
        data.prepare_data(args.data_dir)
        if data.is_image_folder_tree(args.data_dir):
            cache_seconds = time.perf_counter() - started
        options = ["--device", args.device, "--precision", args.precision]
        options += ["--windows", args.windows, "--repeats", args.repeats, "--batch-size", args.batch_size]
        result, _ = torchrun(args.nproc_per_node, Path(__file__).resolve(), "--worker", *options)
        measured = json.loads(result.stdout.strip().splitlines()[-1])
        floor = measured["seconds_per_micro_batch"]
        with tempfile.TemporaryDirectory(prefix="bench-speed-") as workspace:
            runs = {loader: lab_run(args, loader, Path(workspace)) for loader in loaders.LOADERS}
    except cli.LabError as error:
        cli.exit_with(error, SCRIPT)
    device = runs["tensor"]["device"]
    print(
        f"{args.nproc_per_node} process(es) on {device}, {measured['threads']} thread(s) each, micro-batch "
        f"{args.batch_size}, channels_last; floor: median of {args.repeats} x {args.windows} windows\n"
        f"precision: {measured['precision_reason']}"
    )
    rows = table_rows(floor, runs)
    print_table(rows, runs, cache_seconds)
    hooks, collective = (measured[f"checklist_{part}_seconds_per_micro_batch"] for part in ("hook", "collective"))
    print(
        f"\nthe checklist's witnesses, their own code: {hooks * 1000:.2f} ms per micro-batch, "
        f"{hooks / floor['lab loop']:.1%} of the lab loop's micro-batch; their all-reduce at each step, waits "
        f"included: {collective * 1000:.2f} ms per micro-batch ({collective / floor['lab loop']:.1%})"
    )
    settings = ("data_dir", "nproc_per_node", "device", "precision", "batch_size", "windows", "repeats")
    report = {
        "machine": machine(device),
        "precision": measured["precision"],
        "precision_reason": measured["precision_reason"],
        "settings": {
            name: str(getattr(args, name)) if name == "data_dir" else getattr(args, name) for name in settings
        },
        "floor_seconds_per_micro_batch": floor,
        **{key: value for key, value in measured.items() if key.startswith("checklist_")},
        "lab_runs": runs,
        "decode_cache_seconds": cache_seconds,
        "rows": [{"part": part, "measured_seconds": m, "floor_seconds": f, "efficiency": f / m} for part, m, f in rows],
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    files.write_atomic(args.output, files.json_bytes(report))
    print(f"\nwritten: {args.output}")


if __name__ == "__main__":
    main()
