"""Does the audit cost anything? Times the lab's training loop with plain DDP (its built-in all-reduce, no
counting) and with the audited DDP of train.py (counting hook, counted buffer broadcasts), both modes.

    torchrun --standalone --nnodes=1 --nproc-per-node=2 benchmarks/audit_overhead.py
    torchrun --standalone --nnodes=1 --nproc-per-node=2 benchmarks/audit_overhead.py --repeats 7 --windows 10

Each measurement trains --windows windows of accum_steps micro-batches (local batch 50, BF16 autocast, random
CIFAR-sized tensors) from the same initial weights; the variants take turns, and the table shows the median
over --repeats and the spread (min-max), so the overhead can be read against the noise.
"""
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import lab  # noqa: E402
import train  # noqa: E402
from model import CifarCNN  # noqa: E402

CPU = torch.device("cpu")


def main():
    parser = lab.ArgumentParser(prog="audit_overhead.py", description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=lab.positive_int, default=5)
    parser.add_argument("--windows", type=lab.positive_int, default=5)
    args = parser.parse_args()
    batch, accum = lab.DOCUMENTED["batch_size"], lab.DOCUMENTED["accum_steps"]

    with train.c_stdout_to_stderr():
        dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    initial_state = CifarCNN().state_dict()
    count = args.windows * accum * batch * world_size
    data = TensorDataset(torch.randn(count, 3, 32, 32), torch.randint(0, 10, (count,)))
    loader = DataLoader(data, batch_size=batch, sampler=DistributedSampler(data, shuffle=False))
    plan = lab.window_plan(len(loader), accum, "error")
    autocast = partial(torch.autocast, "cpu", dtype=torch.bfloat16)
    progress = train.Progress(enabled=False, interval=0)
    wrappers = {
        "plain DDP": lambda model: DDP(model, bucket_cap_mb=lab.BUCKET_CAP_MB, broadcast_buffers=True),
        "audited DDP": lambda model: train.wrap_model(model, CPU, world_size)[0],
    }

    def seconds_per_window(wrapper, mode):
        model = CifarCNN()
        model.load_state_dict(initial_state)
        ddp_model = wrapper(model)
        optimizer = torch.optim.AdamW(ddp_model.parameters(), lr=3e-3, weight_decay=1e-4)
        dist.barrier()
        started = time.perf_counter()
        train.train_epoch(ddp_model, loader, plan, mode, optimizer, nn.CrossEntropyLoss(), CPU, autocast, progress)
        return (time.perf_counter() - started) / args.windows

    for name, wrapper in wrappers.items():  # warm-up: first-call allocations and kernel selection
        seconds_per_window(wrapper, "every")
    samples = {(name, mode): [] for name in wrappers for mode in lab.MODES}
    for _ in range(args.repeats):
        for mode in lab.MODES:
            for name, wrapper in wrappers.items():
                samples[(name, mode)].append(seconds_per_window(wrapper, mode))

    if rank == 0:
        print(f"{world_size} ranks, {torch.get_num_threads()} thread(s) each, local batch {batch}, accum_steps {accum}, "
              f"{args.windows} windows x {args.repeats} repeats (rank 0's wall time)")
        print("| mode | DDP | s per window (median) | min-max | audited / plain |")
        print("|---|---|---:|---:|---:|")
        for mode in lab.MODES:
            plain = statistics.median(samples[("plain DDP", mode)])
            for name in wrappers:
                values = samples[(name, mode)]
                median = statistics.median(values)
                print(f"| {mode} | {name} | {median:.3f} | {min(values):.3f}-{max(values):.3f} | {median / plain:.3f} |")
    train.settle_comm_hooks()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
