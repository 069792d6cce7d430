"""Loaded at start-up by the tests' subprocesses (the tests put this folder on PYTHONPATH); it changes
nothing unless a LAB_TEST_* variable asks for it. tests/workers/runs.py also applies one run's own LAB_TEST_*
assignments (inject) and puts them back after it (undo), so that several injected runs share one torchrun start.

LAB_TEST_CIFAR_MD5 (JSON {file name: md5}): torchvision checks the official CIFAR-10 files' md5 sums, and the
  tests write synthetic files in the official pickle format, so the expected sums are replaced by the
  synthetic files' own. All the rest of torchvision's loading runs as it is; tests/test_data.py shows that
  without this replacement torchvision refuses the synthetic files.
LAB_TEST_CIFAR_URL: where torchvision downloads CIFAR-10 from (the tests use a closed local port).
LAB_TEST_RAISE_AT_STEP ("<rank>:<step>"): that rank raises torch.OutOfMemoryError in its <step>th optimizer
  step, as a rank out of memory would.
LAB_TEST_LOSE_GRADIENTS=1: the optimizer finds no gradients (a pipeline that loses them); it updates nothing.
LAB_TEST_FAKE_GPUS ("<node>:<count>"): on that node (torchrun's GROUP_RANK) torch reports <count> visible GPUs,
  as on a node that has them; only the device policy's question is answered, no CUDA call would work.
LAB_TEST_SYNC_DEBUG=1 (gpu_check.sh): torch.cuda.set_sync_debug_mode while DDP is in training mode, that is
  in train.py's training loop: "warn" in the first epoch (where DDP rebuilds its buckets once), "error" from
  the second on, so that a host synchronization in the loop stops the run; off during evaluation.
LAB_TEST_BROKEN_LOOP: train.py runs a broken accumulation loop, to show verify.py rejecting it:
  "sync_first" moves each window's sync to its first micro-batch, "step_inside" moves each optimizer step to
  after the window's first micro-batch (both keep every count of syncs and steps), and
  "backward_only_in_no_sync" enters no_sync() only after the forward, the mistake the document's FAQ warns of.
LAB_TEST_DRIFT_AT_STEP ("<rank>:<step>"): after that rank's <step>th optimizer step one of its weights moves
  by 1e-3 (by one ulp with LAB_TEST_DRIFT=ulp), as a rank that silently stepped on something else: every count
  stays right.
LAB_TEST_NAN_AT_STEP ("<rank>:<step>", rank * for all): a NaN in one gradient just before that step, which the
  step writes into the parameters.
LAB_TEST_SAME_SHARD=1: every rank's DistributedSampler reads rank 0's shard (a sampler set up without the
  rank): the gradients still agree after the all-reduce.
LAB_TEST_SAME_ORDER=1: every DistributedSampler's set_epoch does nothing: each epoch reads the first one's order.
LAB_TEST_HANG_IN_TEARDOWN (a number of seconds): closing the process groups hangs, as gloo's threads can at exit,
  and train.py's watchdog waits that long, not 10 s, before it ends the process (in the job's first start only: a
  restart closes them, within the watchdog's own bound).
LAB_TEST_NODE_TORCH_VERSION ("<node>:<version>"): on that node torch reports another version.
LAB_TEST_CPU_BF16 (0 or 1): LAB_CPU_BF16 set to it, for one run of tests/workers/runs.py as its own process would
  have it (the precision `auto` takes decided as on a CPU with or without BF16 instructions).
LAB_TEST_THREADS (a number): torch.set_num_threads for one run of tests/workers/runs.py: the intra-op threads
  its main thread computes with (the forward, the CPU backward, the optimizer), as OMP_NUM_THREADS would start a
  process with them; threads already running (gloo's) keep theirs, and they only divide and cast.
LAB_TEST_COUNT_DECODES (a file path): each decode of an image-folder tree appends a line to that file.
LAB_TEST_KILL_AT (comma-separated points, the i-th for the job's i-th start: torchrun's
  TORCHELASTIC_RESTART_COUNT; "-" for none): the process that reaches the point ends at once by SIGKILL, as a
  machine lost there, beneath the lab's code: "saved:<n>" after this start's n-th save landed (the replace of
  its record), "saving:<n>" in its n-th save between the state file and its record, "eval:<k>" at the first
  forward of this start's k-th evaluation pass (each epoch's validation, then the test), "publish" at the rename
  of the complete run's folder into place (after the previous output was set aside); "term:<n>" sends rank 0
  a SIGTERM (a scheduler's preemption) at its n-th training forward of this start.
LAB_TEST_CHECKPOINT: --activation-checkpointing done wrong: "reentrant" checkpoints each stage with
  use_reentrant=True (the images need no gradient, so the stages get none); "statistics_twice" recomputes the
  stages without putting their BatchNorm buffers back (their statistics are updated twice per forward).
LAB_TEST_TEXT_CHARACTERS (a number): Python's pydoc_data.topics keeps only the first that many characters of each
  document, a smaller real corpus for the text task's tests (its fingerprint follows; verify.py sees the same).
LAB_TEST_TEXT_NO_CORPUS=1: this Python has no pydoc_data (as some distributions ship it apart).
LAB_TEST_TEXT_OTHER_CORPUS_ON_RANK ("<rank>"): that rank's pydoc_data.topics holds one more document, as another
  Python's would.
LAB_TEST_TEXT_LOSS: the text task's loss done wrong beneath the loop: "padding_in_mean" averages the summed
  token losses over every position of the batch (padding and boundaries counted), "one_token_too_many" over its
  tokens plus one (a count off by one, within BF16's rounding at the logits), "first_target_dropped" has
  the rows reach the loss with each row's first target masked (the packing's counts no longer those trained).
LAB_TEST_FSDP: FSDP2 beneath the lab's code: "uncorrected" makes set_force_sum_reduction_for_comms do nothing (FSDP
  hands gloo ReduceOp.AVG, which torch 2.8's gloo sums); "sync_ignored" makes set_requires_gradient_sync do nothing
  (every backward reduce-scatters, no_sync() or not).
LAB_TEST_WATCH_HANDSHAKE_SECONDS (a number): the watcher waits that long, not 20 s, for ranks its launcher did not
  start (the test of Lightning under plain python waits on it; the watcher's line names the bound it waited).
"""

