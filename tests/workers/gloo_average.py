"""Started by tests/test_sharded.py under torchrun (2 ranks, gloo, CPU): does this torch's gloo reduce-scatter
average when FSDP2 asks for ReduceOp.AVG, or sum (torch 2.8, pytorch/pytorch#162338)? Prints "mean" or "sum"."""

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
ones = torch.ones(dist.get_world_size())
output = torch.empty(1)
dist.reduce_scatter_tensor(output, ones, op=dist.ReduceOp.AVG)
if dist.get_rank() == 0:
    print("mean" if output.item() == 1 else "sum", flush=True)
dist.destroy_process_group()
