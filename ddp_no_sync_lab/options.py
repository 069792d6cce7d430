"""train.py's options as one frozen, typed object: parsed and completed once (the task's documented values for
those not given), then only read. Its fields are train.py's parser's destinations, one for one: constructing it
from the parsed namespace fails on any option either side lacks."""

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TrainOptions:
    mode: str  # the document's: every, no_sync
    strategy: str  # ddp (the document's), fsdp
    output: Path  # the run folder
    task: str  # cifar10 (the document's), text
    epochs: int | None  # None until completed with the task's documented value (experiment.in_range)
    batch_size: int | None  # per rank; likewise
    accum_steps: int
    seed: int
    expected_world_size: int
    data_dir: Path
    partial_window: str | None  # likewise
    loss_normalization: str
    device: str
    precision: str
    gpu_backend: str
    loader: str
    activation_checkpointing: bool
    comm_hook: str
    bucket_cap_mb: float
    broadcast_buffers: bool
    static_graph: bool
    find_unused_parameters: bool
    gradient_as_bucket_view: bool
    profile_windows: int | None
    resume: bool
    checkpoint_every_windows: int | None
    quiet: bool
    progress_every: float
