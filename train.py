"""Gradient accumulation under DDP, two ways, with every synchronization counted.

    torchrun --standalone --nnodes=1 --nproc-per-node=2 train.py --mode every   --output artifacts/every
    torchrun --standalone --nnodes=1 --nproc-per-node=2 train.py --mode no_sync --output artifacts/no_sync
    python verify.py

Two machines, one process each: the same command on both (docs/across-machines.md):

    torchrun --nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint=HOST_A:29500
             --rdzv-id=lab-every train.py --mode every --output artifacts/every

`every` all-reduces the gradients after every micro-batch and steps once per window of --accum-steps;
`no_sync` runs the forward AND backward of the first accum_steps - 1 micro-batches of each window inside
ddp_model.no_sync(), so DDP all-reduces once per window. The communication hook below counts the syncs, their
bytes and time; ddp_no_sync_lab/strategies/ddp.py's AuditedDDP counts DDP's own BatchNorm buffer broadcasts,
which no hook sees.

Measured (`make lab` on the EPYC of docs/machines.md, 2026-12-02: 2 CPU ranks, gloo, BF16 autocast, real CIFAR-10 as
JPEG, documented settings; per rank, totals over 5 epochs; docs/results.md has the whole output):

    | mode    | steps/epoch | syncs/epoch | all-reduce MB | buffer-broadcast collectives | train s | test accuracy |
    | every   | 100         | 400         | 4468.3        | 4002                         | 444.3   | 0.7063        |
    | no_sync | 100         | 100         | 1117.1        | 1002                         | 425.2   | 0.7084        |

Stdout carries one JSON line per epoch and the final report (rank 0); progress goes to stderr.
"""

import os

# cuBLAS refuses deterministic mode without a fixed workspace; it must be set before CUDA initializes.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import json
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record

from ddp_no_sync_lab import experiment, files
from ddp_no_sync_lab.audit import face
from ddp_no_sync_lab.cli import LabError, Progress, exit_with, non_negative_float, positive_int
from ddp_no_sync_lab.options import TrainOptions
from ddp_no_sync_lab.precision import PRECISIONS
from ddp_no_sync_lab.run import launch, records, resume
from ddp_no_sync_lab.strategies import ddp
from ddp_no_sync_lab.strategies.fsdp import fsdp_in_range, wrap_sharded
from ddp_no_sync_lab.strategies.surface import Wrapper
from ddp_no_sync_lab.tasks import loaders, registry
from model import CLASSES, MEMORY_FORMAT

SCRIPT = launch.SCRIPT
face.install()  # the witnesses on all_reduce and clip_grad_norm_, beneath anything that wraps them later


def parse_args(argv=None):
    """The document's options, then the lab's (docs/running.md says more of each)."""
    parser = launch.TorchrunArgumentParser(
        prog=SCRIPT, description="Train CifarCNN under DDP in one accumulation mode."
    )
    add = parser.add_argument
    add("--mode", choices=experiment.MODES, required=True)
    add("--strategy", choices=experiment.STRATEGIES, default="ddp", help="fsdp: FSDP2's shards (docs/fsdp.md)")
    add("--output", type=Path, required=True, help="run folder to write, e.g. artifacts/every")
    add(
        "--task",
        type=registry.task_name,
        default="cifar10",
        help="text: packed sequences (docs/packed.md); MODULE:CLASS: a task of your own (docs/architecture.md)",
    )
    add("--epochs", type=positive_int, help="default: the task's documented number")
    add("--batch-size", type=positive_int, help="per rank: images, or text rows; default: the task's documented")
    add("--accum-steps", type=positive_int, default=experiment.DOCUMENTED["accum_steps"])
    add("--seed", type=int, default=experiment.DOCUMENTED["seed"])
    add("--expected-world-size", type=positive_int, default=experiment.DOCUMENTED["world_size"])
    add("--data-dir", type=Path, default=Path("data"), help="image folders, or torchvision's CIFAR-10 (downloaded)")
    add(
        "--partial-window",
        choices=experiment.PARTIAL_WINDOW_POLICIES,
        help="a short last window: stop (error; the image task's default), or divide by its own length (scale)",
    )
    add(
        "--loss-normalization",
        choices=experiment.LOSS_NORMALIZATIONS,
        default="tokens",
        help="divide by the window's tokens (images: samples) over every rank, or by its length (micro-batch)",
    )
    add("--device", choices=("auto", "cuda", "cpu"), default="auto", help="auto: CUDA with a GPU per process")
    add("--precision", choices=PRECISIONS, default="auto", help="auto: BF16 where the device computes it natively")
    add("--gpu-backend", choices=launch.GPU_BACKENDS, default="nccl", help="gloo: CUDA ranks may share a GPU")
    add("--loader", choices=loaders.LOADERS, default="tensor", help="pil: the document's per-image pipeline")
    add("--activation-checkpointing", action="store_true", help="recompute the CNN's stages in the backward")
    add("--comm-hook", choices=experiment.COMM_HOOKS, default="allreduce", help="bf16, fp16: compress the gradients")
    add("--bucket-cap-mb", type=non_negative_float, default=experiment.BUCKET_CAP_MB, help="DDP's gradient bucket cap")
    add("--no-broadcast-buffers", dest="broadcast_buffers", action="store_false", help="DDP's broadcast_buffers off")
    for setting in ("static-graph", "find-unused-parameters", "gradient-as-bucket-view"):
        add(f"--{setting}", action="store_true", help=f"DDP's {setting.replace('-', '_')}=True")
    add("--profile-windows", type=positive_int, metavar="K", help="profile K windows of epoch 1 (a second witness)")
    add("--resume", action="store_true", help="continue the run in --output (start it if none)")
    add("--checkpoint-every-windows", type=positive_int, metavar="N", help="save the state every N windows too")
    add("--quiet", action="store_true", help="no progress lines on stderr")
    add("--progress-every", type=non_negative_float, default=5.0, metavar="SECONDS", help="between progress lines")
    options = TrainOptions(**vars(parser.parse_args(argv)))
    return fsdp_in_range(parser, experiment.in_range(parser, options, registry.find_task(options.task).documented))


