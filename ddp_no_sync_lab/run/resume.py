"""A stopped run resumed where it stopped, bit for bit, with its audit intact.

    train.py ... --resume                        continue the unfinished run in --output, or start it
    train.py ... --checkpoint-every-windows N    save also every N windows inside an epoch
    torchrun --max-restarts=3 ... train.py ...   restarted workers resume by themselves

The state is saved at every epoch's end (and, with --checkpoint-every-windows N, at every Nth window's end,
never inside a window, where gradients are half accumulated; the epoch's last window saves at the epoch's
end, after its validation): the model, the optimizer and the scheduler; every rank's BatchNorm buffers, random
states (Python, torch, CUDA, the tensor loader's generator), the audit's running totals and the epoch's
progress so far; the history so far; the hardware of each segment of the run. Rank 0 gathers it into the run's
partial folder as save number N: resume_state-N.pt written atomically, then resume_state-N.json with its
size and SHA-256, then the earlier saves removed. A kill at any instant leaves at least one complete save; the
newest whose record landed wins, and a state without its record is never read. A resumed run takes the same
run id and partial folder, refuses another configuration (the mode, code, versions, data and precision
included) with one line, and marks in its history where it resumed; verify.py expects what the restart costs
(a new DDP wrapper broadcasts the buffers before its first forward and rebuilds its buckets once).

On SIGTERM (a scheduler's preemption) the ranks agree to stop at a window's end (on CPU the next one; on GPUs,
where reading the agreement each window would stall the device, the next save: the epoch's end, or the next
of --checkpoint-every-windows), the state is saved, and every rank exits with PREEMPTED_EXIT_CODE and one
line. A second SIGTERM exits at once, leaving the last complete state.
"""

import copy
import io
import json
import os
import random
import re
import signal
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ddp_no_sync_lab import files
from ddp_no_sync_lab.audit.instruments import STOP_REQUESTED, EpochTrace
from ddp_no_sync_lab.cli import LabError
from ddp_no_sync_lab.options import TrainOptions
from ddp_no_sync_lab.run.launch import Place, Setup, agree

STATE_FILE = "resume_state-{number:06d}.pt"  # save number N
STATE_RECORD = "resume_state-{number:06d}.json"  # written after its state: its size, SHA-256 and position
SAVED_NAME = re.compile(r"resume_state-([0-9]+)\.(pt|json)")
PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: stopped on request; run again with --resume
RESTART_VARIABLE = "TORCHELASTIC_RESTART_COUNT"  # torchrun's count of its restarts of the worker group
UNCHECKED_CONFIG = {"hardware"}  # what a resumed run may change: the machines it runs on
# A scheduler signals every process of a job step and torchrun forwards its own SIGTERM: a worker can get two
# within milliseconds for one request. Only a SIGTERM this long after the first means "exit at once".
REPEATED_SIGTERM_SECONDS = 5


class Preempted(LabError):
    """The run stopped on SIGTERM after saving its state: one line, and an exit code of its own."""

    exit_code = PREEMPTED_EXIT_CODE

    def line(self, script):
        return f"{script}: {self}"


@dataclass
class EpochState:
    """One rank's epoch in progress: what train_epoch accumulates, and what a save inside the epoch keeps."""

    number: int
    micro_batch: int = 0  # the next micro-batch to run
    totals: torch.Tensor = None  # this rank's loss sum, correct, count (float64, on the device)
    trace: EpochTrace = field(default_factory=EpochTrace)
    audit_before: dict = field(default_factory=dict)  # the audit's totals at the epoch's start
    train_seconds: float = 0.0  # training time spent in this epoch by earlier starts of the run
    segment_started: float = None  # when this start of the run began the epoch's training (perf_counter)
    resumed_at: list = field(default_factory=list)  # micro-batches where this epoch's training resumed


def differences(saved, ours):
    """What differs between two configurations (the mode in them), as JSON holds them, but the hardware."""
    ours = json.loads(files.json_bytes(ours))
    keys = sorted((set(saved) | set(ours)) - UNCHECKED_CONFIG)
    return [f"{key} {saved.get(key)!r} vs {ours.get(key)!r}" for key in keys if saved.get(key) != ours.get(key)]


def finished_run(output, identity, job=None):
    """The run id of the run published in `output` with this configuration and mode (`identity`), by this
    torchrun job when `job` is given (run.json's launch_id), or None: a restart or --resume that finds the run
    done has nothing left to do (the job failed after the publish, e.g. in its teardown)."""
    path = output / files.RUN_RECORD_FILE
    if not path.is_file():
        return None
    record = files.read_json(path)
    same = not differences({**record["config"], "mode": record.get("mode")}, identity)
    return record.get("run_id") if same and job in (None, record.get("launch_id")) else None


