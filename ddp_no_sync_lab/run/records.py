"""A run's records beside its files: the run's configuration and its epoch rows (the document's fields, then the
audit's); files.py writes them, each task its results (tasks/image.py, tasks/language.py)."""

import torch
import torch.distributed as dist

from ddp_no_sync_lab.experiment import COUNTS, DDP_DEFAULTS, TASKS, as_progressions
from ddp_no_sync_lab.options import TrainOptions
from ddp_no_sync_lab.run.launch import Place, Setup

# An epoch row's seconds from the collective clock, the ranks' waits too (CollectiveClock.seconds_and_waits).
CLOCKED_SECONDS = ("comm_seconds", "sync_seconds", "sync_wait_seconds", "all_gather_seconds", "all_gather_wait_seconds")


def run_config(options: TrainOptions, place: Place, setup: Setup) -> dict:
    """Everything that must match between the two runs for their comparison to mean anything (the hardware
    is recorded beside it: verify.py prints it and does not compare it)."""
    sizes = setup.split.sizes
    return {
        "world_size": place.world_size,
        "nodes": place.nodes,
        "batch_size": options.batch_size,
        "accum_steps": options.accum_steps,
        "epochs": options.epochs,
        "seed": options.seed,
        "partial_window": options.partial_window,
        "train_size": sizes["train"],
        "validation_size": sizes["validation"],
        "test_size": sizes["test"],
        "data_layout": setup.source.layout,
        "loader": options.loader,
        "data_fingerprint": setup.source.fingerprint,
        "data_synthetic": setup.source.synthetic,
        "activation_checkpointing": options.activation_checkpointing,
        "device": setup.device.type,
        "backend": setup.backend,
        "precision": setup.precision.name,
        "hardware": setup.hardware,
        **{setting: getattr(options, setting) for setting in DDP_DEFAULTS},  # DDP's settings and the gradient hook
        **({"strategy": options.strategy} if options.strategy != "ddp" else {}),  # where not the document's
        **({"task": options.task} if options.task not in TASKS else {}),  # a task of your own, as --task found it
        "torch": torch.__version__,
        "code": setup.code,  # the lab's code and versions, every node's (launch.code_and_versions)
    }


def epoch_row(epoch, mode, validation, comm_audit, phase_seconds, peak_bytes, run_id, device, group):
    """The epoch's JSON line from `epoch` (resume.EpochState: its trace, totals, the audit's totals at its start
    and where it resumed) and the audit now: the document's fields first, then the rest of the audit. Losses,
    correct and counts are summed over ranks; the seconds are means over ranks; the counts are this rank's (every
    rank takes part in every collective, so they are the same on all)."""
    trace, before, after = epoch.trace, epoch.audit_before, comm_audit.totals()
    comm_seconds = after["comm_seconds"] - before["comm_seconds"]
    timed = comm_audit.clock.seconds_and_waits(device, group)  # syncs, all-gathers
    seconds = torch.tensor([*phase_seconds, comm_seconds, *timed], dtype=torch.float64, device=device)
    summed = torch.cat([epoch.totals, seconds])
    dist.all_reduce(summed, group=group)
    loss_sum, correct, count, epoch_seconds_sum, validation_seconds_sum, *clocked_sums = summed.tolist()
    world_size = dist.get_world_size()
    validation_loss, validation_accuracy = validation
    return {
        "epoch": epoch.number,
        "mode": mode,
        "optimizer_steps": len(trace.step_positions),
        "gradient_syncs": after["gradient_syncs"] - before["gradient_syncs"],
        "train_loss": loss_sum / count,
        "train_accuracy": correct / count,
        "validation_loss": validation_loss,
        "validation_accuracy": validation_accuracy,
        **{key: after[key] - before[key] for key in COUNTS if key != "gradient_syncs"},
        # The clock's: all collectives; the training's syncs and all-gathers since any resume, with the ranks' wait.
        **{key: total / world_size for key, total in zip(CLOCKED_SECONDS, clocked_sums, strict=True)},
        "epoch_seconds": epoch_seconds_sum / world_size,
        "train_images_per_second": count / (epoch_seconds_sum / world_size),
        "validation_seconds": validation_seconds_sum / world_size,
        # Where, not only how many (rank 0's): micro-batch indices as [start, stop, step] runs.
        "gradient_sync_positions": as_progressions(trace.sync_positions),
        "optimizer_step_positions": as_progressions(trace.step_positions),
        # What each step did (every rank's fingerprints, one small all-reduce per step) and what the ranks read.
        **trace.step_verdicts(),
        "sample_shards": trace.sample_shards,
        # The document's checklist as the witnesses saw it (audit/checklist.py; verify.py checks each item).
        "checklist": trace.checklist_summary,
        # Where this epoch resumed after a stop (micro-batch indices); the new wrapper's first broadcast is counted.
        "resumed_at": epoch.resumed_at,
        # Memory (rank 0's): activations held for the backward per micro-batch; on CUDA the allocator's peak.
        "saved_activation_bytes": trace.saved_activation_bytes,
        "peak_allocated_bytes": peak_bytes,
        "held_bytes": dict(zip(("gradients", "parameters"), trace.held_bytes)),  # most between micro-batches
        "run_id": run_id,
    }
