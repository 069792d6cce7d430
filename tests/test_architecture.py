"""The house's rules, read from the source: the lab's modules in layers (ddp_no_sync_lab/__init__.py lists the
shared modules and the folders bottom up, each folder's __init__.py its modules; each module imports only those
listed above it, and model.py, which imports nothing of the lab), so no import goes back up a layer and none
goes round a circle; the scripts on top; functions within 60 lines and modules within 500, and no `# fmt: skip`."""

import ast
import re

import ddp_no_sync_lab
from conftest import REPO
from ddp_no_sync_lab import experiment
from ddp_no_sync_lab.tasks.registry import TASKS, Task, members

PACKAGE = ddp_no_sync_lab.__name__

LAB = REPO / PACKAGE
SCRIPTS = ["model.py", "train.py", "verify.py", "infer.py", "check_env.py"]


def listed(folder):
    """The entries a folder's __init__.py docstring lists, in order: `name` for a module, `name/` for a folder."""
    docstring = ast.parse((folder / "__init__.py").read_text()).body[0].value.value  # as written, not dedented
    return re.findall(r"^    ([a-z_]+/?)  +", docstring, re.M)


def layer_order():
    """Every module of the package as a dotted name below it ("files", "tasks.data"), bottom up."""
    order = []
    for entry in listed(LAB):
        if entry.endswith("/"):
            order += [f"{entry[:-1]}.{module}" for module in listed(LAB / entry)]
        else:
            order.append(entry)
    return order


def module_path(name):
    return LAB / f"{name.replace('.', '/')}.py"


def imported_lab_modules(path):
    """The lab modules (dotted below the package) and top-level scripts a file imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            below = node.module.removeprefix(PACKAGE).lstrip(".")
            if node.module == PACKAGE or (node.module.startswith(f"{PACKAGE}.") and (LAB / below).is_dir()):
                found |= {f"{below}.{alias.name}".lstrip(".") for alias in node.names}
            elif node.module.startswith(f"{PACKAGE}."):
                found.add(node.module.removeprefix(f"{PACKAGE}."))
            elif f"{node.module}.py" in SCRIPTS:
                found.add(f"{node.module}.py")
        elif isinstance(node, ast.Import):
            found |= {f"{alias.name}.py" for alias in node.names if f"{alias.name}.py" in SCRIPTS}
            assert not any(alias.name.startswith(PACKAGE) for alias in node.names), f"{path}: import {PACKAGE}.x as"
    return found


def test_every_lab_module_and_folder_is_listed_once():
    order = layer_order()
    present = {path.relative_to(LAB).with_suffix("").as_posix().replace("/", ".") for path in LAB.rglob("*.py")}
    assert sorted(order) == sorted(name for name in present if not name.endswith("__init__"))
    assert len(set(order)) == len(order)
    folders = {path.parent.name for path in LAB.glob("*/__init__.py")}
    assert folders == {entry[:-1] for entry in listed(LAB) if entry.endswith("/")}


def test_each_lab_module_imports_only_the_modules_listed_above_it_and_model():
    """No import back up a layer, none round a circle; a folder's __init__.py imports nothing (it is its list);
    every import absolute, so that this test reads each one."""
    order = layer_order()
    for position, name in enumerate(order):
        relative = [
            node.lineno for node in ast.walk(ast.parse(module_path(name).read_text())) if getattr(node, "level", 0)
        ]
        assert relative == [], (
            f"{module_path(name).relative_to(REPO)} imports relatively at lines {relative}: import absolutely"
        )
        imports = imported_lab_modules(module_path(name))
        allowed = set(order[:position]) | {"model.py"}
        assert imports <= allowed, (
            f"{module_path(name).relative_to(REPO)} imports {sorted(imports - allowed)}, which are not above it"
        )
    for init in LAB.rglob("__init__.py"):
        assert [node for node in ast.parse(init.read_text()).body if not isinstance(node, ast.Expr)] == [], init


def test_model_imports_nothing_of_the_lab():
    assert imported_lab_modules(REPO / "model.py") == set()


def test_no_script_is_imported_by_another_script_except_model():
    for script in SCRIPTS:
        assert imported_lab_modules(REPO / script) - set(layer_order()) <= {"model.py"}, script


def test_the_scripts_reach_the_audit_through_its_face_alone():
    """The audit is a library with one public face (audit/face.py); the scripts, like any other script, use no
    module of audit/ but it (verify.py judges through checks/)."""
    for script in SCRIPTS:
        audit = {name for name in imported_lab_modules(REPO / script) if name.startswith("audit.")}
        assert audit <= {"audit.face"}, f"{script} imports {sorted(audit - {'audit.face'})}: use audit.face"


def test_no_module_beneath_the_scripts_reads_the_argparse_namespace():
    """train.py hands its options down as one frozen TrainOptions; nothing beneath parses one (parse_args,
    parse_known_args), names argparse's Namespace, or has a parameter or variable named args. The watcher's
    launcher (watch/__main__.py) is an entry point of its own, with its own command line."""
    for name in (name for name in layer_order() if not name.endswith("__main__")):
        for node in ast.walk(ast.parse(module_path(name).read_text())):
            if isinstance(node, ast.arguments):
                assert "args" not in [argument.arg for argument in node.posonlyargs + node.args + node.kwonlyargs], name
            assert not (
                isinstance(node, ast.Attribute) and node.attr in ("parse_args", "parse_known_args", "Namespace")
            ), name
            assert not (isinstance(node, ast.Name) and node.id == "args" and isinstance(node.ctx, ast.Store)), name


# Units are cut where their concerns divide: a function past FUNCTION_LINES is a list of jobs, unless it draws one
# picture or prints one table, which read best whole.
FUNCTION_LINES, MODULE_ALARM = 60, 500
WHOLE = {
    "ddp_no_sync_lab/report/pictures.py::timeline_image": "a drawing",
    "ddp_no_sync_lab/report/tables.py::print_tables": "a table",
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
        r"^\| `ddp_no_sync_lab/([a-z_/]+)\.py` \| .* \| ([^|]+) \|$", (REPO / "docs/architecture.md").read_text(), re.M
    )
    assert [path.replace("/", ".") for path, _ in rows] == order
    for path, listed_imports in rows:
        name = path.replace("/", ".")
        imports = imported_lab_modules(module_path(name))
        expected = [module for module in order if module in imports] + ["model"] * ("model.py" in imports)
        assert listed_imports.strip() == (", ".join(expected) or "nothing of the lab"), name


def test_each_task_is_registered_under_its_name_with_every_member_of_the_task_protocol():
    """tasks/registry.py's TASKS holds experiment.TASKS's names in order, each a Task member by member (a
    structural Protocol checks none by itself)."""
    task_members = set(members(Task))
    assert task_members >= {"name", "documented", "evaluate", "build_model", "criterion", "write_results"}
    assert tuple(TASKS) == experiment.TASKS and all(task.name == name for name, task in TASKS.items())
    for task in TASKS.values():
        assert sorted(member for member in task_members if not hasattr(task, member)) == [], task
    assert TASKS["cifar10"].evaluate is None and callable(TASKS["text"].evaluate)  # the image task's: train.py's