def saves(folder):
    """The numbers of the saves whose record landed in `folder`, oldest first."""
    return sorted(
        int(match[1]) for path in folder.iterdir() if (match := SAVED_NAME.fullmatch(path.name)) and match[2] == "json"
    )


def unfinished_with_state(output):
    """The newest unfinished run beside `output` holding a complete saved state, or None."""
    numbers = {folder: saves(folder) for folder in files.unfinished_runs(output)}
    records_landed = {
        folder: folder / STATE_RECORD.format(number=found[-1]) for folder, found in numbers.items() if found
    }
    return max(records_landed, key=lambda folder: records_landed[folder].stat().st_mtime, default=None)


def read_state(folder):
    """An unfinished run's newest complete save and its number, checked against its record: one line if it was
    cut short or altered after its record landed."""
    number = saves(folder)[-1]
    record_path, state_path = folder / STATE_RECORD.format(number=number), folder / STATE_FILE.format(number=number)
    record = files.read_json(record_path)
    entry = record.get("state") if isinstance(record, dict) else None
    if not isinstance(entry, dict) or not state_path.is_file():
        raise LabError(f"{record_path} names no saved state beside it: remove {folder}, or start anew without --resume")
    if state_path.stat().st_size != entry.get("bytes") or files.sha256_file(state_path) != entry.get("sha256"):
        raise LabError(
            f"{state_path} is not the state {record_path} recorded (its size or SHA-256 differs: cut short or "
            f"altered): remove {folder}, or start anew without --resume"
        )
    return torch.load(state_path, map_location="cpu", weights_only=False), number


def rng_states(device):
    states = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def set_rng_states(states, device):
    random.setstate(states["python"])
    torch.set_rng_state(states["torch"])
    if device.type == "cuda":
        torch.cuda.set_rng_state(states["cuda"], device)


def to_cpu(value):
    """A nested value with every tensor on the CPU: what travels between the ranks and into the file."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {key: to_cpu(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_cpu(item) for item in value)
    return value


def portable(epoch):
    """A copy of an EpochState that can be saved: its tensors on the CPU, its training time so far."""
    saved = copy.copy(epoch)
    if epoch.segment_started is not None:
        saved.train_seconds = epoch.train_seconds + time.perf_counter() - epoch.segment_started
        saved.segment_started = None
    saved.trace = copy.copy(epoch.trace)
    saved.trace.agreement = [to_cpu(verdict) for verdict in epoch.trace.agreement]
    saved.trace.checklist = epoch.trace.checklist.to("cpu")
    saved.totals = to_cpu(epoch.totals)
    return saved


class StopRequest:
    """SIGTERM turned into a request to stop at a window's end (Session reads it); a second SIGTERM, a while
    after the first, exits at once."""

    def __init__(self):
        self.requested = False
        self.first_sigterm = None
        signal.signal(signal.SIGTERM, self.on_sigterm)

    def on_sigterm(self, signum, frame):
        now = time.monotonic()
        if self.first_sigterm is None:
            self.first_sigterm = now
            self.requested = True
        elif now - self.first_sigterm > REPEATED_SIGTERM_SECONDS:  # a second request: at once
            os._exit(128 + signum)


@dataclass
class Resumption:
    """What every rank agreed to go on from (find_resumption): a saved state, a run already finished, or neither."""

    identity: dict  # what a resumed run must share with the saved one: the run's configuration and its mode
    state: dict | None  # the saved state to resume from
    finished_run_id: str | None  # this job's run, published before a restart: nothing left to do
    save_number: int  # the save resumed from: the next save is the next number
    segments: list  # the hardware of each segment of the run, this one's last

    @property
    def run_id(self):
        return self.state["run_id"] if self.state else None


def restarted(place):
    """A restart if any rank says so: the agents' counts need not agree (one restarted by another node's failure
    does not count it), and a rank's start number counts every start in this job."""
    flag = torch.tensor([int(os.environ.get(RESTART_VARIABLE, "0")) > 0 or place.start > 1])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # the default group (gloo): a CPU tensor
    return bool(flag.item())


def saved_state(options, place, identity, is_restart):
    """Rank 0's to find and check: (a saved state, its number), this job's finished run id, or nothing; a refusal
    stops every rank together (launch.agree)."""
    if place.rank != 0:
        return None
    published = files.publish_interrupted(options.output)  # a complete run is never lost or retrained
    if published:
        print(
            f"train.py: run {published['run_id']} was complete but not yet in place; published it into "
            f"{options.output}",
            file=sys.stderr,
        )
    if not (options.resume or is_restart):
        return None
    folder = unfinished_with_state(options.output)
    if folder is None:
        job = None if published or options.resume else place.job  # a restart: only this job's own run
        return finished_run(options.output, identity, job)
    state, number = read_state(folder)
    differ = differences(state["config"], identity)
    if differ:
        raise LabError(
            f"--resume: the unfinished run in {folder} was started with another configuration "
            f"({'; '.join(differ)}): start it again with the same options, code and data, or start "
            f"anew without --resume"
        )
    return state, number


