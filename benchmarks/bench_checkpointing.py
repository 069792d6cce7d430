"""Activation checkpointing: the memory it saves against the compute it costs, per micro-batch size.

    .venv/bin/python benchmarks/bench_checkpointing.py                      # CPU: one thread, as one lab rank
    .venv/bin/python benchmarks/bench_checkpointing.py --device cuda        # one GPU, with its peak memory

For each micro-batch size, CifarCNN plain and with its stages checkpointed (model.STAGES, non-reentrant, as
train.py --activation-checkpointing), in turns: the activations held from a forward for its backward (counted by
memory.saved_activations through saved_tensors_hooks, the same on every device), the time of a forward and
backward at the lab's numerics (--precision, channels_last; median over repeats), and on CUDA the peak
allocated memory of a micro-batch. No DDP: checkpointing changes nothing that crosses between the ranks (the
gradients and their buckets are the same), which the lab's runs show by their counts. The table is printed
and written with everything measured to artifacts/bench/checkpointing.json.
"""

import statistics
from functools import partial
from pathlib import Path

import torch
from torch import nn

from benchmarks.bench_speed import machine
from ddp_no_sync_lab import cli, files
from ddp_no_sync_lab.audit import instruments, memory
from ddp_no_sync_lab.precision import PRECISIONS, choose_precision
from model import MEMORY_FORMAT, CifarCNN

REPO = Path(__file__).resolve().parents[1]

SCRIPT = "bench_checkpointing.py"


def parse_args():
    parser = cli.ArgumentParser(prog=SCRIPT, description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=cli.positive_int, nargs="+", default=[50, 100, 200, 400], metavar="N")
    parser.add_argument("--micro-batches", type=cli.positive_int, default=4, help="micro-batches per timed sample")
    parser.add_argument("--repeats", type=cli.positive_int, default=3, help="timed samples per size and variant")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--precision", choices=PRECISIONS, default="auto", help="as train.py --precision")
    parser.add_argument("--output", type=Path, default=Path("artifacts/bench/checkpointing.json"))
    return parser.parse_args()


def measure(network, batch_size, args, device, precision):
    """Saved-activation bytes, seconds per micro-batch (samples), and on CUDA the peak allocated bytes."""
    inputs = torch.randn(batch_size, 3, 32, 32, device=device).contiguous(memory_format=MEMORY_FORMAT)
    targets = torch.randint(0, 10, (batch_size,), device=device)
    autocast = partial(precision.autocast, device.type)

    def forward():
        with autocast():
            return nn.functional.cross_entropy(network(inputs), targets)

    def micro_batch():
        forward().backward()

    with memory.saved_activations(network) as held:
        loss = forward()
    loss.backward()  # also the warm-up
    del loss
    peak = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        micro_batch()
        peak = torch.cuda.max_memory_allocated(device)
    samples = []
    for _ in range(args.repeats):
        started = instruments.read_clock(device)
        for _ in range(args.micro_batches):
            micro_batch()
        samples.append((instruments.read_clock(device) - started) / args.micro_batches)
    network.zero_grad(set_to_none=True)
    return {
        "saved_activation_bytes": held.activation_bytes,
        "saved_weight_copy_bytes": held.weight_copy_bytes,
        "seconds_per_micro_batch": samples,
        "peak_allocated_bytes": peak,
    }


def main():
    args = parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        cli.exit_with(
            cli.LabError(
                "--device cuda: no GPU is visible (check nvidia-smi and CUDA_VISIBLE_DEVICES, or use --device cpu)"
            ),
            SCRIPT,
        )
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)  # one lab rank: torchrun gives each process one thread
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    try:
        precision = choose_precision(args.precision, device)
    except cli.LabError as error:
        cli.exit_with(error, SCRIPT)
    networks = {
        "plain": CifarCNN().to(device, memory_format=MEMORY_FORMAT),
        "checkpointed": CifarCNN(activation_checkpointing=True).to(device, memory_format=MEMORY_FORMAT),
    }
    rows = []
    for batch_size in args.batch_sizes:
        results = {name: measure(network, batch_size, args, device, precision) for name, network in networks.items()}
        for result in results.values():
            result["median_seconds"] = statistics.median(result["seconds_per_micro_batch"])
        rows.append({"batch_size": batch_size, **results})
    print(
        f"CifarCNN forward + backward on {device.type} ({torch.get_num_threads()} thread(s)), {precision.description}, "
        f"channels_last; median of {args.repeats} x {args.micro_batches} micro-batches\nprecision: {precision.reason}"
    )
    print(
        "| micro-batch | saved activations MB, plain | checkpointed | saved / checkpointed | weight copies MB, plain "
        "| checkpointed | ms, plain | checkpointed | recompute cost | peak MB (CUDA), plain | checkpointed |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        plain, checkpointed = row["plain"], row["checkpointed"]
        peaks = [
            f"{r['peak_allocated_bytes'] / 1e6:.1f}" if r["peak_allocated_bytes"] else "n/a"
            for r in (plain, checkpointed)
        ]
        print(
            f"| {row['batch_size']} | {plain['saved_activation_bytes'] / 1e6:.2f} | "
            f"{checkpointed['saved_activation_bytes'] / 1e6:.2f} | "
            f"{plain['saved_activation_bytes'] / checkpointed['saved_activation_bytes']:.1f}x | "
            f"{plain['saved_weight_copy_bytes'] / 1e6:.2f} | {checkpointed['saved_weight_copy_bytes'] / 1e6:.2f} | "
            f"{plain['median_seconds'] * 1000:.1f} | {checkpointed['median_seconds'] * 1000:.1f} | "
            f"{checkpointed['median_seconds'] / plain['median_seconds'] - 1:+.0%} | {peaks[0]} | {peaks[1]} |"
        )
    report = {
        "machine": machine(device.type),
        "precision": precision.name,
        "precision_reason": precision.reason,
        "settings": {
            "batch_sizes": args.batch_sizes,
            "micro_batches": args.micro_batches,
            "repeats": args.repeats,
            "threads": torch.get_num_threads(),
        },
        "rows": rows,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    files.write_atomic(args.output, files.json_bytes(report))
    print(f"\nwritten: {args.output}")


if __name__ == "__main__":
    main()
