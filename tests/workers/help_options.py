"""Every option the lab's scripts offer, read from each script's own --help (run in this one process, so torch is
imported once): prints {script: [options]} as JSON. gpu_check.sh has no --help; its options are its case labels."""

import contextlib
import io
import json
import re
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*(?!\w)")


def help_text(script: Path, module: str | None = None) -> str:
    argv, path = sys.argv, list(sys.path)
    sys.argv = [str(script), "--help"]
    sys.path.insert(0, str(script.parent))
    output = io.StringIO()
    try:
        with contextlib.redirect_stdout(output), contextlib.suppress(SystemExit):
            if module:
                runpy.run_module(module, run_name="__main__")
            else:
                runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv, sys.path[:] = argv, path
    return output.getvalue()


def main() -> None:
    scripts = sorted([*ROOT.glob("*.py"), *ROOT.glob("tools/*.py"), *ROOT.glob("benchmarks/*.py")])
    options = {}
    for script in scripts:
        text = help_text(script)
        if "usage:" in text:
            options[str(script.relative_to(ROOT))] = sorted(set(OPTION.findall(text)))
    options["torchrun"] = sorted(set(OPTION.findall(help_text(ROOT / "torchrun", "torch.distributed.run"))))
    labels = re.findall(r"^\s*(--[a-z-]+)\)", (ROOT / "gpu_check.sh").read_text(), re.MULTILINE)
    options["gpu_check.sh"] = sorted(set(labels))
    print(json.dumps(options))


if __name__ == "__main__":
    main()
