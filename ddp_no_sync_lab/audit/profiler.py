"""The profiler as the audit's second witness (train.py --profile-windows K): the PyTorch profiler over K
windows of epoch 1, every rank's summary of the c10d calls and their executions beside the audit's own counts
for the same micro-batches, and verify.py's check that the two witnesses agree.
"""

import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function, schedule

from ddp_no_sync_lab.audit.checklist import AVERAGE_WITNESS_LABEL
from ddp_no_sync_lab.audit.instruments import read_clock, settle_comm_hooks
from ddp_no_sync_lab.cli import LabError
from ddp_no_sync_lab.experiment import COLLECTIVE_KINDS, COUNTS, from_progressions
from ddp_no_sync_lab.files import (
    PROFILE_FILE,
    PROFILE_TRACE_FILE,
    RUN_RECORD_FILE,
    check,
    is_int,
    is_number,
    json_bytes,
    profile_trace_files,
    read_json,
)


class WindowProfiler:
    """--profile-windows K: the PyTorch profiler over K accumulation windows of epoch 1.

    Window 1 is skipped and window 2 is the profiler's warm-up (DDP rebuilds its buckets in one of them, and a
    profiler's first steps run slow); windows 3 to K + 2 are recorded. The audit's totals are read at the edges
    of the recorded micro-batches, so that the two witnesses count the same collectives: the profiler sees the
    c10d calls (c10d::allreduce_, c10d::broadcast_) and their executions (gloo's threads on CPU, NCCL kernels on
    GPU), the audit its hook and AuditedDDP.
    """

    def __init__(self, windows, accum_steps, plan_length, device, audit):
        self.first, self.stop = 2 * accum_steps, (2 + windows) * accum_steps
        if self.stop > plan_length:
            most = plan_length // accum_steps - 2
            remedy = (
                f"pass --profile-windows {most} or less" if most > 0 else "use more data or a smaller --accum-steps"
            )
            raise LabError(
                f"--profile-windows {windows} needs {2 + windows} windows of {accum_steps} micro-batches in an epoch "
                f"(one skipped, one of warm-up, {windows} profiled); an epoch here has {plan_length} micro-batches: "
                f"{remedy}"
            )
        self.device, self.audit = device, audit
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        recorded = schedule(skip_first=accum_steps, wait=0, warmup=accum_steps, active=windows * accum_steps, repeat=1)
        self.profiler = profile(activities=activities, schedule=recorded)

    def __enter__(self):
        self.profiler.__enter__()
        return self

    def __exit__(self, *exception):
        return self.profiler.__exit__(*exception)

    def span(self, name):
        return record_function(name)

    def after_micro_batch(self, index):
        if index == self.first - 1:
            read_clock(self.device)
            self.audit_before = self.audit.totals()
        elif index == self.stop - 1:
            read_clock(self.device)
            settle_comm_hooks()  # gloo's threads close their last events before the profiler stops
            self.audit_after = self.audit.totals()
        self.profiler.step()  # the schedule counts micro-batches: its step n is micro-batch n

    def summary(self, rank):
        """What this rank's profiler saw in the recorded micro-batches, and what its audit counted there."""
        audit = {key: self.audit_after[key] - self.audit_before[key] for key in self.audit_after}
        return summarize(self.profiler.events(), rank, audit)

    def write(self, folder, place, windows):
        """Every rank's summary and Chrome trace to rank 0, which writes them: profile.json, and one trace per
        rank (its distributedInfo names the rank: Perfetto opens each, HolisticTraceAnalysis reads them all)."""
        with tempfile.TemporaryDirectory() as scratch:
            trace = Path(scratch) / PROFILE_TRACE_FILE.format(rank=place.rank)
            self.profiler.export_chrome_trace(str(trace))
            mine = (self.summary(place.rank), trace.read_bytes())
        gathered = [None] * place.world_size
        dist.all_gather_object(gathered, mine)
        if place.rank != 0:
            return
        for rank, (_, trace_bytes) in enumerate(gathered):
            folder.write(PROFILE_TRACE_FILE.format(rank=rank), trace_bytes)
        summaries = [summary for summary, _ in gathered]
        record = {"windows": windows, "micro_batches": [self.first, self.stop], "ranks": summaries}
        folder.write(PROFILE_FILE, json_bytes(record))


