"""The watcher's launcher: SCRIPT run as `python SCRIPT ARGS...` runs it (as `__main__`, its argv, its folder
first on sys.path), the audit's witnesses installed before its first line; at its teardown, the document's
checklist judged on what its ranks did, printed by global rank 0, `AUDIT PASSED` or the refusal as the last line.

    torchrun [torchrun's options] -m ddp_no_sync_lab.watch [--out DIR] [--fail-fast] SCRIPT [ARGS...]
    python -m ddp_no_sync_lab.watch SCRIPT [ARGS...]      # one process

Exit status: the script's own where it failed (its traceback from its own frames); else 0 when the audit passed,
1 when it refused or saw nothing trained.
"""

import argparse
import os
import runpy
import sys
import traceback
from pathlib import Path

from ddp_no_sync_lab.cli import ArgumentParser, LabError, exit_with
from ddp_no_sync_lab.files import json_bytes, write_atomic
from ddp_no_sync_lab.watch.observe import LaunchError, Watch
from ddp_no_sync_lab.watch.report import Verdict
from ddp_no_sync_lab.watch.verdict import judge, judge_alone

PROG = "python -m ddp_no_sync_lab.watch"
INTERRUPTED = 130  # Python's status for a script ended by Ctrl-C (128 + SIGINT)


class WatchParser(ArgumentParser):
    def usage_error(self, message):
        return LabError(f"{message} (see: {PROG} --help)")


def parse(argv):
    """The watcher's options, the script, and the script's own arguments as given (a `--` among them kept): the
    watcher's options are those before SCRIPT."""
    index = 0
    while index < len(argv) and argv[index].startswith("-") and argv[index] != "--":
        index += 2 if argv[index] == "--out" else 1
    index += index < len(argv) and argv[index] == "--"  # a `--` before SCRIPT ends the watcher's options
    parser = WatchParser(
        prog=PROG,
        usage="%(prog)s [--out DIR] [--fail-fast] SCRIPT [ARGS...]",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--out", type=Path, metavar="DIR", help="write the observations and the verdict to DIR/watch.json"
    )
    parser.add_argument(
        "--fail-fast",
        action="store_true",
        help="stop every rank at the first mistake one rank sees alone (items 5, 7 and 8, judged as each window ends)",
    )
    parser.add_argument("script", type=Path, help="the training script, run as `python SCRIPT ARGS...` runs it")
    options = parser.parse_args(argv[: index + 1])
    if not options.script.is_file():
        exit_with(parser.usage_error(f"{options.script}: no such script: give the path of the training script"), PROG)
    if options.out is not None and options.out.exists() and not options.out.is_dir():
        exit_with(parser.usage_error(f"--out {options.out}: a file, not a folder: give a folder for watch.json"), PROG)
    return options, argv[index + 1 :]


def exit_status(code):
    """The status `python SCRIPT` ends with for sys.exit(code)."""
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)
    return 1


def run_script(script, script_args):
    """The script as `python SCRIPT ARGS` runs it; its exit status, its traceback from its own frames."""
    sys.argv = [str(script), *script_args]
    sys.path[0] = str(script.resolve().parent)
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as stop:
        return exit_status(stop.code)
    except LaunchError:  # the watcher's own refusal to watch the script as it was launched
        raise
    except BaseException as error:  # noqa: BLE001 - reported as Python reports a script's uncaught exception
        frames = error.__traceback__  # from the script's first frame on (none for a script that does not compile)
        while frames is not None and frames.tb_frame.f_code.co_filename != str(script):
            frames = frames.tb_next
        traceback.print_exception(type(error), error, frames)
        return INTERRUPTED if isinstance(error, KeyboardInterrupt) else 1
    return 0


def report(verdict, script, script_args, observed, out, rank):
    """The report, and with --out the record, by global rank 0 (`rank`: the watcher's, where it saw a process
    group; else the launcher's)."""
    if (rank if rank is not None else int(os.environ.get("RANK", "0"))) != 0:
        return
    print(verdict.report(script.name), flush=True)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        record = {
            "script": str(script),
            "args": script_args,
            "observed": observed,
            "findings": {number: vars(finding) for number, finding in verdict.findings.items()},
            "found": verdict.found,
            "notes": verdict.notes,
            "last_line": verdict.last_line(),
        }
        write_atomic(out / "watch.json", json_bytes(record))


def main(argv=None):
    options, script_args = parse(sys.argv[1:] if argv is None else argv)
    watch = Watch()
    if options.fail_fast:
        watch.window_judge = stop_at_refusal
    watch.install()
    status = run_script(options.script, script_args)
    if status:
        return status
    verdict = judged(watch)
    report(verdict, options.script, script_args, watch.observed, options.out, watch.rank)
    return 0 if verdict.passed else 1


def stop_at_refusal(seen, rank, world_size):
    """--fail-fast: the rank that sees a mistake alone says it and ends at once (torchrun then stops the others)."""
    refusal = judge_alone(seen, rank, world_size)
    if refusal is not None:
        print(f"AUDIT FAILED (--fail-fast, rank {rank}): {refusal}", flush=True)
        sys.stderr.flush()
        os._exit(1)


def judged(watch):
    """The verdict on the script's run, once it ended well: exchanged now where it left its process group
    standing; nothing judged where it tore the group down while handling an exception, or never made one."""
    if watch.torn_down_failing:
        return Verdict(nothing="the script tore its process group down while handling an exception: not judged")
    watch.close()
    if watch.observed is None:
        return Verdict(nothing="the script made no process group: run it under torchrun, with its model in DDP")
    return judge(watch.observed)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except LabError as error:
        exit_with(error, PROG)
