"""The pages are true to the project: every relative link and anchor in README.md and docs/ resolves, every
pointer from the code into the pages resolves, and every option a page names exists in the --help of the script
it is given to (read from the scripts themselves: tests/workers/help_options.py)."""

import json
import re
from collections import Counter

import pytest

from conftest import REPO, run_python

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
CODE = [
    path
    for pattern in ("*.py", "ddp_no_sync_lab/**/*.py", "tools/*.py", "benchmarks/*.py", "tests/**/*.py", "*.sh")
    for path in sorted(REPO.glob(pattern))
] + [REPO / "Makefile", REPO / ".ci/run"]
FENCE = re.compile(r"^\s*```")
HEADING = re.compile(r"^#{1,6}\s+(.*?)(?:\s+#+)?\s*$")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`]+)`")
OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*(?!\w)")
# A page pointer in code: README.md or docs/<page>.md, with an optional #anchor.
CODE_POINTER = re.compile(r"(?<![\w/.-])((?:docs/)?[\w-]+\.md)(#[\w-]+)?")
# Other programs' options on the pages, each with the program it belongs to; the lab's options are never here.
OTHER_PROGRAMS = {"pytest", "ruff", "pip", "unshare", "#SBATCH", "srun", "sbatch"}


def prose_and_code(page):
    """(line number, text, in a fenced block) for every line of a page; a fence line is empty prose, so that line
    numbers stay the page's."""
    fenced = False
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            yield number, "", False
            continue
        yield number, line, fenced


def slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page):
    seen, found = Counter(), set()
    for _, line, fenced in prose_and_code(page):
        heading = HEADING.match(line)
        if not fenced and heading:
            base = slug(heading.group(1))
            found.add(base if not seen[base] else f"{base}-{seen[base]}")
            seen[base] += 1
    return found


def test_every_link_and_anchor_on_the_pages_resolves():
    broken = []
    for page in PAGES:
        prose = ["" if fenced else line for _, line, fenced in prose_and_code(page)]
        text = "\n".join(prose)
        for match in LINK.finditer(text):
            target, number = match.group(1), text.count("\n", 0, match.start()) + 1
            if re.match(r"[a-z]+:", target):
                continue  # a web address
                path, _, anchor = target.partition("#")
                linked = (page.parent / path).resolve() if path else page
                where = f"{page.relative_to(REPO)}:{number}: {target}"
                if not linked.exists():
                    broken.append(f"{where} (no such file)")
                elif anchor and (linked.suffix != ".md" or anchor not in anchors(linked)):
                    broken.append(f"{where} (no such heading)")
    assert not broken, "\n".join(broken)


def test_every_pointer_from_the_code_into_the_pages_resolves():
    broken = []
    for source in CODE:
        for number, line in enumerate(source.read_text().splitlines(), 1):
            if re.search(r'README\s"', line):
                broken.append(f"{source.relative_to(REPO)}:{number}: a section named in quotes; link its anchor")
            for path, anchor in CODE_POINTER.findall(line):
                page = REPO / path
                if path != "README.md" and not path.startswith("docs/"):
                    continue  # another project's file
                if not page.exists() or (anchor and anchor[1:] not in anchors(page)):
                    broken.append(f"{source.relative_to(REPO)}:{number}: {path}{anchor}")
    assert not broken, "\n".join(broken)


@pytest.fixture(scope="module")
def help_options():
    result = run_python("tests/workers/help_options.py")
    assert result.returncode == 0, result.stderr
    return {script: set(options) for script, options in json.loads(result.stdout).items()}


def mentions(page):
    """(line, program or None, option) for every option a page names. A program is the last script, torchrun or
    other program named before the option in the same command (a code block's line or one code span); an option
    named in prose or alone in a span belongs to no program."""
    lines = list(prose_and_code(page))
    for index, (number, line, fenced) in enumerate(lines):
        while fenced and line.endswith("\\") and index + 1 < len(lines):  # a shell line continued
            index += 1
            line = line[:-1] + " " + lines[index][1]
        commands = [line] if fenced else CODE_SPAN.findall(line) + [CODE_SPAN.sub(" ", line)]
        for command in commands:
            program = None
            for token in re.split(r"\s+|(&&|\|\||[|;])", command):
                token = (token or "").strip("`'\"()[],:")
                if token.startswith("#") and token != "#SBATCH":
                    break  # a shell comment
                name = token.rsplit("/", 1)[-1]
                if (
                    name.endswith((".py", ".sh"))
                    or name in ("torchrun", "ddp_no_sync_lab.watch")
                    or token in OTHER_PROGRAMS
                ):
                    program = token if token in OTHER_PROGRAMS else name
                elif token in ("|", "||", "&&", ";"):
                    program = None
                for option in OPTION.findall(token.split("=", 1)[0]):
                    yield number, program, option


def test_every_option_a_page_names_exists_in_its_scripts_help(help_options):
    with_parsers = {
        str(path.relative_to(REPO))
        for pattern in ("*.py", "tools/*.py", "benchmarks/*.py")
        for path in REPO.glob(pattern)
        if "ArgumentParser(" in path.read_text()
    }
    # none fell out of the check (the watcher's launcher is a module, run with -m)
    assert set(help_options) - {"torchrun", "gpu_check.sh", "ddp_no_sync_lab.watch"} == with_parsers
    by_name = {script.rsplit("/", 1)[-1]: options for script, options in help_options.items()}
    anywhere = set().union(*help_options.values())
    wrong, checked = [], 0
    for page in PAGES:
        for number, program, option in mentions(page):
            if program in OTHER_PROGRAMS:
                continue
            if program is not None and program not in by_name:
                wrong.append(f"{page.relative_to(REPO)}:{number}: {option} given to {program}, which has no options")
                continue
            offered = by_name[program] if program else anywhere
            checked += 1
            if option not in offered:
                wrong.append(f"{page.relative_to(REPO)}:{number}: {option} (not in {program or 'any script'}'s --help)")
    assert not wrong, "\n".join(wrong)
    assert checked > 300  # the pages name options hundreds of times; a parser that finds none checks nothing
    assert {"--mode", "--strategy", "--expect-from-config", "--image"} <= anywhere
