"""The audit's public face: what any training script imports to have its own loop observed as train.py's is.

It imports torch, the standard library and the audit's own modules (no model, no task), and changes nothing in the
process until install() is called; train.py reaches the audit through it alone. A rank's use, on objects the script made:

    face.install()                                       # before the script makes its DDP, optimizer and loss
    comm_audit = face.CommAudit(world_size)
    ddp_model.register_comm_hook((comm_audit, hook_state), face.counting(hook))
    audit = face.attach(ddp_model, optimizer, criterion, comm_audit, device)
    audit.begin_epoch(face.EpochTrace())                 # then the script's own epoch, untouched
    observations = audit.end_epoch()                     # every rank's, for verify's checks (checks/certify.py)

The witnesses read what happened: the synchronized gradient as DDP's backward ends (a clip between the sync and
the step changes nothing read; clip_grad_norm_'s own factor is expected of the step's gradients), each reset,
backward, loss and step from its own hook (audit/checklist.py).
"""

from dataclasses import dataclass

import torch

from ddp_no_sync_lab.audit.checklist import HeldHook, Witness, first_batched
from ddp_no_sync_lab.audit.clipping import CLIPS
from ddp_no_sync_lab.audit.instruments import (
    COMPRESSION_HOOKS,
    CollectiveClock,
    CommAudit,
    EpochTrace,
    before_step,
    ranks_agree,
    read_clock,
    settle_comm_hooks,
    shard_coverage,
)
from ddp_no_sync_lab.audit.memory import saved_activations
from ddp_no_sync_lab.audit.orders import ORDERS
from ddp_no_sync_lab.audit.profiler import MICRO_BATCH_LABEL, RANK_AGREEMENT_LABEL, WindowProfiler, check_profile
from ddp_no_sync_lab.audit.tap import TAP

__all__ = [
    # installing, counting, attaching
    "install",
    "counting",
    "attach",
    "Audit",
    "CommAudit",
    "CollectiveClock",
    "EpochTrace",
    # the witnesses themselves: a loop met piece by piece (the watcher's) extends them, reporting the events, and
    # finds each forward's batch as they do
    "Witness",
    "HeldHook",
    "first_batched",
    # the instruments a loop also calls: the ranks' step fingerprints, the clock, the samples read, the teardown
    "before_step",
    "ranks_agree",
    "read_clock",
    "shard_coverage",
    "settle_comm_hooks",
    # what train.py's own loop adds: its compressing hooks and handed bytes, held memory, the profiler
    "COMPRESSION_HOOKS",
    "TAP",
    "saved_activations",
    "WindowProfiler",
    "MICRO_BATCH_LABEL",
    "RANK_AGREEMENT_LABEL",
    # verify.py's check that the profiler's witness and the counts agree
    "check_profile",
]


def install():
    """The process-wide witnesses, installed once (a second call changes nothing): the tap on
    torch.distributed.all_reduce (the bytes a hook hands to the collective), on clip_grad_norm_, and on
    DistributedSampler's iteration (the order each epoch was handed). Installed before anything else wraps those,
    they sit beneath every later wrapper."""
    TAP.install()
    CLIPS.install()
    ORDERS.install()


def counting(hook):
    """`hook` (a DDP communication hook: hook(state, bucket) -> Future) counted as train.py's own hook counts:
    each call, each synchronized backward (its last bucket), the bytes handed to the collective and the seconds to
    its completion. Register the result with the state (comm_audit, the hook's own state)."""

    def counted(state, bucket):
        comm_audit, hook_state = state
        comm_audit.sync_bucket_calls += 1
        if bucket.is_last():
            comm_audit.count_sync()
        started = comm_audit.clock.start()

        def finished(future):
            comm_audit.clock.stop(started, "sync")
            value = future.value()
            return value[0] if isinstance(value, list) else value

        with TAP.handed() as handed:
            future = hook(hook_state, bucket)
        comm_audit.count_handed(handed)
        return future.then(finished)

    return counted


@dataclass
class Audit:
    """The checklist's witnesses on one rank's model, optimizer and loss, beside the counts of its collectives."""

    comm_audit: CommAudit
    witness: Witness

    def begin_epoch(self, epoch_trace: EpochTrace) -> None:
        """Observe the next epoch into `epoch_trace` (a resumed epoch's holds what an earlier start saw)."""
        self.witness.begin_epoch(epoch_trace)

    def end_epoch(self) -> dict:
        """Close the epoch (a collective: every rank calls it) and return every rank's observations."""
        return self.witness.end_epoch()


def attach(
    wrapper: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    criterion: torch.nn.Module,
    comm_audit: CommAudit,
    device: torch.device,
) -> Audit:
    """The witnesses hooked onto what the script made: the wrapper's module (DDP's, or the lab's FSDP2 wrapper's),
    its parameters' gradients, the criterion's calls and the optimizer's steps. Nothing is set on the objects."""
    return Audit(comm_audit, Witness(wrapper, optimizer, criterion, comm_audit, device))