import functools
import json
import os
import sys
from collections.abc import MutableMapping

# A rank started under torchrun by a test not marked torchrun (tests/conftest.py): the fast tier stays free of starts.
if os.environ.get("LAB_TEST_UNMARKED") and os.environ.get("TORCHELASTIC_RUN_ID"):
    print(os.environ["LAB_TEST_UNMARKED"], file=sys.stderr, flush=True)
    os._exit(3)

PATCHED = []  # each injection's (owner, name, what it held), or the call that puts it back, in order
ABSENT = object()  # what a dict held under a name it did not have


def patch(owner, name, value):
    """owner.name (owner[name] for a dict or os.environ) replaced by value, until undo()."""
    if isinstance(owner, MutableMapping):
        PATCHED.append((owner, name, owner.get(name, ABSENT)))
        owner[name] = value
    else:
        PATCHED.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)


def undo(keep=0):
    """The patches after the first `keep` put back, newest first (tests/workers/runs.py: one run's own); a patch
    that is a call (a setting torch keeps inside) is put back by the call PATCHED holds."""
    while len(PATCHED) > keep:
        if callable(PATCHED[-1]):
            PATCHED.pop()()
            continue
        owner, name, held = PATCHED.pop()
        if held is ABSENT:
            del owner[name]
        elif isinstance(owner, MutableMapping):
            owner[name] = held
        else:
            setattr(owner, name, held)


def at_a_ranks_step(variables, variable, before=None, after=None):
    """Wrap AdamW.step: on the rank and step that `variable` names ("<rank>:<step>", steps counted from 1, rank *
    for every rank), before(optimizer) runs ahead of the step and after(optimizer) behind it."""
    import torch

    chosen_rank, chosen_step = variables[variable].split(":")
    original_step = torch.optim.AdamW.step
    steps_taken = [0]

    def step_with_injection(self, *args, **kwargs):
        steps_taken[0] += 1
        on_this_rank = chosen_rank == "*" or os.environ.get("RANK") == chosen_rank
        chosen = on_this_rank and steps_taken[0] == int(chosen_step)
        if chosen and before:
            before(self)
        result = original_step(self, *args, **kwargs)
        if chosen and after:
            after(self)
        return result

    patch(torch.optim.AdamW, "step", step_with_injection)


