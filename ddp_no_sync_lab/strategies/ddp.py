"""The DDP strategy: the document's wrapper, with what the audit must know of it. AuditedDDP counts DDP's own
collectives that no communication hook sees; the check that the wrapped model has the settings the expected
counts assume; DDP's gradient errors said in one line. The counting hook itself is in train.py, where the lesson
is; DDP's expected counts are experiment.expected_epoch_counts."""

import inspect
from contextlib import contextmanager

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_no_sync_lab.cli import LabError
from ddp_no_sync_lab.experiment import BROADCAST_BUCKET_BYTES, REBUILD_BROADCASTS


class AuditedDDP(DDP):
    """DDP that also counts DDP's own collectives, which no comm hook sees: the BatchNorm buffer broadcasts
    (broadcast_buffers=True), counted and timed, and the one-time broadcast of its rebuilt bucket order."""

    def broadcast_rank_0_buffers(self):
        """What DDP does before a forward with broadcast_buffers=True, done on request: without it each rank keeps
        its own BatchNorm statistics, and evaluation would mix the ranks' models (counted as DDP's are)."""
        self._distributed_broadcast_coalesced(list(self.module.buffers()), BROADCAST_BUCKET_BYTES, 0)

    def full_state_dict(self):  # as strategies/fsdp.py's, which gathers its shards
        return self.module.state_dict()

    def _pre_forward(self, *inputs, **kwargs):
        rebuilt_before = self._has_rebuilt_buckets
        result = super()._pre_forward(*inputs, **kwargs)
        if self._has_rebuilt_buckets and not rebuilt_before:
            self.comm_audit.rebuild_broadcast_collectives += REBUILD_BROADCASTS
        return result

    def _distributed_broadcast_coalesced(self, tensors, buffer_size, authoritative_rank=0):
        audit = self.comm_audit
        started = audit.clock.start()
        super()._distributed_broadcast_coalesced(tensors, buffer_size, authoritative_rank)
        audit.clock.stop(started)  # on GPU: the current stream waits for the broadcast
        # One collective per dtype: _broadcast_coalesced flattens same-dtype tensors into one bucket
        # (tests/test_comm_audit.py checks this against the profiler's c10d::broadcast_ events).
        audit.buffer_broadcast_collectives += len({tensor.dtype for tensor in tensors})
        audit.broadcast_bytes += sum(tensor.numel() * tensor.element_size() for tensor in tensors)


# What experiment.expected_epoch_counts derives from a run's DDP settings, read back from the wrapped model:
# the buffers broadcast or not, the search for unused parameters, gradients as views of the buckets, the static
# graph, the bucket cap; the gradients all-reduced by the counting hook alone (running the run's --comm-hook)
# and the buffers broadcast by DDP itself (no buffer hook).


def ddp_attributes(settings):
    """The DDP attributes that hold a run's settings (experiment.ddp_settings), with the values they must have."""
    attributes = {name: settings[name] for name in settings if name not in ("bucket_cap_mb", "comm_hook")}
    return {**attributes, "bucket_bytes_cap": int(settings["bucket_cap_mb"] * 1024 * 1024)}


def hook_name(hook, counting_hook):
    """The counting hook's name where `hook` is that very function (or a wrapper of it, functools.wraps's
    __wrapped__ followed: what runs beneath it is the witnesses' to judge); any other hook's module and qualified
    name, so that another function of the same name is told apart."""
    if inspect.unwrap(hook) is counting_hook:
        return counting_hook.__name__
    return f"{hook.__module__}.{hook.__qualname__}"


def check_ddp_settings(ddp_model, settings, counting_hook):
    """The wrapped model has the run's settings, `counting_hook` (train.py's, found by identity) as its only
    gradient hook (running the run's --comm-hook), no buffer hook."""
    expected = {
        **ddp_attributes(settings),
        "gradient comm hooks": [counting_hook.__name__],
        "counted hook": settings["comm_hook"],
        "buffer comm hook": False,
    }
    actual = {name: getattr(ddp_model, name) for name in ddp_attributes(settings)}
    actual["gradient comm hooks"] = [hook_name(hook, counting_hook) for hook, _ in ddp_model._comm_hooks]
    actual["counted hook"] = ddp_model.comm_audit.comm_hook
    actual["buffer comm hook"] = hasattr(ddp_model, "buffer_hook")
    changed = [
        f"{name} {actual[name]!r} (expected {value!r})" for name, value in expected.items() if actual[name] != value
    ]
    if changed:
        raise LabError(
            f"DDP is wrapped with settings the audit's expected counts do not assume: {'; '.join(changed)}; "
            f"restore them in train.wrap_model, or change experiment.expected_epoch_counts with them"
        )


# DDP's errors when a parameter's gradient comes twice in one backward, or never: what reentrant activation
# checkpointing does (docs/checkpointing.md). DDP's own advice for the second,
# find_unused_parameters=True, would hide it: the stages would train no more, silently.
DDP_GRADIENT_ERRORS = {
    "Expected to mark a variable ready only once": "DDP saw a parameter's gradient twice in one backward",
    "Expected to have finished reduction in the prior iteration": "DDP found parameters that got no gradient in the last backward",
}


# DDP's reducer under static_graph=True meeting no_sync(): an internal assert at the first backward inside it
# (pytorch/pytorch#143580); where the assert is lifted, DDP stops all-reducing after the first window instead
# (pytorch/pytorch#187732), which the audit's counts and fingerprints show.
STATIC_GRAPH_ASSERT = "expect_autograd_hooks_ INTERNAL ASSERT FAILED"


def explain_ddp_error(error):
    """A LabError of one line for DDP's gradient errors (None for any other error)."""
    if STATIC_GRAPH_ASSERT in str(error):
        return LabError(
            f'--static-graph with no_sync(): DDP failed "{STATIC_GRAPH_ASSERT}" at the first backward inside '
            f"no_sync() on torch {torch.__version__} (pytorch/pytorch#143580); run --mode no_sync without "
            f"--static-graph",
            kind="RuntimeError",
            broken_process=True,  # the reducer, broken by its assert, aborts the process when it is destroyed
        )
    for marker, what in DDP_GRADIENT_ERRORS.items():
        if marker in str(error):
            return LabError(
                f'{what} ("{marker}"): with activation checkpointing use torch.utils.checkpoint.checkpoint(..., '
                f"use_reentrant=False), as model.CifarCNN does for --activation-checkpointing; reentrant checkpointing "
                f"gives no gradient to a stage whose input needs none and, with find_unused_parameters=True, marks "
                f"its parameters ready twice",
                kind="RuntimeError",
            )
    return None


@contextmanager
def ddp_errors_explained():
    """DDP's gradient errors raised inside become explain_ddp_error's one line; any other error stays as it is."""
    try:
        yield
    except RuntimeError as error:
        explained = explain_ddp_error(error)
        if explained is None:
            raise
        raise explained from None
