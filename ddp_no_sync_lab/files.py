"""The run folder's files: their names, each written all or nothing, the folder published whole (run.json last,
with every file's checksum) and claimed by one run at a time; and read back, with an AuditError that names the
file, for verify.py and the tasks' checks."""

import fcntl
import hashlib
import io
import json
import math
import os
import re
import shutil
import socket
from datetime import datetime, timezone
from pathlib import Path

import torch
from PIL import Image, PngImagePlugin

from ddp_no_sync_lab.cli import LabError
from ddp_no_sync_lab.options import TrainOptions

# Artifact names inside one run folder (artifacts/every, artifacts/no_sync).
MODEL_FILE = "model.pt"


HISTORY_FILE = "history.json"


REPORT_FILE = "report.json"


SAMPLE_FILE = "sample_test.png"


CONFUSION_FILE = "confusion_matrix.png"


RUN_RECORD_FILE = "run.json"  # written last: the run's id, configuration and the checksum of every other file


RUN_FILES = (MODEL_FILE, HISTORY_FILE, REPORT_FILE, SAMPLE_FILE, CONFUSION_FILE)


TASK_RUN_FILES = (MODEL_FILE, HISTORY_FILE, REPORT_FILE)  # every task's; only the document's draws the two pictures


# Written by train.py --profile-windows K: the profiled windows' summary (every rank) and rank 0's trace.
PROFILE_FILE = "profile.json"


PROFILE_TRACE_FILE = "profile_trace.rank{rank}.json"  # one Chrome trace per rank, as HolisticTraceAnalysis reads them


def profile_trace_files(world_size):
    return [PROFILE_TRACE_FILE.format(rank=rank) for rank in range(world_size)]


def new_run_id():
    return datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ-") + os.urandom(3).hex()


def utc_now():
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


TEMPORARY_MARK = ".tmp-"  # in the name of write_atomic's temporary file: `.model.pt.tmp-<host>-<pid>-<chance>`


def write_atomic(path, data):
    """Write bytes to path so that a reader sees the old file or the whole new one, never a part."""
    path = Path(path)
    # Unique across the nodes that may share the folder: host, pid (equal in containers) and chance.
    temporary = path.with_name(
        f".{path.name}{TEMPORARY_MARK}{socket.gethostname()}-{os.getpid()}-{os.urandom(4).hex()}"
    )
    try:
        with open(temporary, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)  # a full disk or an interrupt leaves nothing half-written behind
        raise
    folder = os.open(path.parent, os.O_RDONLY)  # the rename made durable before anything that relies on it
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def json_bytes(value):
    return (json.dumps(value, indent=2) + "\n").encode("utf-8")


def png_bytes(image, text):
    """PNG bytes with text chunks (run_id, plotted data) that verify.py and the tests read back."""
    info = PngImagePlugin.PngInfo()
    for key, value in text.items():
        info.add_text(key, value)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", pnginfo=info)
    return buffer.getvalue()


def png_text(path):
    with Image.open(path) as image:
        image.load()
        return dict(image.text)


def torch_bytes(value):
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def sha256_file(path):
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def unfinished_runs(output):
    """Hidden folders of runs into `output` that started and never finished (killed, crashed)."""
    output = Path(output)
    return sorted(output.parent.glob(f".{output.name}.partial-*"))


def replaced_runs(output):
    """Hidden folders of runs that a newer run replaced, left when publishing was interrupted."""
    output = Path(output)
    return sorted(output.parent.glob(f".{output.name}.replaced-*"))


PROFILE_TRACE_NAME = re.compile(re.escape(PROFILE_TRACE_FILE).replace(re.escape("{rank}"), "[0-9]+"))


def is_artifact(name):
    """A file a published run holds (a run folder also holds, while unfinished, its saved state and, after a
    kill, temporary files: neither is ever published)."""
    return name in {*RUN_FILES, RUN_RECORD_FILE, PROFILE_FILE} or bool(PROFILE_TRACE_NAME.fullmatch(name))


def is_replaceable_output(output):
    """A folder train.py may replace: absent, empty, or holding nothing but lab artifacts."""
    output = Path(output)
    if not output.exists():
        return True
    if not output.is_dir():
        return False
    return all(is_artifact(entry.name) for entry in output.iterdir())


def claim_output(output):
    """Hold the output's lock for as long as this process lives (the returned handle): one run at a time writes
    into an output, so a second run into it stops at once, naming the first, and the partial folders a new run
    finds beside the output are provably those of dead runs. The lock file records its holder."""
    output = Path(output)
    handle = open(output.parent / f".{output.name}.lock", "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise LabError(
            f"--output {output} is being written by a run that is still going ({holder}); wait for it to finish, "
            f"or pass another --output"
        ) from None
    handle.truncate(0)
    handle.write(f"train.py, pid {os.getpid()} on {socket.gethostname()}, since {utc_now()}\n")
    handle.flush()
    return handle