def inject(variables):
    """Each injection that `variables` (os.environ, or one run's own LAB_TEST_* assignments) asks for."""
    if variables.get("LAB_TEST_TEXT_NO_CORPUS"):
        patch(sys.modules, "pydoc_data", None)  # import pydoc_data... raises ImportError
        patch(sys.modules, "pydoc_data.topics", None)  # where a run before this one in the process imported it

    if variables.get("LAB_TEST_TEXT_CHARACTERS") or variables.get("LAB_TEST_TEXT_OTHER_CORPUS_ON_RANK"):
        import pydoc_data.topics

        if variables.get("LAB_TEST_TEXT_CHARACTERS"):
            characters = int(variables["LAB_TEST_TEXT_CHARACTERS"])
            patch(
                pydoc_data.topics,
                "topics",
                {name: text[:characters] for name, text in pydoc_data.topics.topics.items()},
            )
        other_on_rank = variables.get("LAB_TEST_TEXT_OTHER_CORPUS_ON_RANK")
        if other_on_rank is not None and other_on_rank == os.environ.get("RANK"):
            patch(
                pydoc_data.topics,
                "topics",
                {**pydoc_data.topics.topics, "zzz-another-python": "A document of another Python."},
            )

    if variables.get("LAB_TEST_TEXT_LOSS") == "padding_in_mean":
        from torch.nn import functional

        from ddp_no_sync_lab.tasks import language

        def mean_over_every_position(self, logits, targets):
            summed = functional.cross_entropy(logits.flatten(0, -2), targets.flatten(), reduction="sum")
            return summed / targets.numel()

        patch(language.TokenCrossEntropy, "forward", mean_over_every_position)

    if variables.get("LAB_TEST_TEXT_LOSS") == "one_token_too_many":
        from torch.nn import functional

        from ddp_no_sync_lab import experiment
        from ddp_no_sync_lab.tasks import language

        def mean_over_one_token_too_many(self, logits, targets):
            summed = functional.cross_entropy(logits.flatten(0, -2), targets.flatten(), reduction="sum")
            return summed / (targets.ne(experiment.IGNORE_INDEX).sum() + 1)

        patch(language.TokenCrossEntropy, "forward", mean_over_one_token_too_many)

    if variables.get("LAB_TEST_TEXT_LOSS") == "first_target_dropped":
        from ddp_no_sync_lab import experiment
        from ddp_no_sync_lab.tasks import packed

        original_batches = packed.RowLoader.batches

        def batches_without_first_targets(self, start):
            for inputs, targets in original_batches(self, start):
                targets = targets.clone()
                targets[:, 0] = experiment.IGNORE_INDEX
                yield inputs, targets

        patch(packed.RowLoader, "batches", batches_without_first_targets)

    if variables.get("LAB_TEST_FSDP"):
        from torch.distributed.fsdp import FSDPModule

        ignored = {"uncorrected": "set_force_sum_reduction_for_comms", "sync_ignored": "set_requires_gradient_sync"}
        patch(FSDPModule, ignored[variables["LAB_TEST_FSDP"]], lambda self, *args, **kwargs: None)

    if variables.get("LAB_TEST_CIFAR_MD5") or variables.get("LAB_TEST_CIFAR_URL"):
        from torchvision.datasets import CIFAR10

        if variables.get("LAB_TEST_CIFAR_MD5"):
            sums = json.loads(variables["LAB_TEST_CIFAR_MD5"])
            patch(CIFAR10, "train_list", [[name, sums[name]] for name, _ in CIFAR10.train_list])
            patch(CIFAR10, "test_list", [[name, sums[name]] for name, _ in CIFAR10.test_list])
            patch(CIFAR10, "meta", {**CIFAR10.meta, "md5": sums[CIFAR10.meta["filename"]]})
        if variables.get("LAB_TEST_CIFAR_URL"):
            patch(CIFAR10, "url", variables["LAB_TEST_CIFAR_URL"])

    if variables.get("LAB_TEST_RAISE_AT_STEP"):
        import torch

        out_of_memory = torch.OutOfMemoryError("injected by the test: out of memory in optimizer.step()")

        def run_out_of_memory(optimizer):
            raise out_of_memory

        at_a_ranks_step(variables, "LAB_TEST_RAISE_AT_STEP", before=run_out_of_memory)

    if variables.get("LAB_TEST_LOSE_GRADIENTS"):
        import torch

        original_adamw_step = torch.optim.AdamW.step

        def step_without_gradients(self, *args, **kwargs):
            for group in self.param_groups:
                for parameter in group["params"]:
                    parameter.grad = None
            return original_adamw_step(self, *args, **kwargs)

        patch(torch.optim.AdamW, "step", step_without_gradients)

    if variables.get("LAB_TEST_FAKE_GPUS"):
        fake_node, fake_count = map(int, variables["LAB_TEST_FAKE_GPUS"].split(":"))
        if int(os.environ.get("GROUP_RANK", -1)) == fake_node:
            import torch

            patch(torch.cuda, "is_available", lambda: True)
            patch(torch.cuda, "device_count", lambda: fake_count)

    if variables.get("LAB_TEST_SYNC_DEBUG"):
        import torch
        from torch.nn.parallel import DistributedDataParallel

        original_train = DistributedDataParallel.train
        training_epochs = [0]

        def train_with_sync_debug(self, mode=True):
            training_epochs[0] += mode
            torch.cuda.set_sync_debug_mode(0 if not mode else "warn" if training_epochs[0] == 1 else "error")
            return original_train(self, mode)

        patch(DistributedDataParallel, "train", train_with_sync_debug)

    if variables.get("LAB_TEST_BROKEN_LOOP") in ("sync_first", "step_inside"):
        import dataclasses

        from ddp_no_sync_lab import experiment

        moved_field = "sync" if variables["LAB_TEST_BROKEN_LOOP"] == "sync_first" else "step"
        window_plan = experiment.window_plan

        def plan_with_the_flag_on_each_windows_first_micro_batch(*args, **kwargs):
            plan = window_plan(*args, **kwargs)
            window_starts = {0} | {index + 1 for index, micro_step in enumerate(plan) if micro_step.step}
            return [
                dataclasses.replace(micro_step, **{moved_field: index in window_starts})
                for index, micro_step in enumerate(plan)
            ]

        patch(experiment, "window_plan", plan_with_the_flag_on_each_windows_first_micro_batch)

    if variables.get("LAB_TEST_BROKEN_LOOP") == "backward_only_in_no_sync":
        import contextlib

        from torch.nn.parallel import DistributedDataParallel

        @contextlib.contextmanager
        def no_sync_entered_after_the_forward(self):
            # As `logits = model(x)` then `with model.no_sync(): loss.backward()`: the forward inside runs with
            # syncing on (it arms the reducer), and syncing is turned off only once it has returned.
            handle = self.register_forward_hook(
                lambda module, inputs, output: setattr(module, "require_backward_grad_sync", False)
            )
            try:
                yield
            finally:
                handle.remove()
                self.require_backward_grad_sync = True

        patch(DistributedDataParallel, "no_sync", no_sync_entered_after_the_forward)

    if variables.get("LAB_TEST_DRIFT_AT_STEP"):
        import torch

        def drift(optimizer):
            bias = optimizer.param_groups[0]["params"][-1]  # the classifier's bias
            with torch.no_grad():
                if variables.get("LAB_TEST_DRIFT") == "ulp":  # the next float32 up: the smallest change there is
                    bias[0] = torch.nextafter(bias[0], torch.tensor(float("inf")))
                else:
                    bias[0] += 1e-3

        at_a_ranks_step(variables, "LAB_TEST_DRIFT_AT_STEP", after=drift)

    if variables.get("LAB_TEST_NAN_AT_STEP"):
        import torch

        def poison(optimizer):
            optimizer.param_groups[0]["params"][-1].grad[0] = float("nan")  # the step writes it into the parameters

        at_a_ranks_step(variables, "LAB_TEST_NAN_AT_STEP", before=poison)

    if variables.get("LAB_TEST_SAME_SHARD"):
        from torch.utils.data.distributed import DistributedSampler

        original_sampler_init = DistributedSampler.__init__

        def rank_0s_shard(self, *args, **kwargs):
            original_sampler_init(self, *args, **kwargs)
            self.rank = 0  # every rank reads rank 0's samples

        patch(DistributedSampler, "__init__", rank_0s_shard)

    if variables.get("LAB_TEST_SAME_ORDER"):
        from torch.utils.data.distributed import DistributedSampler

        patch(DistributedSampler, "set_epoch", lambda self, epoch: None)

    if variables.get("LAB_TEST_HANG_IN_TEARDOWN") and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        import time

        import torch.distributed

        from ddp_no_sync_lab.run import launch

        def hang(*args, **kwargs):
            time.sleep(3600)

        patch(torch.distributed, "destroy_process_group", hang)
        patch(launch, "TEARDOWN_SECONDS", int(variables["LAB_TEST_HANG_IN_TEARDOWN"]))

    if variables.get("LAB_TEST_COUNT_DECODES"):
        from ddp_no_sync_lab.tasks import data

        decode_image_folders = data.decode_image_folders

        def counted_decode(*args, **kwargs):
            with open(variables["LAB_TEST_COUNT_DECODES"], "a") as log:
                log.write(f"decoded by pid {os.getpid()}\n")
            return decode_image_folders(*args, **kwargs)

        patch(data, "decode_image_folders", counted_decode)

    if variables.get("LAB_TEST_WATCH_HANDSHAKE_SECONDS"):
        from datetime import timedelta

        from ddp_no_sync_lab.watch import observe

        patch(observe, "HANDSHAKE_TIMEOUT", timedelta(seconds=int(variables["LAB_TEST_WATCH_HANDSHAKE_SECONDS"])))

    if variables.get("LAB_TEST_THREADS"):
        import torch

        PATCHED.append(functools.partial(torch.set_num_threads, torch.get_num_threads()))
        torch.set_num_threads(int(variables["LAB_TEST_THREADS"]))
        print(f"LAB_TEST_THREADS: {torch.get_num_threads()} intra-op threads", file=sys.stderr)

    if variables.get("LAB_TEST_CPU_BF16"):
        patch(os.environ, "LAB_CPU_BF16", variables["LAB_TEST_CPU_BF16"])

    if variables.get("LAB_TEST_NODE_TORCH_VERSION"):
        node, version = variables["LAB_TEST_NODE_TORCH_VERSION"].split(":")
        if os.environ.get("GROUP_RANK") == node:
            import torch

            patch(torch, "__version__", version)

    if variables.get("LAB_TEST_CHECKPOINT") == "reentrant":
        import torch.utils.checkpoint

        reentrant_checkpoint = torch.utils.checkpoint.checkpoint

        def checkpoint_reentrant(function, *args, use_reentrant=None, context_fn=None, **kwargs):
            return reentrant_checkpoint(function, *args, use_reentrant=True, **kwargs)

        patch(torch.utils.checkpoint, "checkpoint", checkpoint_reentrant)  # before model.py imports it

    if variables.get("LAB_TEST_CHECKPOINT") == "statistics_twice":
        from contextlib import nullcontext

        import model

        patch(model, "recompute_context", lambda stage: (nullcontext(), nullcontext()))

    if variables.get("LAB_TEST_KILL_AT"):
        import re
        import signal

        from torch.nn.parallel import DistributedDataParallel

        points = variables["LAB_TEST_KILL_AT"].split(",")
        start = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        kind, _, number = (points[start] if start < len(points) else "-").partition(":")
        seen = {"records": 0, "evaluations": 0, "training_forwards": 0, "evaluation_forwards": 0}

        def die():
            os.kill(os.getpid(), signal.SIGKILL)

        original_replace, original_rename = os.replace, os.rename

        def replace_and_die_on_cue(source, destination, *args, **kwargs):
            is_record = re.fullmatch(r"resume_state-[0-9]+\.json", os.path.basename(destination))
            seen["records"] += bool(is_record)
            if is_record and kind == "saving" and seen["records"] == int(number):
                die()
            result = original_replace(source, destination, *args, **kwargs)
            if is_record and kind == "saved" and seen["records"] == int(number):
                die()
            return result

        def rename_and_die_on_cue(source, destination, *args, **kwargs):
            if kind == "publish" and ".partial-" in os.path.basename(source):
                die()
            return original_rename(source, destination, *args, **kwargs)

        patch(os, "replace", replace_and_die_on_cue)
        patch(os, "rename", rename_and_die_on_cue)
        original_train, original_forward = DistributedDataParallel.train, DistributedDataParallel.forward

        def train_counted(self, mode=True):
            if not mode:
                seen["evaluations"] += 1
                seen["evaluation_forwards"] = 0
            return original_train(self, mode)

        def forward_and_die_on_cue(self, *args, **kwargs):
            if self.training:
                seen["training_forwards"] += 1
                if kind == "term" and seen["training_forwards"] == int(number) and os.environ.get("RANK") == "0":
                    os.kill(os.getpid(), signal.SIGTERM)
            else:
                seen["evaluation_forwards"] += 1
                if kind == "eval" and seen["evaluations"] == int(number) and seen["evaluation_forwards"] == 1:
                    die()
            return original_forward(self, *args, **kwargs)

        patch(DistributedDataParallel, "train", train_counted)
        patch(DistributedDataParallel, "forward", forward_and_die_on_cue)


inject(os.environ)
