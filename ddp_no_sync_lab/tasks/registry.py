"""The Task: what train.py and its start-up ask of a task, declared once, and the lab's tasks by name.

A task decides its data (fetched, loaded, agreed between the nodes, split), each rank's loaders, its model and
loss, how a window's micro-batches divide the loss, what its runs add to their configuration, how held-out data is
evaluated, and its results. train.py and run/launch.py reach a task only through these; verify.py's checks of a
task's results are checks/task_results.py's. docs/architecture.md says how to add one: in the package, or in a
module of its own, named MODULE:CLASS (`train.py --task my_task:MyTask`, its folder on PYTHONPATH), which also
names verify's checks of its results (its `results`, a TaskResults below).
"""

import argparse
import functools
import hashlib
import importlib
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from ddp_no_sync_lab import experiment
from ddp_no_sync_lab.cli import LabError
from ddp_no_sync_lab.experiment import PARTIAL_WINDOW_POLICIES, MicroStep
from ddp_no_sync_lab.options import TrainOptions
from ddp_no_sync_lab.tasks.image import ImageTask
from ddp_no_sync_lab.tasks.language import TextTask
from ddp_no_sync_lab.tasks.loaders import Loaders

__all__ = ["TASKS", "Task", "TaskResults", "find_task", "check_window_plan", "code_sha256", "task_file", "task_name"]


class Task(Protocol):
    name: str  # train.py's --task (a run records it where not the document's task)
    documented: dict  # train.py's defaults of epochs, batch_size and partial_window for the task
    # Held-out data through the wrapper, summed over ranks: (ddp_model, loader, criterion, device, autocast,
    # progress, label, group) -> (loss, accuracy, ...). None: train.py's own, the document's ten-class evaluation.
    evaluate: Callable[..., tuple] | None

    def prepare_data(self, options: TrainOptions) -> None:
        """Fetch the data where it is missing (one process per node, before any rank loads it)."""

    def load_source(self, options: TrainOptions) -> Any:
        """The task's data, whose summary() the nodes must agree on."""

    def source_place(self, options: TrainOptions) -> tuple[str, str]:
        """Where the data came from, and the remedy when the nodes' data differ."""

    def make_split(self, source: Any, seed: int, rank: int, world_size: int) -> Any:
        """The seeded train, validation and test parts, and this rank's train sampler."""

    def build_loaders(
        self, options: TrainOptions, source: Any, split: Any, rank: int, world_size: int, device: torch.device
    ) -> Loaders:
        """This rank's train, validation and test loaders."""

    def build_model(self, options: TrainOptions) -> nn.Module:
        """The model, its weights drawn from the seeded generator."""

    def criterion(self) -> nn.Module:
        """The loss of one micro-batch (a mean: the plan's divisors make a window's mean of it)."""

    def window_plan(self, plan: list[MicroStep], options: TrainOptions, config: dict) -> list[MicroStep]:
        """The run's window plan as the task divides a window's loss (config gains what that decided)."""

    def run_config(self, options: TrainOptions) -> dict:
        """What the task adds to the run's configuration (both modes must share it)."""

    def epoch_plan(
        self, plan: list[MicroStep], split: Any, options: TrainOptions, place: Any, epoch: int
    ) -> list[MicroStep]:
        """The plan of one epoch (0-based), where the task's divisors depend on what the epoch reads."""

    def write_results(
        self,
        folder: Any,
        options: TrainOptions,
        config: dict,
        setup: Any,
        model: nn.Module,
        test: tuple,
        weights: dict,
        run_id: str,
        started_at: str,
    ) -> tuple[dict, dict]:
        """Rank 0: the report and checkpoint into the run's folder; returns the report and the run's record."""


TASKS: dict[str, Task] = {task.name: task for task in (ImageTask(), TextTask())}  # experiment.TASKS names them


class TaskResults(Protocol):
    """What verify.py asks of a task's checks (the lab's in checks/task_results.py; a task of your own names its
    class as its `results`). A refusal is a files.AuditError: one line, exit 1."""

    name: str  # the task's, as its runs record it

    def model(self) -> nn.Module:
        """The model the runs trained, freshly made: the communication counts follow from its parameters."""

    def documented(self, config: dict) -> dict:
        """The documented experiment the strict audit holds the runs to (the lab's tasks only)."""

    def prepare(self, artifacts: Path, config: dict, strict: bool) -> None:
        """What the pair's checks need, made once before the runs are read."""

    def check_run(self, folder: Path, mode: str, record: dict, strict: bool) -> dict:
        """One run's results (its report holds model_test_loss and model_test_accuracy); returns its report."""

    def check_pair(self, artifacts: Path, config: dict, runs: dict, strict: bool) -> None:
        """What the two runs' results must hold together."""