# ----------------------------------------------------------------------------- DDP and its counting hook


def counting_allreduce_hook(comm_audit, bucket):
    """DDP's averaging all-reduce (divide by world size, then sum), or the run's compressing hook (--comm-hook),
    counted and timed. DDP calls it once per gradient bucket; bucket.is_last() ends one synchronized backward."""
    comm_audit.sync_bucket_calls += 1
    if bucket.is_last():
        comm_audit.count_sync()  # and DDP's used-parameter all-reduce, when its settings make one
    started = comm_audit.clock.start()

    def finished(future):
        comm_audit.clock.stop(started, "sync")
        value = future.value()  # the all-reduce's [tensor]; a compressing hook's tensor
        return value[0] if isinstance(value, list) else value

    # The bytes are those of the tensors handed to the collective, whatever the --comm-hook label says.
    with face.TAP.handed() as handed:
        if comm_audit.comm_hook != "allreduce":
            future = face.COMPRESSION_HOOKS[comm_audit.comm_hook](comm_audit.group, bucket)
        else:
            tensor = bucket.buffer().div_(comm_audit.world_size)
            future = dist.all_reduce(tensor, group=comm_audit.group, async_op=True).get_future()
    comm_audit.count_handed(handed)
    return future.then(finished)


def wrap_model(model, device, world_size, group=None, settings=experiment.DDP_DEFAULTS):
    """DDP with the run's settings (the document's: one 25 MB bucket, buffers broadcast) and the counting hook."""
    ddp_model = ddp.AuditedDDP(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        process_group=group,
        **{name: value for name, value in settings.items() if name != "comm_hook"},
    )
    comm_audit = face.CommAudit(
        world_size,
        group,
        settings["comm_hook"],
        settings["find_unused_parameters"],
        settings["static_graph"],
        face.CollectiveClock(device.type),
    )
    ddp_model.comm_audit = comm_audit
    ddp_model.register_comm_hook(comm_audit, counting_allreduce_hook)
    ddp.check_ddp_settings(ddp_model, settings, counting_allreduce_hook)
    return ddp_model, comm_audit


def make_optimizer(parameters, device):
    """The document's AdamW; on GPU one fused kernel updates every parameter (on CPU a step is ~1 ms of 850)."""
    lr, decay = experiment.DOCUMENTED["learning_rate"], experiment.DOCUMENTED["weight_decay"]
    return torch.optim.AdamW(parameters, lr=lr, weight_decay=decay, fused=True if device.type == "cuda" else None)


# ----------------------------------------------------------------------------- training and evaluation