def find_resumption(options: TrainOptions, place: Place, config: dict) -> Resumption:
    """Whether this run resumes and from what, the same on every rank (rank 0 reads, every rank receives)."""
    identity = {**config, "mode": options.mode}
    is_restart = restarted(place)
    holder = [agree(place, lambda: saved_state(options, place, identity, is_restart))]
    dist.broadcast_object_list(holder, src=0)  # every rank resumes, or none does
    found = holder[0]
    state, save_number = found if isinstance(found, tuple) else (None, 0)
    where = state["epochs"][place.rank] if state else EpochState(1)
    # The hardware of each segment of the run: bit-identity across a change of hardware is not promised.
    segment = {"hardware": config["hardware"], "epoch": where.number, "micro_batch": where.micro_batch}
    resumption = Resumption(
        identity=identity,
        state=state,
        finished_run_id=found if isinstance(found, str) else None,
        save_number=save_number,
        segments=(state["segments"] if state else []) + [segment],
    )
    if resumption.finished_run_id and place.local_rank == 0:
        print(f"train.py: run {resumption.finished_run_id} is finished; nothing left to do", file=sys.stderr)
    if state and place.local_rank == 0:
        print(
            f"train.py: resuming run {state['run_id']} at epoch {where.number}, micro-batch "
            f"{where.micro_batch}, from its saved state",
            file=sys.stderr,
            flush=True,
        )
    return resumption