MICRO_BATCH_LABEL = "micro-batch "
RANK_AGREEMENT_LABEL = "rank agreement"
LABELLED_KINDS = {
    RANK_AGREEMENT_LABEL: "rank-agreement all-reduce",
    AVERAGE_WITNESS_LABEL: "average-witness all-reduce",
}
# Each c10d call the lab makes in training (FSDP's too), its kind, and the events that execute it: gloo's on CPU,
# NCCL's kernels (named ncclDevKernel_AllReduce_..., ..._Broadcast_...) on GPU. gloo runs a reduce-scatter as an
# all-reduce: one kind of execution for two kinds of call, paired in the order they were called.
COLLECTIVE_EVENTS = {
    "c10d::allreduce_": ("gradient all-reduce", "gloo:all_reduce", "AllReduce"),
    "c10d::broadcast_": ("broadcast", "gloo:broadcast", "Broadcast"),
    "c10d::_allgather_base_": ("all-gather", "gloo:all_gather", "AllGather"),
    "c10d::_reduce_scatter_base_": ("reduce-scatter", "gloo:all_reduce", "ReduceScatter"),
}
EXECUTION_GROUPS = {}  # gloo's execution name: the calls it executes, the first naming the group
for call_name, (_, gloo_name, _) in COLLECTIVE_EVENTS.items():
    EXECUTION_GROUPS.setdefault(gloo_name, []).append(call_name)


def event_start(event):
    return event.time_range.start


def relative_span(event, origin):
    return [(event.time_range.start - origin) / 1e6, (event.time_range.end - origin) / 1e6]


def summarize(events, rank, audit):
    """One rank's summary of the profiled micro-batches from its profiler events (anything with .name,
    .device_type and .time_range), beside `audit`, the audit's counts for the same micro-batches.

    The labels (micro-batches, the ranks' agreement) are taken from CPU-side events alone: on CUDA each
    record_function range appears a second time as a device-side annotation of the same name, which would count
    every micro-batch twice. Times are seconds from the start of the first recorded micro-batch. Each c10d call
    is paired, in order, with its execution (gloo runs a group's collectives in the order they were called;
    NCCL's kernels run in stream order).
    """
    labels = [event for event in events if event.device_type == torch.autograd.DeviceType.CPU]
    micro_batches = sorted((e for e in labels if e.name.startswith(MICRO_BATCH_LABEL)), key=event_start)
    origin = event_start(micro_batches[0])
    labelled_spans = [(LABELLED_KINDS[e.name], e.time_range) for e in labels if e.name in LABELLED_KINDS]
    calls, executions, collectives = {}, {}, []
    for gloo_name, names in EXECUTION_GROUPS.items():
        called = sorted((e for e in events if e.name in names), key=event_start)
        words = [COLLECTIVE_EVENTS[name][2] for name in names]
        executed = sorted((e for e in events if any(is_execution(e, gloo_name, w) for w in words)), key=event_start)
        calls.update({name: sum(e.name == name for e in called) for name in names})
        executions[names[0]] = len(executed)
        for call, execution in zip(called, executed):
            kind = COLLECTIVE_EVENTS[call.name][0]
            for labelled, span in labelled_spans:
                if span.start <= event_start(call) <= span.end:
                    kind = labelled
            collectives.append([kind, *relative_span(execution, origin)])
    spans = [[int(e.name.removeprefix(MICRO_BATCH_LABEL)), *relative_span(e, origin)] for e in micro_batches]
    # The optimizer's own profiling range, one per step() call: a witness of the steps beside the step hooks.
    optimizer_steps = sum(e.name.startswith(OPTIMIZER_STEP_EVENT) for e in labels)
    collective_seconds = {kind: 0.0 for kind in COLLECTIVE_KINDS}
    for kind, start, end in collectives:
        collective_seconds[kind] += end - start
    # A micro-batch's compute: its span less the collectives' executions within it (on CPU the main thread
    # waits for them at the end of a synchronized backward).
    compute = [
        end - start - sum(max(0.0, min(end, stop) - max(start, begin)) for _, begin, stop in collectives)
        for _, start, end in spans
    ]
    return {
        "rank": rank,
        "calls": calls,
        "executions": executions,
        "optimizer_steps": optimizer_steps,
        "collective_seconds": collective_seconds,
        "compute_seconds_per_micro_batch": sum(compute) / len(compute),
        "micro_batches": spans,
        "collectives": sorted(collectives, key=lambda collective: collective[1]),
        "audit": audit,
    }


