"""train.py's real training run several times in one torchrun start, one after the other in the same process
group: each run's options as train.py takes them, runs separated by "--", each run's own test-only injections
(tests/inject/sitecustomize.py) first as LAB_TEST_NAME=VALUE, in force for that run alone. Each rank's stdout
and stderr of each run (train.py prints its JSON lines and progress from rank 0) are kept in LOGS as
<run number>.rank<rank>.stdout and .stderr, so that a test reads each run's output as it would read a process's.

    torchrun --nproc-per-node=2 tests/workers/runs.py LOGS -- [REFUSED] [LAB_TEST_X=V ...] TRAIN_OPTIONS -- ...

Each run is parsed, agreed and started by train.main's own steps (train.parse_or_error, train.start). A run marked REFUSED must end in a start-up
refusal (a LabError every rank raises together, at the same check): it is printed as train.py prints it, by each
node's first process, and the next run goes on in the same process group; such a run that trains says so in its
log, where the test reading it finds no refusal. Any other run's error ends the start. The nodes of a two-node
start may differ run by run (options, data, injections): their disagreements. That a refusal also ends train.py's
job is train.main's, tested as a command (test_nodes.py, test_faults.py).

One start costs a rank several seconds before its first micro-batch (torchrun, importing torch, the rendezvous);
a test that needs several runs of the same code pays it once.
"""

import contextlib
import gc
import sys
from pathlib import Path

import sitecustomize  # tests/inject, on the tests' PYTHONPATH
import torch
import torch.distributed as dist

import train
from ddp_no_sync_lab.cli import LabError
from ddp_no_sync_lab.run import launch

REPO = Path(__file__).resolve().parents[2]
REFUSED = "REFUSED"


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


def run(options, refused, injections, stem, place):
    """One run, its injections in force and its output (theirs too) in its logs; a refused run's line printed."""
    with open(f"{stem}.stdout", "w") as out, open(f"{stem}.stderr", "w") as err:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), own_injections(injections):
            try:
                train.start(*train.parse_or_error(options), place)
                if refused:
                    print(f"{train.SCRIPT}: trained: no refusal", file=sys.stderr)
            except LabError as error:
                if not refused or error.broken_process:  # a process that cannot go on ends the start
                    raise
                if place.local_rank == 0:
                    print(error.line(train.SCRIPT), file=sys.stderr)


def main():
    logs, runs = Path(sys.argv[1]), split_runs(sys.argv[2:])
    place = launch.init_process_group(launch.launch_environment(None))
    for number, words in enumerate(runs):
        refused = words[:1] == [REFUSED]
        words = words[1:] if refused else words
        injections = dict(word.split("=", 1) for word in words if word.startswith("LAB_TEST_"))
        options = [word for word in words if not word.startswith("LAB_TEST_")]
        stem = logs / f"{number}.rank{place.rank}"
        try:
            run(options, refused, injections, stem, place)
        except BaseException as error:  # the start's traceback names the run, whose output is in its log
            error.add_note(f"in run {number} of the start: {' '.join(words)} (its output: {stem}.stdout, .stderr)")
            raise
        if refused:
            # Its error's frames freed, cycles too, and with them its output's lock (files.claim_output), as its own
            # process would have ended: a next run may write into the same output (only a refused run is followed
            # by one into its output in the suite; a start that reuses a trained run's output needs this too).
            gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
