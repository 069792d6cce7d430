"""Every option the lab's scripts offer, read from each script's own argument parser as its --help shows it: each
script is run in this one process (torch imported once) until it parses its arguments, and the parser's option
strings are taken there. Prints {script: [options]} as JSON, torchrun's and the watcher's among them. gpu_check.sh has no parser;
its options are its case labels."""

import argparse
import json
import re
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class Parsed(Exception):
    def __init__(self, options):
        self.options = options


def record(parser, *args, **kwargs):
    shown = [action for action in parser._actions if action.help is not argparse.SUPPRESS]  # as --help shows them
    raise Parsed(sorted({option for action in shown for option in action.option_strings}))


def parser_options(script, module=None):
    """The options of the first parser the script parses with, or None where it parses none."""
    argv, path = sys.argv, list(sys.path)
    sys.argv = [str(script)]
    sys.path.insert(0, str(script.parent))
    try:
        runpy.run_module(module, run_name="__main__") if module else runpy.run_path(str(script), run_name="__main__")
    except Parsed as parsed:
        return parsed.options
    except SystemExit:
        return None
    finally:
        sys.argv, sys.path[:] = argv, path
    return None


def main():
    argparse.ArgumentParser.parse_args = record
    scripts = sorted([*ROOT.glob("*.py"), *ROOT.glob("tools/*.py"), *ROOT.glob("benchmarks/*.py")])
    options = {}
    for script in scripts:
        found = parser_options(script)
        if found is not None:
            options[str(script.relative_to(ROOT))] = found
    options["torchrun"] = parser_options(ROOT / "torchrun", "torch.distributed.run")
    options["ddp_no_sync_lab.watch"] = parser_options(ROOT / "ddp_no_sync_lab" / "watch", "ddp_no_sync_lab.watch")
    labels = re.findall(r"^\s*(--[a-z-]+)\)", (ROOT / "gpu_check.sh").read_text(), re.MULTILINE)
    options["gpu_check.sh"] = sorted(set(labels))
    print(json.dumps(options))


if __name__ == "__main__":
    main()