def train_epoch(
    ddp_model,
    audit,
    loader,
    plan,
    mode,
    optimizer,
    criterion,
    device,
    autocast,
    progress,
    profiler=None,
    epoch=None,
    session=None,
):
    """One epoch by the window plan from epoch.micro_batch on (a resumed run starts inside it), observed by the
    audit, profiled in part if asked; the session saves or stops at windows' ends. Returns (loss sum, correct,
    count) and the EpochTrace."""
    epoch = epoch or resume.EpochState(0)
    comm_audit, trace = audit.comm_audit, epoch.trace
    audit.begin_epoch(trace)
    ddp_model.train()
    optimizer.zero_grad(set_to_none=True)
    parameters = list(ddp_model.parameters())
    if epoch.totals is None:
        epoch.totals = torch.zeros(3, dtype=torch.float64, device=device)
    totals, images = epoch.totals, 0
    span = profiler.span if profiler else lambda name: nullcontext()
    progress.start("train", len(plan), "micro-batches")
    batches = zip(loaders.batches_from(loader, epoch.micro_batch), plan[epoch.micro_batch :], strict=True)
    for index, ((inputs, targets), micro_step) in enumerate(batches, start=epoch.micro_batch):
        inputs, targets = to_device(inputs, device), targets.to(device, non_blocking=True)
        # The forward belongs inside no_sync too: DDP's forward prepares the reducer for the backward.
        suppress_sync = mode == "no_sync" and not micro_step.sync
        with span(f"{face.MICRO_BATCH_LABEL}{index}"):
            with ddp_model.no_sync() if suppress_sync else nullcontext():
                # The first micro-batch of each epoch is measured: every full micro-batch holds the same.
                with face.saved_activations(ddp_model.module) if index == 0 else nullcontext() as held:
                    with autocast():
                        logits = ddp_model(inputs)
                        raw_loss = criterion(logits, targets)
                (raw_loss / micro_step.loss_divisor).backward()
            if index == 0:
                trace.saved_activation_bytes = held.activation_bytes
            if micro_step.step:
                before = face.before_step(parameters)
                optimizer.step()
                with span(face.RANK_AGREEMENT_LABEL):
                    stop = session is not None and session.stop_requested
                    trace.agreement.append(face.ranks_agree(before, parameters, comm_audit.group, stop))
                optimizer.zero_grad(set_to_none=True)
        if profiler:
            profiler.after_micro_batch(index)
        add_to_totals(totals, raw_loss, logits, targets)
        images += targets.size(0)
        progress.update(index + 1, images)
        epoch.micro_batch = index + 1
        if micro_step.step and session is not None:
            session.window_end(epoch, len(trace.step_positions), last=index + 1 == len(plan))
    return totals, trace


def add_to_totals(totals, raw_loss, logits, targets):
    """(loss sum, correct, count) in place on the device: no host synchronization per micro-batch on GPU (read once
    per epoch). What counts: each image, or each target token (the text task's padding and boundaries count for
    nothing)."""
    counted = targets.ne(experiment.IGNORE_INDEX).sum()
    totals[0] += raw_loss.detach().double() * counted
    totals[1] += logits.detach().argmax(dim=-1).eq(targets).sum()
    totals[2] += counted


@torch.no_grad()
def evaluate(ddp_model, loader, criterion, device, autocast, progress, label, group=None):
    """Loss, accuracy and confusion matrix (rows true, columns predicted), summed over ranks. Through the DDP
    wrapper: its first forward broadcasts rank 0's BatchNorm buffers, so every rank evaluates model.pt's model."""
    ddp_model.eval()
    if not ddp_model.broadcast_buffers:  # each rank kept its own BatchNorm statistics: evaluate rank 0's
        ddp_model.broadcast_rank_0_buffers()
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    confusion = torch.zeros(len(CLASSES), len(CLASSES), dtype=torch.int64, device=device)
    classes = torch.arange(len(CLASSES), device=device)
    progress.start(label, len(loader), "batches")
    images = 0
    for done, (inputs, targets) in enumerate(loader, start=1):
        inputs, targets = to_device(inputs, device), targets.to(device, non_blocking=True)
        with autocast():
            logits = ddp_model(inputs)
            loss = criterion(logits, targets)
        predictions = logits.argmax(dim=1)
        totals[0] += loss.double() * targets.size(0)
        totals[1] += targets.size(0)
        # bincount would read its input's range on the host (a sync per batch on GPU); one-hot rows do not.
        confusion += ((targets[:, None, None] == classes[:, None]) & (predictions[:, None, None] == classes)).sum(0)
        images += targets.size(0)
        progress.update(done, images)
    dist.all_reduce(totals, group=group)
    dist.all_reduce(confusion, group=group)
    count = totals[1].item()
    return totals[0].item() / count, confusion.diagonal().sum().item() / count, confusion.cpu()


