"""The Task: what train.py and its start-up ask of a task, declared once, and the lab's tasks by name.

A task decides its data (fetched, loaded, agreed between the nodes, split), each rank's loaders, its model and
loss, how a window's micro-batches divide the loss, what its runs add to their configuration, how held-out data is
evaluated, and its results. train.py and run/launch.py reach a task only through these; verify.py's checks of a
task's results are checks/task_results.py's. docs/architecture.md says how to add one.
"""

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from ddp_no_sync_lab.experiment import MicroStep
from ddp_no_sync_lab.options import TrainOptions
from ddp_no_sync_lab.tasks.image import ImageTask
from ddp_no_sync_lab.tasks.language import TextTask
from ddp_no_sync_lab.tasks.loaders import Loaders

__all__ = ["TASKS", "Task"]


class Task(Protocol):
    name: str  # train.py's --task (a run records it where its run_config does: the text task's)
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