def members(protocol: type) -> list[str]:
    """What a protocol's objects have: its annotated attributes and its methods (a structural Protocol checks
    none by itself)."""
    methods = [name for name, value in vars(protocol).items() if inspect.isfunction(value) and not name.startswith("_")]
    return [*protocol.__annotations__, *methods]


# train.py's options that a task's `documented` gives (experiment.in_range), with what each must be.
DOCUMENTED_OPTIONS = {
    "epochs": lambda value: isinstance(value, int) and value > 0,
    "batch_size": lambda value: isinstance(value, int) and value > 0,
    "partial_window": lambda value: value in PARTIAL_WINDOW_POLICIES,
}


@functools.cache
def find_task(name: str) -> Task:
    """The task train.py's --task names: the lab's by name, or MODULE:CLASS, a Task defined outside the package
    (importable where train.py and verify.py run) and made here, its every member and its results' checked."""
    if name in TASKS:
        return TASKS[name]
    module_name, _, class_name = name.partition(":")
    if not module_name or not class_name.isidentifier():
        raise LabError(f"task {name!r} is neither the lab's ({', '.join(TASKS)}) nor MODULE:CLASS, a task of your own")
    task = made(name, module_name, class_name)
    missing = [member for member in members(Task) if not hasattr(task, member)]
    results = getattr(task, "results", None)
    if results is None:
        missing.append("results")
    else:
        missing += [f"results.{member}" for member in members(TaskResults) if not hasattr(results, member)]
    if missing:
        raise LabError(
            f"task {name} lacks {', '.join(missing)} (ddp_no_sync_lab/tasks/registry.py's Task, TaskResults)"
        )
    if task.name != name:
        raise LabError(f"task {name} calls itself {task.name!r}: its name must be the MODULE:CLASS that finds it")
    wrong = [key for key, holds in DOCUMENTED_OPTIONS.items() if not holds(task.documented.get(key))]
    if wrong:
        raise LabError(
            f"task {name}: its documented {', '.join(f'{key}={task.documented.get(key)!r}' for key in wrong)}: "
            f"epochs and batch_size must be positive whole numbers, partial_window one of {PARTIAL_WINDOW_POLICIES}"
        )
    return task


def made(name: str, module_name: str, class_name: str) -> Task:
    """The task's class imported and made; whatever fails (its import, its module's code, its constructor) said in
    one line, with the PYTHONPATH remedy where the module itself was not found."""
    try:
        return getattr(importlib.import_module(module_name), class_name)()
    except Exception as error:  # a user's module: any error of its code is the user's to read in one line
        remedy = ""
        if isinstance(error, ModuleNotFoundError) and f"{module_name}.".startswith(f"{error.name}."):
            remedy = f"; put the folder that holds {module_name.replace('.', '/')}.py on PYTHONPATH"
        raise LabError(f"task {name}: {type(error).__name__}: {error}{remedy}") from None


def task_name(name: str) -> str:
    """train.py's --task type: the name of a task find_task finds, or the parser's one line of why not."""
    try:
        return find_task(name).name
    except LabError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def check_window_plan(task: Task, plan: list[MicroStep], config: dict) -> None:
    """A task of your own trains the lab's window plan, which verify.py holds its runs to (experiment.epoch_plan:
    its train loader's batches from the split, each divided per sample); the lab's tasks keep their own."""
    if task.name in TASKS:
        return
    expected = experiment.epoch_plan(config)
    if plan != expected:
        raise LabError(
            f"task {task.name}: its window plan ({len(plan)} micro-batches) is not the lab's ({len(expected)}, "
            f"experiment.epoch_plan), which verify.py holds its runs to: give its train loader one batch per "
            f"batch_size of its share, and return experiment.sample_plan(plan, config) from window_plan"
        )


def task_file(task: Task) -> Path | None:
    """The file of a task defined outside the package (the nodes must run it byte for byte), None for the lab's."""
    return None if task.name in TASKS else Path(inspect.getfile(type(task)))


def code_sha256(path: Path) -> str:
    """A task file's hash as the runs record it ("task code sha256" beside the lab's code)."""
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]
