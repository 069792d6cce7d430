"""train.py's real training run several times in one torchrun start, one after the other in the same process
group: each run's options as train.py takes them, runs separated by "--", each run's own test-only injections
(tests/inject/sitecustomize.py) first as LAB_TEST_NAME=VALUE, in force for that run alone. Each rank's stdout
and stderr of each run (train.py prints its JSON lines and progress from rank 0) are kept in LOGS as
<run number>.rank<rank>.stdout and .stderr, so that a test reads each run's output as it would read a process's.

    torchrun --nproc-per-node=2 tests/workers/runs.py LOGS -- [LAB_TEST_X=V ...] TRAIN_OPTIONS -- ...

One start costs a rank several seconds before its first micro-batch (torchrun, importing torch, the rendezvous);
a test that needs several runs of the same code pays it once. train.py's command line itself (its parsing,
start-up checks and teardown) is run as a command by the tests that test it.
"""

import contextlib
import sys
from pathlib import Path

import sitecustomize  # tests/inject, on the tests' PYTHONPATH
import torch
import torch.distributed as dist

import train
from ddp_no_sync_lab.run import launch

REPO = Path(__file__).resolve().parents[2]


def split_runs(arguments):
    runs, current = [], None
    for argument in arguments:
        if argument == "--":
            current = []
            runs.append(current)
        else:
            current.append(argument)
    return runs


@contextlib.contextmanager
def own_injections(injections):
    """A run's own injections in force for it alone, in a process as a run of its own would find it. torch wraps
    AdamW's class step in the optimizer hooks when the first AdamW is made, and never again: an injection made
    after an earlier run's AdamW would wrap the hooked step from outside (the fault before the hooks, not
    inside them). So AdamW's step is put back as it was before the run, with everything the injections patched."""
    step, kept = vars(torch.optim.AdamW).get("step"), len(sitecustomize.PATCHED)
    sitecustomize.inject(injections)
    try:
        yield
    finally:
        sitecustomize.undo(kept)
        if step is not None:
            torch.optim.AdamW.step = step
        elif "step" in vars(torch.optim.AdamW):  # inherited from Adam until the first AdamW
            del torch.optim.AdamW.step


def main():
    logs, runs = Path(sys.argv[1]), split_runs(sys.argv[2:])
    place = launch.init_process_group(launch.launch_environment(2))
    for number, words in enumerate(runs):
        injections = dict(word.split("=", 1) for word in words if word.startswith("LAB_TEST_"))
        args = train.parse_args([word for word in words if not word.startswith("LAB_TEST_")])
        stem = logs / f"{number}.rank{place.rank}"
        with own_injections(injections):
            with open(f"{stem}.stdout", "w") as out, open(f"{stem}.stderr", "w") as err:
                with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                    train.run(args, place)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