def is_execution(event, gloo_name, nccl_word):
    on_gpu = event.device_type == torch.autograd.DeviceType.CUDA and event.name.startswith("nccl")
    return event.name == gloo_name or (on_gpu and nccl_word in event.name)


# ----------------------------------------------------------------------------- the witness checked (verify.py)


def in_range(runs, first, stop):
    return sum(first <= position < stop for position in from_progressions(runs))


def check_profile(folder, record, history):
    """train.py --profile-windows K: the profiler's c10d calls in the recorded micro-batches of epoch 1 must
    be the audit's for the same micro-batches, on every rank: each hook call, each of DDP's used-parameter-map
    all-reduces, each rank-agreement and each average-witness all-reduce (one each per optimizer step) a
    c10d::allreduce_, each buffer or bucket-rebuild broadcast a
    c10d::broadcast_; on gloo each call also executed once. Returns the profile, or None without one."""
    path = folder / PROFILE_FILE
    if PROFILE_FILE not in record["files"]:
        check(not path.exists(), path, f"is not listed in {RUN_RECORD_FILE}: it does not come from this run")
        return None
    profile = read_json(path)
    config = record["config"]
    missing = [name for name in profile_trace_files(config["world_size"]) if name not in record["files"]]
    check(not missing, folder / RUN_RECORD_FILE, f"does not list the profiled run's traces {missing}")
    accum_steps = config["accum_steps"]
    windows = profile.get("windows") if isinstance(profile, dict) else None
    check(is_int(windows) and windows > 0, path, f"windows must be a positive whole number, got {windows!r}")
    span = [2 * accum_steps, (2 + windows) * accum_steps]
    check(
        profile.get("micro_batches") == span,
        path,
        f"micro_batches must be {span} for {windows} windows of {accum_steps}",
    )
    ranks = profile.get("ranks")
    check(
        isinstance(ranks, list)
        and [summary.get("rank") if isinstance(summary, dict) else None for summary in ranks]
        == list(range(config["world_size"])),
        path,
        f"expected one summary per rank, ranks 0 to {config['world_size'] - 1}",
    )
    steps = in_range(history[0]["optimizer_step_positions"], *span)
    syncs = in_range(history[0]["gradient_sync_positions"], *span)
    for summary in ranks:
        check_rank_profile(path, summary, config, span, steps, syncs)
    return profile