def to_device(inputs, device):
    """Images in the CNN's channels_last layout; the text task's rows of bytes as they are."""
    layout = MEMORY_FORMAT if inputs.dim() == 4 else torch.preserve_format
    return inputs.to(device, non_blocking=True, memory_format=layout)


# ----------------------------------------------------------------------------- one run


@dataclass
class Training:
    """What a run trains with: its window plan, the model and its DDP (or FSDP) wrapper, the loss, the optimizer
    and its schedule, the audit on them, the precision's autocast, and the profiler if asked."""

    plan: list
    model: nn.Module
    ddp_model: Wrapper  # DDP's AuditedDDP or FSDP2's ShardedModel
    criterion: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    audit: face.Audit  # the checklist's witnesses and the collectives' counts
    autocast: partial
    profiler: face.WindowProfiler | None  # over --profile-windows K windows of epoch 1


def make_training(options, place, setup, config):
    """The plan, then the model (its seeded weights), its wrapper, the loss and the optimizer, in that order; the
    configuration gains what they decided. The task (setup.task) decides the plan's divisors, model and loss."""
    plan = experiment.window_plan(len(setup.loaders.train), options.accum_steps, options.partial_window)
    plan = setup.task.window_plan(plan, options, config)
    registry.check_window_plan(setup.task, plan, config)  # a task of your own: verify.py holds it to the lab's

    model = setup.task.build_model(options).to(setup.device, memory_format=MEMORY_FORMAT)
    if options.strategy == "fsdp":  # FSDP2's shards in place of DDP's replicas (ddp_no_sync_lab/strategies/fsdp.py)
        ddp_model, comm_audit = wrap_sharded(model, setup.device, place.world_size, setup.group, config)
    else:
        settings = experiment.ddp_settings(config)
        ddp_model, comm_audit = wrap_model(model, setup.device, place.world_size, setup.group, settings)
    criterion = setup.task.criterion()
    optimizer = make_optimizer(ddp_model.parameters(), setup.device)
    made = optimizer.param_groups[0]  # with the augmentation: what strict verify holds to the document's
    config.update(learning_rate=made["lr"], weight_decay=made["weight_decay"])
    config.update(setup.task.run_config(options))  # the image task's augmentation, the text task's normalization
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=options.epochs)
    audit = face.attach(ddp_model, optimizer, criterion, comm_audit, setup.device)
    autocast = partial(setup.precision.autocast, setup.device.type)
    profiler = None
    if options.profile_windows:
        profiler = face.WindowProfiler(
            options.profile_windows, options.accum_steps, len(plan), setup.device, comm_audit
        )
    return Training(plan, model, ddp_model, criterion, optimizer, scheduler, audit, autocast, profiler)


def evaluation(options, setup, training, progress):
    """The task's evaluation of held-out data through the wrapper (the document's: evaluate above), given the loader
    and its progress label."""
    return partial(
        setup.task.evaluate or evaluate,
        training.ddp_model,
        criterion=training.criterion,
        device=setup.device,
        autocast=training.autocast,
        progress=progress,
        group=setup.group,
    )


def run(options, place):
    setup = launch.start_up(options, place)
    config = records.run_config(options, place, setup)
    training = make_training(options, place, setup, config)
    is_writer = place.rank == 0
    progress = Progress(enabled=is_writer and not options.quiet, interval=options.progress_every)
    evaluate_on = evaluation(options, setup, training, progress)
    session = open_run(options, place, setup, training, config)
    if session is None:  # a restart after this job's run was published (a teardown that hung)
        return
    epoch = session.restore() if session.resumption.state else resume.EpochState(1)

    while epoch.number <= options.epochs:
        profiled = training.profiler if epoch.number == 1 and epoch.micro_batch == 0 else None
        row = train_and_validate(options, place, setup, training, epoch, session, profiled, progress, evaluate_on)
        session.history.append(row)
        if is_writer:
            print(json.dumps(row), flush=True)
            session.folder.write(files.HISTORY_FILE, files.json_bytes(session.history))  # a killed run keeps it
        if profiled:
            profiled.write(session.folder, place, options.profile_windows)
        epoch = resume.EpochState(epoch.number + 1)
        session.epoch_end(epoch)  # saves the state; stops here if a rank was asked to

    progress.prefix = ""
    test = evaluate_on(setup.loaders.test, label="test")
    weights = training.ddp_model.full_state_dict()  # on every rank: FSDP gathers its shards
    if is_writer:
        publish(options, place, setup, config, training, session, test, weights)
    face.settle_comm_hooks()


