"""The house's rules, read from the source: the lab's modules in layers (ddp_no_sync_lab/__init__.py lists them, each
importing only those above it in the list, and model.py, which imports nothing of the lab), the scripts on top,
no import cycle, and no module over about 400 lines."""

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


def test_no_module_is_much_over_400_lines():
    sources = [
        *LAB.glob("*.py"),
        *map(REPO.joinpath, SCRIPTS),
        *(REPO / "tools").glob("*.py"),
        *(REPO / "benchmarks").glob("*.py"),
    ]
    lengths = {path.relative_to(REPO).as_posix(): len(path.read_text().splitlines()) for path in sources}
    assert {name: length for name, length in lengths.items() if length > 420} == {}
    assert lengths["train.py"] <= 360


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