def check_rank_profile(path, summary, config, span, steps, syncs):
    """One rank's profiler summary against the audit over the profiled micro-batches `span` of epoch 1, where the
    step hooks recorded `steps` optimizer steps and the history's positions put `syncs` gradient syncs."""
    rank, (first, stop) = summary["rank"], span
    where = f"epoch 1, micro-batches {first}-{stop - 1}"
    audit, calls, executions = (summary.get(key) for key in ("audit", "calls", "executions"))
    check(
        all(isinstance(part, dict) for part in (audit, calls, executions))
        and all(is_int(audit.get(key)) for key in COUNTS)
        and all(is_int(calls.get(name)) for name in COLLECTIVE_EVENTS)
        and all(is_int(executions.get(names[0])) for names in EXECUTION_GROUPS.values()),
        path,
        f"rank {rank}: calls, executions and audit must hold whole-number counts",
    )
    check_profile_spans(path, rank, summary)
    labelled = sorted(micro_batch[0] for micro_batch in summary["micro_batches"])
    check(
        labelled == list(range(first, stop)),
        path,
        f"rank {rank}: the profiled micro-batches are labelled {labelled}, not once each {first} to {stop - 1} "
        f"(device-side copies of the labels counted too?)",
    )
    check(
        summary.get("optimizer_steps") == steps,
        path,
        f"rank {rank}: the profiler saw {summary.get('optimizer_steps')} optimizer steps in {where}, the step hooks "
        f"recorded {steps} there: the two witnesses disagree",
    )
    check(
        audit["gradient_syncs"] == syncs,
        path,
        f"rank {rank}: the audit counted {audit['gradient_syncs']} gradient syncs in {where}, the history's "
        f"positions put {syncs} there",
    )
    for name, (count, made_of) in expected_calls(audit, steps).items():
        check(
            calls[name] == count,
            path,
            f"rank {rank}: the profiler saw {calls[name]} {name} calls in {where}, the audit counted {made_of} = "
            f"{count}: the audit and its witness disagree",
        )
    for names in EXECUTION_GROUPS.values() if config.get("backend") == "gloo" else ():
        called = sum(calls[name] for name in names)
        check(
            executions[names[0]] == called,
            path,
            f"rank {rank}: {called} {' and '.join(names)} calls but {executions[names[0]]} executions on gloo's "
            f"threads in {where}",
        )


def expected_calls(audit, steps):
    """Per c10d event, the calls the audit's counts make (and what they are made of, for the refusal)."""
    return {
        "c10d::allreduce_": (
            audit["sync_bucket_calls"] + audit["used_map_allreduces"] + steps + audit["witness_allreduces"],
            f"{audit['sync_bucket_calls']} hook calls + {audit['used_map_allreduces']} used-parameter-map "
            f"all-reduces + {steps} rank-agreement all-reduces + {audit['witness_allreduces']} average-witness "
            f"all-reduces",
        ),
        "c10d::broadcast_": (
            audit["buffer_broadcast_collectives"] + audit["rebuild_broadcast_collectives"],
            f"{audit['buffer_broadcast_collectives']} buffer-broadcast + {audit['rebuild_broadcast_collectives']} "
            f"bucket-rebuild collectives",
        ),
        "c10d::_allgather_base_": (audit["all_gathers"], f"{audit['all_gathers']} FSDP all-gathers"),
        "c10d::_reduce_scatter_base_": (audit["reduce_scatters"], f"{audit['reduce_scatters']} FSDP reduce-scatters"),
    }


OPTIMIZER_STEP_EVENT = "Optimizer.step#"  # torch.optim's record_function around each step()


def check_profile_spans(path, rank, summary):
    """What the witness table and the timeline read: times as numbers, spans as [label, start, end]."""
    seconds, micro_batches, collectives = (
        summary.get(key) for key in ("collective_seconds", "micro_batches", "collectives")
    )
    check(
        isinstance(seconds, dict)
        and all(is_number(seconds.get(kind)) for kind in COLLECTIVE_KINDS)
        and is_number(summary.get("compute_seconds_per_micro_batch"))
        and is_number(summary["audit"].get("comm_seconds")),
        path,
        f"rank {rank}: collective_seconds, compute_seconds_per_micro_batch and the audit's comm_seconds must be numbers",
    )
    check(
        isinstance(micro_batches, list)
        and micro_batches
        and all(
            isinstance(span, list) and len(span) == 3 and is_int(span[0]) and is_number(span[1]) and is_number(span[2])
            for span in micro_batches
        )
        and isinstance(collectives, list)
        and all(
            isinstance(span, list)
            and len(span) == 3
            and span[0] in COLLECTIVE_KINDS
            and is_number(span[1])
            and is_number(span[2])
            for span in collectives
        ),
        path,
        f"rank {rank}: micro_batches must be [index, start, end] and collectives [kind, start, end] spans",
    )
