"""The wrapper surface, declared once: what train.py's loop, evaluation and results ask of a strategy's wrapper.
DDP's AuditedDDP (ddp.py) has it from DDP itself; FSDP2's ShardedModel (fsdp.py) builds it around fully_shard.
A new strategy offers the same, and its own expected counts (experiment.expected_epoch_counts for DDP,
fsdp.expected_epoch_counts for FSDP2); tests/test_sharded.py holds both wrappers to this surface."""

from contextlib import AbstractContextManager
from typing import Iterator, Protocol

from torch import nn

from ddp_no_sync_lab.audit.instruments import CommAudit


class Wrapper(Protocol):
    module: nn.Module  # the model itself: the witnesses hook its forward, the saves read its state
    comm_audit: CommAudit  # the wrapper's collectives counted and timed
    broadcast_buffers: bool  # False: evaluation broadcasts rank 0's buffers first (broadcast_rank_0_buffers)

    def __call__(self, inputs): ...  # the training or evaluation forward

    def no_sync(self) -> AbstractContextManager: ...  # a backward run inside synchronizes nothing

    def parameters(self) -> Iterator[nn.Parameter]: ...

    def train(self): ...

    def eval(self): ...

    def broadcast_rank_0_buffers(self) -> None: ...  # counted as the wrapper's own collectives

    def full_state_dict(self) -> dict: ...  # the whole model's state on every rank (a collective), for model.pt
