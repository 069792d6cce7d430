"""Several of the tests' worker scripts in one torchrun start (started by tests/conftest.py's worker_results): each
script run as `python SCRIPT` runs it, one after the other, in the one default group watch_cases.py keeps (each
script's init_process_group finds it made, its destroy_process_group leaves it; closed after the last), torch's
deterministic-algorithms switch put back after each as the script found it. Each rank's stdout of each script goes
to OUT/<script's name>.rank<rank>.stdout; a script's error ends the start.

    torchrun --nproc-per-node=2 tests/workers/several_workers.py OUT SCRIPT ...

One start costs a rank seconds before its first line (torchrun, importing torch, the rendezvous); the scripts
pay it once.
"""

import contextlib
import runpy
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from ddp_no_sync_lab.audit import instruments
from watch_cases import keep_default_group  # tests/workers, this script's folder

if __name__ == "__main__":
    out, scripts = Path(sys.argv[1]), sys.argv[2:]
    keep_default_group()
    for script in scripts:
        deterministic, sys.argv = torch.are_deterministic_algorithms_enabled(), [script]
        with open(out / f"{Path(script).name}.rank{dist.get_rank()}.stdout", "w") as stdout:
            with contextlib.redirect_stdout(stdout):
                runpy.run_path(script, run_name="__main__")
        torch.use_deterministic_algorithms(deterministic)
    instruments.settle_comm_hooks()
    dist.destroy_process_group(dist.group.WORLD)