def open_run(options, place, setup, training, config):
    """The run to train, agreed by every rank: the saved one resumed, or a new one; its folder begun (rank 0) and
    its session. None where this job's run is already published."""
    stop = resume.StopRequest()  # SIGTERM from here on: a stop at a window's end, its state saved
    resumption = resume.find_resumption(options, place, config)  # a saved state to resume from, or none
    if resumption.finished_run_id:
        return None
    run_id, started_at = resumption.run_id or files.new_run_id(), files.utc_now()
    folder = files.RunFolder(options.output, run_id, started_at)
    if place.rank == 0:
        folder.begin(resuming=resumption.state is not None)
    return resume.Session(resumption, place, setup, training, stop, folder, [], options.checkpoint_every_windows)


def publish(options, place, setup, config, training, session, test, weights):
    """Rank 0: the task's report and checkpoint, then the run folder published whole with its record: the torchrun
    job that made it (a restart reads it) and the hardware of each segment of the run."""
    folder = session.folder
    report, run_record = setup.task.write_results(
        folder, options, config, setup, training.model, test, weights, folder.run_id, folder.started_at
    )
    folder.publish({**run_record, "launch_id": place.job, "segments": session.resumption.segments})
    print(json.dumps({key: value for key, value in report.items() if key != "config"}), flush=True)


def train_and_validate(options, place, setup, training, epoch, session, profiled, progress, evaluate_on):
    """One epoch's training (from where a resumed one stopped) and validation; its history row."""
    device, ddp_model, comm_audit = setup.device, training.ddp_model, training.audit.comm_audit
    setup.split.train_sampler.set_epoch(epoch.number - 1)
    progress.prefix = f"epoch {epoch.number}/{options.epochs} "
    epoch.audit_before = epoch.audit_before or comm_audit.totals()  # a resumed epoch keeps its own
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    epoch.segment_started = face.read_clock(device)
    plan = setup.task.epoch_plan(training.plan, setup.split, options, place, epoch.number - 1)
    with profiled or nullcontext(), ddp.ddp_errors_explained():
        train_epoch(
            ddp_model,
            training.audit,
            setup.loaders.train,
            plan,
            options.mode,
            training.optimizer,
            training.criterion,
            device,
            training.autocast,
            progress,
            profiled,
            epoch,
            session,
        )
    validation_started = face.read_clock(device)
    peak_bytes = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    validation = evaluate_on(setup.loaders.validation, label="validation")
    train_seconds = epoch.train_seconds + validation_started - epoch.segment_started
    phase_seconds = (train_seconds, face.read_clock(device) - validation_started)
    epoch.trace.sample_shards = face.shard_coverage(setup.split.train_sampler, setup.split.sizes["train"])
    epoch.trace.checklist_summary = training.audit.end_epoch()
    training.scheduler.step()
    return records.epoch_row(
        epoch,
        options.mode,
        validation[:2],
        comm_audit,
        phase_seconds,
        peak_bytes,
        session.folder.run_id,
        device,
        setup.group,
    )


def parse_or_error(argv=None):
    """The options, or the usage error that every node must learn of before it stops them all."""
    try:
        return parse_args(argv), None
    except LabError as error:
        return None, error


def start(options, usage_error, place):
    """The options parsed, and the world of the expected size, on every node; then the run."""
    launch.agree(
        place, lambda: launch.raise_if(usage_error) or launch.check_world_size(place, options.expected_world_size)
    )
    run(options, place)


@record
def main():
    options, usage_error = parse_or_error()
    try:
        place = launch.launch_environment(options.expected_world_size if options else None)
    except LabError as error:
        exit_with(usage_error or error, SCRIPT, show=os.environ.get("LOCAL_RANK", "0") == "0")
    try:
        place = launch.init_process_group(place)
        try:
            start(options, usage_error, place)
        finally:
            with launch.bounded_teardown(place):
                dist.destroy_process_group()
    except LabError as error:
        # Every rank stops on it together (see launch.agree); one line per node, from its first process. At once:
        # the interpreter's finalization after the groups closed aborted a rank under load (exit -6, not 2; once).
        exit_with(error, SCRIPT, show=place.local_rank == 0, at_once=True)


if __name__ == "__main__":
    main()