class RunFolder:
    """The artifacts of one run, written into a hidden sibling folder and moved into place when complete.

    While a run is going, `.every.partial-<run id>/` beside `every/` holds what it has written so far. Publishing
    writes run.json there (the size and SHA-256 of every artifact; from then on the run is complete), removes
    the rest (saved state, temporaries) and renames: the old folder aside as `.every.replaced-<new run id>`, the
    new one into place, the old one removed. A reader finds one complete run, never a mix. The next run into the output (holding its lock, claim_output, so nothing it finds is alive)
    first finishes a publish a crash interrupted (publish_interrupted: a complete run is never lost or trained
    again), then removes what dead runs left. verify.py names each such leftover.
    """

    def __init__(self, output, run_id, started_at):
        self.output = Path(output)
        self.run_id, self.started_at = run_id, started_at  # the run's, and this start's UTC time (its record's)
        self.partial = self.output.parent / f".{self.output.name}.partial-{run_id}"

    def begin(self, resuming=False):
        """Remove what dead runs left beside the output (the claim guarantees they are dead; a complete one was
        published before, publish_interrupted), and make this run's partial folder; a resumed run keeps its own,
        with what it wrote before, less a killed write's temporaries."""
        for stale in unfinished_runs(self.output) + replaced_runs(self.output):
            if not (resuming and stale == self.partial):
                shutil.rmtree(stale)
        self.partial.mkdir(parents=True, exist_ok=resuming)
        for temporary in self.partial.glob(f".*{TEMPORARY_MARK}*"):
            temporary.unlink()

    def write(self, name, data):
        write_atomic(self.partial / name, data)

    def publish(self, record):
        files = {
            path.name: {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
            for path in sorted(self.partial.iterdir())
            if is_artifact(path.name)
        }
        self.write(RUN_RECORD_FILE, json_bytes({**record, "files": files}))  # from here on the run is complete
        move_into_place(self.partial, self.output)


def move_into_place(partial, output):
    """A complete run's partial folder made the output: non-artifacts out, the old output aside, then removed."""
    for path in partial.iterdir():
        if not is_artifact(path.name):
            path.unlink()
    if output.exists():
        os.rename(output, output.parent / f".{output.name}.replaced-{partial.name.rsplit('.partial-', 1)[-1]}")
    os.rename(partial, output)
    for replaced in replaced_runs(output):
        shutil.rmtree(replaced)


def publish_interrupted(output):
    """Finish the publish of a complete run (its partial folder holds run.json) that a kill interrupted, before
    anything else into `output` (the caller holds its claim). Returns that run's record, or None."""
    output = Path(output)
    complete = [partial for partial in unfinished_runs(output) if (partial / RUN_RECORD_FILE).is_file()]
    if not complete:
        return None
    newest = max(complete, key=lambda partial: (partial / RUN_RECORD_FILE).stat().st_mtime)
    move_into_place(newest, output)
    return read_json(output / RUN_RECORD_FILE)


def run_record(options: TrainOptions, config: dict, run_id: str, started_at: str, data_dir: str) -> dict:
    """run.json's content, published last (RunFolder.publish): it makes the folder's other files the run."""
    return {
        "run_id": run_id,
        "mode": options.mode,
        "config": config,
        "data_dir": data_dir,
        "started_at": started_at,
        "finished_at": utc_now(),
    }


class AuditError(LabError):
    """An artifact that does not hold what it must (exit 1; a usage mistake exits 2)."""

    exit_code = 1

    def __init__(self, message, kind="RuntimeError"):
        super().__init__(message, kind)


def require_file(path):
    if not path.is_file():
        raise AuditError(f"Lipsește artefactul obligatoriu: {path}", kind="FileNotFoundError")
    if path.stat().st_size == 0:
        raise AuditError(f"Artefact absent sau gol: {path} (it is empty; rerun train.py)")


def read_json(path):
    require_file(path)
    try:
        return json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise AuditError(
            f"{path}: not valid JSON ({error}); the file is damaged or truncated: rerun train.py"
        ) from None


def is_int(value):
    return type(value) is int


def is_number(value):
    return type(value) in (int, float) and math.isfinite(value)


def check(condition, path, message):
    if not condition:
        raise AuditError(f"{path}: {message}")


def describe_unfinished(folder):
    """Say what an interrupted run left beside `folder`, if anything (RunFolder explains the names)."""
    notes = []
    for partial in unfinished_runs(folder):
        run_id = partial.name.rsplit(".partial-", 1)[-1]
        if (partial / RUN_RECORD_FILE).is_file():
            notes.append(
                f"run {run_id} finished but was interrupted while being moved into place; it lies complete in {partial}"
            )
        else:
            notes.append(f"an unfinished run {run_id} was left in {partial} (interrupted before it finished)")
    for replaced in replaced_runs(folder):
        run_id = replaced.name.rsplit(".replaced-", 1)[-1]
        notes.append(f"the run that run {run_id} replaced was left in {replaced} (interrupted while being removed)")
    return notes
