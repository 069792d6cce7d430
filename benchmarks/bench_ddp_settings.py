"""DDP's other levers on communication under the lab's audit: each setting and gradient hook, both modes.

    .venv/bin/python benchmarks/bench_ddp_settings.py                        # 2 CPU ranks, 5 windows per run
    .venv/bin/python benchmarks/bench_ddp_settings.py --windows 2 --batch-size 4 --precision fp32

One torchrun (2 ranks, gloo) trains CifarCNN with train.py's own pieces (train.wrap_model with the setting,
train.train_epoch, train.evaluate) from one initial state, on the same random images, for each setting and each
mode: --windows windows of the documented accum_steps 4, then one validation pass. Per row: the audit's counts
against those experiment.expected_epoch_counts derives from the setting; the bytes handed to all-reduce as a
witness in the process sees them (torch.distributed.all_reduce wrapped: every 16- and 32-bit floating tensor,
which are the gradients; the lab's own all-reduces carry int64 and float64); whether the weights and rank 0's
BatchNorm buffers equal the documented setting's bit for bit; seconds per window. A combination DDP refuses is
a row holding train.py's one line. What compression changes is measured on one synchronized backward: the
all-reduced gradients against the uncompressed all-reduce's. Printed, and written to
artifacts/bench/ddp_settings.json.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
from functools import partial
from pathlib import Path

import torch

from ddp_no_sync_lab import cli, experiment, files
from ddp_no_sync_lab.audit import face, instruments
from ddp_no_sync_lab.precision import PRECISIONS, choose_precision
from ddp_no_sync_lab.strategies import ddp
from model import CifarCNN

REPO = Path(__file__).resolve().parents[1]

SCRIPT = "bench_ddp_settings.py"
RUN_TIMEOUT = 1800
# Each lever alone, the rest as documented.
SETTINGS = {
    "documented": {},
    "bucket_cap_mb=0.5": {"bucket_cap_mb": 0.5},
    "broadcast_buffers=False": {"broadcast_buffers": False},
    "find_unused_parameters=True": {"find_unused_parameters": True},
    "gradient_as_bucket_view=True": {"gradient_as_bucket_view": True},
    "static_graph=True": {"static_graph": True},
    "comm_hook=bf16": {"comm_hook": "bf16"},
    "comm_hook=fp16": {"comm_hook": "fp16"},
}
GRADIENT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def parse_args(argv=None):
    parser = cli.ArgumentParser(prog=SCRIPT, description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=cli.positive_int, default=5, help="accumulation windows per run")
    parser.add_argument("--batch-size", type=cli.positive_int, default=experiment.DOCUMENTED["batch_size"])
    parser.add_argument("--precision", choices=PRECISIONS, default="auto", help="as train.py --precision")
    parser.add_argument("--output", type=Path, default=Path("artifacts/bench/ddp_settings.json"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # the torchrun part
    return parser.parse_args(argv)


# ----------------------------------------------------------------------------- under torchrun


class AllReduceWitness:
    """torch.distributed.all_reduce wrapped in this process: the bytes of the gradient tensors handed to it (by
    the lab's hook or by torch's compressing hooks, which call it the same way), from any thread."""

    def __init__(self, dist):
        self.bytes, self.lock, original = 0, threading.Lock(), dist.all_reduce

        def all_reduce(tensor, *args, **kwargs):
            if tensor.dtype in GRADIENT_DTYPES:
                with self.lock:
                    self.bytes += tensor.numel() * tensor.element_size()
            return original(tensor, *args, **kwargs)

        dist.all_reduce = all_reduce


def worker(args):
    """Every row on every rank; rank 0 prints one JSON line."""
    import torch.distributed as dist
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    import train
    from model import MEMORY_FORMAT

    dist.init_process_group("gloo")
    world_size, rank, cpu = dist.get_world_size(), dist.get_rank(), torch.device("cpu")
    witness = AllReduceWitness(dist)
    accum = experiment.DOCUMENTED["accum_steps"]
    micro_batches = args.windows * accum
    torch.manual_seed(0)
    count = args.batch_size * micro_batches * world_size
    images = TensorDataset(torch.randn(count, 3, 32, 32), torch.randint(0, 10, (count,)))
    sampler = DistributedSampler(images, shuffle=True, seed=0)
    loader = DataLoader(images, batch_size=args.batch_size, sampler=sampler)
    validation = DataLoader(images, batch_size=args.batch_size, sampler=DistributedSampler(images, shuffle=False))
    plan = experiment.window_plan(micro_batches, accum, "error")
    precision = choose_precision(args.precision, cpu)
    autocast = partial(precision.autocast, "cpu")
    criterion = nn.CrossEntropyLoss()
    progress = cli.Progress(enabled=False, interval=0)
    initial_state = CifarCNN().state_dict()
    sizes = experiment.comm_sizes(CifarCNN())
    config = {"train_size": count, "world_size": world_size, "batch_size": args.batch_size, "accum_steps": accum}
    config |= {"partial_window": "error", "epochs": 1}

    def wrapped(settings):
        model = CifarCNN()
        model.load_state_dict(initial_state)
        model = model.to(cpu, memory_format=MEMORY_FORMAT)
        return train.wrap_model(model, cpu, world_size, settings={**experiment.DDP_DEFAULTS, **settings})

    broken = []  # wrappers whose reducer failed its own assert: destroyed, they would abort the process

    def run(settings, mode):
        ddp_model, comm_audit = wrapped(settings)
        optimizer = train.make_optimizer(ddp_model.parameters(), cpu)
        sampler.set_epoch(0)
        witness.bytes = 0
        dist.barrier()
        started = instruments.read_clock(cpu)
        try:
            with ddp.ddp_errors_explained():
                audit = face.attach(ddp_model, optimizer, criterion, comm_audit, cpu)
                train.train_epoch(ddp_model, audit, loader, plan, mode, optimizer, criterion, cpu, autocast, progress)
        except cli.LabError as error:
            broken.append(ddp_model)
            return {"refused": error.line("train.py")}, None
        seconds = instruments.read_clock(cpu) - started
        sent = witness.bytes
        train.evaluate(ddp_model, validation, criterion, cpu, autocast, progress, "validation")
        counts = {name: comm_audit.totals()[name] for name in experiment.COUNTS}
        expected = experiment.expected_epoch_counts({**config, **settings}, mode, 1, sizes)
        row = {
            "counts": counts,
            "expected": {name: expected[name] for name in experiment.COUNTS},
            "witnessed_allreduce_bytes": sent,
            "seconds_per_window": seconds / args.windows,
        }
        return row, {name: value.clone() for name, value in ddp_model.module.state_dict().items()}

    def synchronized_gradients(comm_hook):
        """The gradients after one synchronized backward (every rank on its own images) with this hook."""
        ddp_model, _ = wrapped({"comm_hook": comm_hook})
        inputs, targets = next(iter(loader))
        with autocast():
            loss = criterion(ddp_model(inputs.contiguous(memory_format=MEMORY_FORMAT)), targets)
        loss.backward()
        return torch.cat([parameter.grad.flatten() for parameter in ddp_model.parameters()])

    rows, documented = [], {}
    for name, settings in SETTINGS.items():
        for mode in experiment.MODES:
            row, state = run(settings, mode)
            if name == "documented":
                documented[mode] = state
            elif state is not None:
                row["weights_equal_documented"] = all(torch.equal(state[key], documented[mode][key]) for key in state)
                row["largest_weight_difference"] = max(
                    (state[key].double() - documented[mode][key].double()).abs().max().item() for key in state
                )
            rows.append({"setting": name, "mode": mode, **row})
    reference = synchronized_gradients("allreduce")
    compression = {}
    for comm_hook in experiment.COMM_HOOKS[1:]:
        difference = synchronized_gradients(comm_hook) - reference
        compression[comm_hook] = {
            "relative_difference": (difference.norm() / reference.norm()).item(),
            "largest_difference": difference.abs().max().item(),
            "largest_gradient": reference.abs().max().item(),
        }
    if rank == 0:
        print(json.dumps({"rows": rows, "compression": compression, "precision": precision.name}), flush=True)
    instruments.settle_comm_hooks()
    dist.destroy_process_group()
    if broken:  # leave without destroying them (train.py ends the same way after such a refusal)
        sys.stdout.flush()
        os._exit(0)


# ----------------------------------------------------------------------------- the table


def print_table(rows, compression, gradient_bytes):
    print(
        "| setting | mode | syncs | bucket calls | MB all-reduced (witness) | buffer broadcasts | rebuild broadcasts "
        "| used-map all-reduces | counts as derived |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    for row in rows:
        if "refused" in row:
            print(f"| {row['setting']} | {row['mode']} | refused: {row['refused']} | | | | | | |")
            continue
        counts = row["counts"]
        derived = "yes" if counts == row["expected"] else f"no: expected {row['expected']}"
        print(
            f"| {row['setting']} | {row['mode']} | {counts['gradient_syncs']} | {counts['sync_bucket_calls']} | "
            f"{counts['allreduce_bytes'] / 1e6:.2f} ({row['witnessed_allreduce_bytes'] / 1e6:.2f}) | "
            f"{counts['buffer_broadcast_collectives']} | {counts['rebuild_broadcast_collectives']} | "
            f"{counts['used_map_allreduces']} | {derived} |"
        )
    print()
    print("| setting | mode | weights equal to documented | largest difference | ms per window |")
    print("|---|---|---|---:|---:|")
    for row in rows:
        if "counts" in row:
            equal = row.get("weights_equal_documented", "(reference)")
            difference = row.get("largest_weight_difference", 0.0)
            print(
                f"| {row['setting']} | {row['mode']} | {equal} | {difference:.3g} | {row['seconds_per_window'] * 1000:.0f} |"
            )
    print()
    print(f"compression, one synchronized backward ({gradient_bytes / 1e6:.2f} MB of float32 gradients):")
    print("| hook | relative difference to the uncompressed all-reduce | largest difference | largest gradient |")
    print("|---|---:|---:|---:|")
    for hook, measured in compression.items():
        print(
            f"| {hook} | {measured['relative_difference']:.2e} | {measured['largest_difference']:.2e} | "
            f"{measured['largest_gradient']:.2e} |"
        )


def main():
    args = parse_args()
    if args.worker:
        return worker(args)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc-per-node=2"]
    options = ["--windows", args.windows, "--batch-size", args.batch_size, "--precision", args.precision]
    result = subprocess.run(
        [*command, str(Path(__file__).resolve()), "--worker", *map(str, options)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=RUN_TIMEOUT,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    if result.returncode != 0:
        lines = result.stderr.strip().splitlines()
        cli.exit_with(
            cli.LabError(f"the torchrun part failed (exit {result.returncode}): {' '.join(lines[-15:])}"), SCRIPT
        )
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    gradient_bytes = experiment.comm_sizes(CifarCNN()).gradient_bytes
    print(
        f"2 CPU ranks (gloo), {args.windows} windows of 4 micro-batches of {args.batch_size} per run, "
        f"precision {measured['precision']}, torch {torch.__version__}"
    )
    print_table(measured["rows"], measured["compression"], gradient_bytes)
    report = {
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "torch": torch.__version__,
        "settings": {"windows": args.windows, "batch_size": args.batch_size, "precision": measured["precision"]},
        "levers": SETTINGS,
        **measured,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    files.write_atomic(args.output, files.json_bytes(report))
    print(f"\nwritten: {args.output}")


if __name__ == "__main__":
    main()
