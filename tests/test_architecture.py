"""The house's rules, read from the source: the lab's modules in layers (ddp_no_sync_lab/__init__.py lists them, each
importing only those above it in the list, and model.py, which imports nothing of the lab), the scripts on top,
no import cycle, functions within 60 lines and modules within 500, and no `# fmt: skip`."""

import ast
import re

import ddp_no_sync_lab
from conftest import REPO

PACKAGE = ddp_no_sync_lab.__name__

LAB = REPO / PACKAGE
SCRIPTS = ["model.py", "train.py", "verify.py", "infer.py", "check_env.py"]


def layer_order():
    """The modules in the order ddp_no_sync_lab/__init__.py's docstring lists them."""
    docstring = ast.get_docstring(ast.parse((LAB / "__init__.py").read_text()))
    return re.findall(r"^    ([a-z_]+)  +", docstring, re.M)


def imported_lab_modules(path):
    """The lab modules and top-level scripts a file imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == PACKAGE:
                found |= {alias.name for alias in node.names}
            elif node.module.startswith(f"{PACKAGE}."):
                found.add(node.module.removeprefix(f"{PACKAGE}."))
            elif f"{node.module}.py" in SCRIPTS:
                found.add(f"{node.module}.py")
        elif isinstance(node, ast.Import):
            found |= {f"{alias.name}.py" for alias in node.names if f"{alias.name}.py" in SCRIPTS}
    return found


def test_every_lab_module_is_listed_once():
    listed = layer_order()
    assert sorted(listed) == sorted(path.stem for path in LAB.glob("*.py") if path.stem != "__init__")
    assert len(set(listed)) == len(listed)


def test_each_lab_module_imports_only_the_modules_above_it_and_model():
    order = layer_order()
    for position, name in enumerate(order):
        imports = imported_lab_modules(LAB / f"{name}.py")
        allowed = set(order[:position]) | {"model.py"}
        assert imports <= allowed, f"{PACKAGE}/{name}.py imports {sorted(imports - allowed)}, which are not above it"


def test_model_imports_nothing_of_the_lab():
    assert imported_lab_modules(REPO / "model.py") == set()


def test_no_script_is_imported_by_another_script_except_model():
    for script in SCRIPTS:
        assert imported_lab_modules(REPO / script) - set(layer_order()) <= {"model.py"}, script


# Units are cut where their concerns divide: a function past FUNCTION_LINES is a list of jobs, unless it draws one
# picture or prints one table, which read best whole.
FUNCTION_LINES, MODULE_ALARM = 60, 500
WHOLE = {
    "ddp_no_sync_lab/pictures.py::timeline_image": "a drawing",
    "ddp_no_sync_lab/tables.py::print_tables": "a table",
}


def the_houses_sources():
    return [*sorted(LAB.rglob("*.py")), *map(REPO.joinpath, SCRIPTS)]


def test_no_function_is_over_60_lines_except_a_drawing_or_a_table():
    long = {}
    for path in the_houses_sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > FUNCTION_LINES:
                    long[f"{path.relative_to(REPO).as_posix()}::{node.name}"] = lines
    assert set(long) == set(WHOLE), long


def test_no_module_is_over_500_lines():
    sources = [*the_houses_sources(), *(REPO / "tools").glob("*.py"), *(REPO / "benchmarks").glob("*.py")]
    lengths = {path.relative_to(REPO).as_posix(): len(path.read_text().splitlines()) for path in sources}
    assert {name: length for name, length in lengths.items() if length > MODULE_ALARM} == {}


def test_the_formatter_decides_every_lines_layout():
    """No `# fmt: skip`: ruff's formatter lays out every line (make lint checks it)."""
    sources = [*the_houses_sources(), *(REPO / "tools").glob("*.py"), *(REPO / "benchmarks").glob("*.py")]
    sources += sorted((REPO / "tests").rglob("*.py"))
    skipped = re.compile(r"#\s*fmt:\s*skip\s*$", re.M)
    assert [path.relative_to(REPO).as_posix() for path in sources if skipped.search(path.read_text())] == []


def test_the_architecture_page_lists_every_module_with_its_imports():
    """docs/architecture.md's module table: one row per module in the layers' order, its imports as they are."""
    order = layer_order()
    rows = re.findall(
        r"^\| `ddp_no_sync_lab/([a-z_]+)\.py` \| .* \| ([^|]+) \|$", (REPO / "docs/architecture.md").read_text(), re.M
    )
    assert [name for name, _ in rows] == order
    for name, listed in rows:
        imports = imported_lab_modules(LAB / f"{name}.py")
        expected = [module for module in order if module in imports] + ["model"] * ("model.py" in imports)
        assert listed.strip() == (", ".join(expected) or "nothing of the lab"), name
