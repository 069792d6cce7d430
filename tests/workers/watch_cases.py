"""The watcher's launcher on several loops in one torchrun start (started by tests/test_watch.py): for each
"[LAB_TEST_X=V ...] NAME SCRIPT [ARGS...]" given (separated by "---"), its main() as `-m ddp_no_sync_lab.watch
SCRIPT ARGS` runs it, one after the other, the case's own test-only injections (tests/inject/sitecustomize.py)
in force for it alone (runs.own_injections). The default group is made once: each script's init_process_group finds it made and its
destroy_process_group leaves it (re-made groups would reuse torchrun's store keys, a race), while the watcher
exchanges and judges at that call as it does alone. Each rank's exit status, stdout and stderr of each case go
to OUT/NAME.rank<rank>.json.

    torchrun --nproc-per-node=2 tests/workers/watch_cases.py OUT --- [LAB_TEST_X=V ...] NAME SCRIPT [ARGS...] --- ...

One start costs a rank seconds before its first line (torchrun, importing torch, the rendezvous); the cases pay
it once. The launcher's command line itself is run as a command by the tests that test it.
"""

import contextlib
import io
import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from ddp_no_sync_lab.watch.__main__ import main
from runs import own_injections  # tests/workers, this script's folder


def run_case(script, args):
    """main() on one script, its output captured; sys.argv and sys.path as they were after."""
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            status = main([script, *args])
        except SystemExit as stop:
            status = stop.code
    sys.argv[:], sys.path[:] = saved_argv, saved_path
    return {"status": status, "stdout": stdout.getvalue(), "stderr": stderr.getvalue()}


def cases(arguments):
    """Each case's words, the cases separated by "---" (a script's own "--" is its argument)."""
    split = []
    for argument in arguments:
        if argument == "---":
            split.append([])
        else:
            split[-1].append(argument)
    return split


def keep_default_group():
    """The scripts' init_process_group and destroy_process_group of the default group, made no-ops once it is
    made (before the watcher wraps the teardown: its exchange still runs at the script's call)."""
    dist.init_process_group("gloo")
    init, destroy = dist.init_process_group, dist.destroy_process_group
    dist.init_process_group = lambda *args, **kwargs: None if dist.is_initialized() else init(*args, **kwargs)
    dist.destroy_process_group = lambda group=None: None if group is None else destroy(group)


if __name__ == "__main__":
    keep_default_group()
    out = Path(sys.argv[1])
    rank = os.environ["RANK"]
    for case in cases(sys.argv[2:]):
        injections = dict(word.split("=", 1) for word in case if word.startswith("LAB_TEST_"))
        name, script, *args = [word for word in case if not word.startswith("LAB_TEST_")]
        with own_injections(injections):
            result = run_case(script, args)
        (out / f"{name}.rank{rank}.json").write_text(json.dumps(result))