@dataclass
class Session:
    """One run's saves, made once everything a save reads exists: the state restored, saved at windows' and
    epochs' ends, and the run stopped there when a rank was asked to (StopRequest)."""

    resumption: Resumption
    place: Place
    setup: Setup  # the device and the training loader (its generator's state is saved)
    training: object  # train.py's Training: the DDP model, optimizer, scheduler and the audit's running totals
    stop: StopRequest
    folder: files.RunFolder  # rank 0 writes the saves into its partial folder
    history: list  # the rows the run appends to
    every_windows: int | None  # --checkpoint-every-windows

    @property
    def stop_requested(self):
        return self.stop.requested

    @property
    def device(self):
        return self.setup.device

    @property
    def models(self):
        return self.training.ddp_model, self.training.optimizer, self.training.scheduler

    @property
    def comm_audit(self):
        return self.training.audit.comm_audit

    @property
    def train_loader(self):
        return self.setup.loaders.train

    def restore(self):
        """Put back everything the saved state holds, on this rank: after the DDP wrapper is made (its wrap-time
        broadcast would overwrite the other ranks' BatchNorm buffers), before any training. Fills the history so
        far and returns the epoch to go on with."""
        state, rank = self.resumption.state, self.place.rank
        ddp_model, optimizer, scheduler = self.models
        ddp_model.module.load_state_dict(state["model"])
        with torch.no_grad():
            for name, buffer in ddp_model.module.named_buffers():
                buffer.copy_(state["buffers"][rank][name])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        audit_totals = dict(state["audit"][rank])
        self.comm_audit.clock.seconds = audit_totals.pop("comm_seconds")
        for name, value in audit_totals.items():
            setattr(self.comm_audit, name, value)
        generator = getattr(self.train_loader, "generator", None)
        if generator is not None:
            generator.set_state(state["loader_generator"][rank])
        set_rng_states(state["rng"][rank], self.device)
        epoch = state["epochs"][rank]
        epoch.resumed_at.append(epoch.micro_batch)
        if epoch.totals is not None:
            epoch.totals = epoch.totals.to(self.device)
            epoch.trace.agreement = [verdict.to(self.device) for verdict in epoch.trace.agreement]
        epoch.trace.checklist = epoch.trace.checklist.to(self.device)
        self.history[:] = state["history"]
        return epoch

    def window_end(self, epoch, window, last):
        """At the end of the epoch's `window`th window (1-based): save when --checkpoint-every-windows says so,
        and stop when a rank asked (the step's agreement carried the request). Raises Preempted to stop. The
        epoch's `last` window leaves both to the epoch's end, a validation later (a state saved there would
        resume into the validation, with a DDP wrapper whose first forward is not a training one)."""
        if last:
            return
        due = bool(self.every_windows) and window % self.every_windows == 0
        readable = due or self.device.type == "cpu"  # on GPUs a read here would stall the device
        stop = readable and bool(epoch.trace.agreement[-1][STOP_REQUESTED])
        if due or stop:
            self.save(epoch)
        if stop:
            raise Preempted(
                f"preempted at epoch {epoch.number}, window {window}: its state is saved; resume with --resume"
            )

    def epoch_end(self, next_epoch):
        """After an epoch's row, with the next epoch not begun: save, and stop there if a rank was asked to."""
        self.save(next_epoch)
        stop = torch.tensor([int(self.stop_requested)])
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)  # the default group (gloo): a CPU tensor
        if stop.item():
            raise Preempted(f"preempted after epoch {next_epoch.number - 1}: its state is saved; resume with --resume")

    def save(self, epoch):
        """Gather every rank's part to rank 0, which writes it (write); every rank waits until it is written."""
        started = time.perf_counter()
        ddp_model, optimizer, scheduler = self.models
        generator = getattr(self.train_loader, "generator", None)
        mine = {
            "buffers": to_cpu(dict(ddp_model.module.named_buffers())),
            "audit": self.comm_audit.totals(),
            "loader_generator": generator.get_state() if generator is not None else None,
            "rng": rng_states(self.device),
            "epochs": portable(epoch),
        }
        gathered = [None] * self.place.world_size
        dist.all_gather_object(gathered, to_cpu(mine))
        if self.place.rank == 0:
            self.write(gathered, epoch, started)
        dist.barrier()  # no rank stops (a preemption) before the save is written, lest a kill cut rank 0's write

    def write(self, gathered, epoch, started):
        """Rank 0: the gathered parts into save number N, then N's record (with the save's bytes and seconds: what
        resuming costs), then the older saves go."""
        ddp_model, optimizer, scheduler = self.models
        state = {
            "run_id": self.folder.run_id,
            "config": self.resumption.identity,
            "segments": self.resumption.segments,
            "history": self.history,
            "model": to_cpu(ddp_model.module.state_dict()),
            "optimizer": to_cpu(optimizer.state_dict()),
            "scheduler": scheduler.state_dict(),
            **{key: [part[key] for part in gathered] for key in gathered[0]},
        }
        buffer = io.BytesIO()
        torch.save(state, buffer)
        self.resumption.save_number += 1
        number = self.resumption.save_number
        state_name, record_name = (name.format(number=number) for name in (STATE_FILE, STATE_RECORD))
        self.folder.write(state_name, buffer.getvalue())
        entry = {"bytes": buffer.tell(), "sha256": files.sha256_file(self.folder.partial / state_name)}
        where = {"epoch": epoch.number, "micro_batch": epoch.micro_batch, "saved_at": files.utc_now()}
        where["seconds"] = time.perf_counter() - started
        self.folder.write(record_name, files.json_bytes({"state": entry, **where}))
        # This save is complete: the earlier ones, and a killed save's state without its record, go.
        for path in self.folder.partial.iterdir():
            if SAVED_NAME.fullmatch(path.name) and path.name not in (state_name, record_name):
                path.unlink()


def moved_hardware(record, path):
    """verify.py's note when the run's segments (run.json at `path`) ran on different hardware, else None."""
    segments = record.get("segments", [])
    files.check(
        isinstance(segments, list)
        and all(
            isinstance(segment, dict)
            and isinstance(segment.get("hardware"), list)
            and all(isinstance(name, str) for name in segment["hardware"])
            and files.is_int(segment.get("epoch"))
            and files.is_int(segment.get("micro_batch"))
            for segment in segments
        ),
        path,
        f"segments must be a list of {{hardware, epoch, micro_batch}}, got {segments!r}",
    )
    if len({tuple(segment["hardware"]) for segment in segments}) < 2:
        return None
    parts = [f"from epoch {s['epoch']}, micro-batch {s['micro_batch']}: {', '.join(s['hardware'])}" for s in segments]
    return (
        f"run {record['run_id']} resumed on other hardware ({'; '.join(parts)}): it is the same computation, but "
        f"bit-identity with an uninterrupted run is not promised across hardware"
    )


def wrapper_starts(path, history, micro_batches):
    """Where the run's DDP wrappers started, (epoch, micro-batch) in order: the run's own at (1, 0), then each
    resume the rows record (resumed_at): a restart's communication is expected from them."""
    starts = [(1, 0)]
    for number, row in enumerate(history, start=1):
        resumed = row.get("resumed_at")
        files.check(
            isinstance(resumed, list) and all(files.is_int(index) and 0 <= index < micro_batches for index in resumed),
            path,
            f"epoch row {number}: resumed_at must be a list of micro-batch indices, got {resumed!r}",
        )
        starts += [(number, index) for index in resumed]
    return starts
