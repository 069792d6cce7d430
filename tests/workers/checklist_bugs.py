"""train.py's real training run several times in one torchrun start, each run with one accumulation bug
injected, either in the loop (train.py's own source edited as a user would edit it) or beneath it (torch's
optimizer, autograd, DDP or collective patched for that run alone). Each scenario's run folder is then
audited by tests/test_checklist.py: verify.py must refuse it, naming the checklist item it breaks.

    torchrun --nproc-per-node=2 tests/workers/checklist_bugs.py [--watch] OUT BUG:WAY:MODE ... -- TRAIN_OPTIONS

MODE is every, no_sync or both; each scenario trains into OUT/BUG-WAY-MODE/<mode> (compression_label_lies
with --comm-hook bf16; BUG:WAY:MODE:PRECISION with --precision PRECISION, into OUT/BUG-WAY-MODE-PRECISION;
BUG "none" in the loop is the lab). With --watch each run of a bug made in the loop (and the lab's) is also
watched as a foreign script would be (ddp_no_sync_lab.watch: its witnesses installed for the run, its verdict
judged after it): rank 0 writes the watcher's last line to the run's folder's watch.txt. A bug made beneath the
loop is never watched: the watcher's own patches would sit over it.
"""

import contextlib
import functools
import sys
import types
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

import train
from ddp_no_sync_lab.run import launch
from ddp_no_sync_lab.watch.observe import Watch
from ddp_no_sync_lab.watch.verdict import judge

REPO = Path(__file__).resolve().parents[2]

ADAM = sys.modules[torch.optim.AdamW.__module__.replace("adamw", "adam")]  # torch.optim.adam: its functional adam
LOSS_BACKWARD = "(raw_loss / micro_step.loss_divisor).backward()"
STEP = "                optimizer.step()\n"
AVERAGED_BUCKET = "tensor = bucket.buffer().div_(comm_audit.world_size)"
LOOP_TOP = (
    "        inputs, targets = to_device(inputs, device), targets.to(device, non_blocking=True)\n        # The forward"
)

# The loop's bugs: (text of train.py, what a user wrote instead), each applied where it occurs once.
LOOP_EDITS = {
    "reset_inside_window": [(LOOP_TOP, "        optimizer.zero_grad(set_to_none=True)\n" + LOOP_TOP)],
    "reset_in_place": [(LOOP_TOP, "        optimizer.zero_grad(set_to_none=False)\n" + LOOP_TOP)],
    "loss_not_divided": [(LOSS_BACKWARD, "raw_loss.backward()")],
    "loss_divided_twice": [
        (LOSS_BACKWARD, "(raw_loss / micro_step.loss_divisor / micro_step.loss_divisor).backward()")
    ],
    "extra_step": [(STEP, STEP + STEP)],
    "step_before_sync": [  # the step after the window's last local backward, before the synchronized one
        (STEP, ""),
        (
            LOSS_BACKWARD,
            LOSS_BACKWARD
            + "\n                if not micro_step.step and plan[index + 1].step:\n                    optimizer.step()",
        ),
    ],
    "skipped_step": [(STEP, "                if index != 3:\n    " + STEP)],
    "hook_sums": [(AVERAGED_BUCKET, "tensor = bucket.buffer()")],
    "hook_divides_twice": [(AVERAGED_BUCKET, AVERAGED_BUCKET + ".div_(comm_audit.world_size)")],
    "reset_on_one_rank": [
        (LOOP_TOP, "        if dist.get_rank() == 1:\n            optimizer.zero_grad(set_to_none=True)\n" + LOOP_TOP)
    ],
    "loss_on_part_of_batch": [
        (
            "raw_loss = criterion(logits, targets)",
            "raw_loss = criterion(logits[: len(targets) // 2], targets[: len(targets) // 2])",
        )
    ],
    "compression_label_lies": [
        (
            "future = face.COMPRESSION_HOOKS[comm_audit.comm_hook](comm_audit.group, bucket)",
            "future = dist.all_reduce(bucket.buffer().div_(comm_audit.world_size), group=comm_audit.group, "
            "async_op=True).get_future()",
        )
    ],
}


def loop_with(bug):
    """train.py as a module, its source edited: each edit must match exactly once (none for bug "none")."""
    source = (REPO / "train.py").read_text()
    for old, new in LOOP_EDITS[bug] if bug != "none" else []:
        assert source.count(old) == 1, f"{bug}: {old!r} occurs {source.count(old)} times in train.py"
        source = source.replace(old, new)
    module = types.ModuleType(f"train_{bug}")
    module.__file__ = str(REPO / "train.py")
    exec(compile(source, str(REPO / "train.py"), "exec"), module.__dict__)
    return module


@contextlib.contextmanager
def patched(owner, name, make):
    """owner.name replaced by make(original) for the block."""
    original = getattr(owner, name)
    setattr(owner, name, make(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


@contextlib.contextmanager
def optimizers_seen():
    """The AdamW instances made in the block (a library beneath the loop holds the optimizer too)."""
    made = []

    def make(original):
        @functools.wraps(original)
        def init(self, *args, **kwargs):
            original(self, *args, **kwargs)
            made.append(self)

        return init

    with patched(torch.optim.AdamW, "__init__", make):
        yield made


def before_each_backward(action):
    """torch.autograd.backward (what Tensor.backward calls) doing action(call number, loss) first; returns
    the loss to differentiate."""

    def make(original):
        calls = [0]

        def backward(tensors, *args, **kwargs):
            calls[0] += 1
            return original(action(calls[0], tensors), *args, **kwargs)

        return backward

    return patched(torch.autograd, "backward", make)


def training_forward_does(action):
    """DistributedDataParallel.forward doing action(ddp) before each training forward."""

    def make(original):
        def forward(self, *args, **kwargs):
            if self.training and torch.is_grad_enabled():
                action(self)
            return original(self, *args, **kwargs)

        return forward

    return patched(DistributedDataParallel, "forward", make)


def functional_adam(skip_or_repeat):
    """torch's functional adam (inside AdamW.step, beneath its hooks) run twice, or skipped on its 3rd call."""

    def make(original):
        calls = [0]

        def adam(*args, **kwargs):
            calls[0] += 1
            if skip_or_repeat == "skip" and calls[0] == 3:
                return None
            original(*args, **kwargs)
            if skip_or_repeat == "repeat":
                original(*args, **kwargs)

        return adam

    return patched(ADAM, "adam", make)


def comm_hook_wrapped(after):
    """DDP's registered gradient hook followed by after(tensor) on its result (the hook keeps its name)."""

    def make(original):
        def register_comm_hook(self, state, hook):
            @functools.wraps(hook)
            def wrapped(state, bucket):
                return hook(state, bucket).then(lambda future: after(future.value()))

            return original(self, state, wrapped)

        return register_comm_hook

    return patched(DistributedDataParallel, "register_comm_hook", make)


def collective_scales_gradients(factor):
    """torch.distributed.all_reduce multiplying a gradient bucket (a large float tensor) first."""

    def make(original):
        def all_reduce(tensor, *args, **kwargs):
            if tensor.is_floating_point() and tensor.numel() > 1000:
                tensor.mul_(factor)
            return original(tensor, *args, **kwargs)

        return all_reduce

    return patched(dist, "all_reduce", make)


@contextlib.contextmanager
def beneath(bug):
    """The same bugs, made beneath the loop (torch's optimizer, autograd, DDP or the collective)."""
    world_size = dist.get_world_size()
    with contextlib.ExitStack() as stack:
        if bug == "reset_inside_window":  # DDP's forward drops the gradients, as a wrapper library might
            stack.enter_context(training_forward_does(lambda ddp: [setattr(p, "grad", None) for p in ddp.parameters()]))
        elif bug == "reset_in_place":  # zeroed through .data before each backward: no version counter moves
            made = stack.enter_context(optimizers_seen())

            def zero_through_data(call, loss):
                for group in made[-1].param_groups:
                    for parameter in group["params"]:
                        if parameter.grad is not None:
                            parameter.grad.data.zero_()
                return loss

            stack.enter_context(before_each_backward(zero_through_data))
        elif bug == "loss_not_divided":  # autograd differentiates 4x the loss
            stack.enter_context(before_each_backward(lambda call, loss: loss * 4))
        elif bug == "loss_divided_twice":  # the criterion already divides by the window
            stack.enter_context(patched(torch.nn.CrossEntropyLoss, "forward", lambda f: lambda *a: f(*a) / 4))
        elif bug == "extra_step":
            stack.enter_context(functional_adam("repeat"))
        elif bug == "skipped_step":
            stack.enter_context(functional_adam("skip"))
        elif bug == "step_before_sync":  # a library steps before each window's last forward
            made, forwards = stack.enter_context(optimizers_seen()), [0]

            def step_early(ddp):
                forwards[0] += 1
                if forwards[0] % 4 == 0:
                    made[-1].step()

            stack.enter_context(training_forward_does(step_early))
        elif bug == "hook_sums":
            stack.enter_context(collective_scales_gradients(world_size))
        elif bug == "hook_divides_twice":
            stack.enter_context(comm_hook_wrapped(lambda tensor: tensor.div_(world_size)))
        elif bug == "reset_on_one_rank":  # rank 1's forward drops its gradients (a rank-dependent branch)
            stack.enter_context(
                training_forward_does(
                    lambda ddp: [setattr(p, "grad", None) for p in ddp.parameters() if dist.get_rank() == 1]
                )
            )
        elif bug == "loss_on_part_of_batch":  # the criterion keeps half the batch it is given

            def half(forward):
                return lambda self, inputs, targets: forward(
                    self, inputs[: len(targets) // 2], targets[: len(targets) // 2]
                )

            stack.enter_context(patched(torch.nn.CrossEntropyLoss, "forward", half))
        elif bug == "compression_label_lies":  # torch's bf16 hook sending float32
            stack.enter_context(
                patched(default_hooks, "_compress_hook", lambda f: lambda dtype, *a: f(torch.float32, *a))
            )
        else:
            raise ValueError(f"no such bug: {bug}")
        yield


@contextlib.contextmanager
def watched(output):
    """The run under the watcher, its verdict's last line written to OUTPUT/watch.txt by rank 0."""
    watch = Watch()
    watch.install()
    yield  # a run that raises ends the start (torchrun stops the other rank): no exchange to wait for
    watch.close()
    if dist.get_rank() == 0:
        (output / "watch.txt").write_text(judge(watch.observed).last_line() + "\n")


def main():
    watching = sys.argv[1] == "--watch"
    arguments = sys.argv[2:] if watching else sys.argv[1:]
    separator = arguments.index("--")
    out, scenarios, options = Path(arguments[0]), arguments[1:separator], arguments[separator + 1 :]
    place = launch.init_process_group(launch.launch_environment(2))
    for scenario in scenarios:
        bug, way, modes, *precision = scenario.split(":")
        module = loop_with(bug) if way == "loop" else train
        for mode in ("every", "no_sync") if modes == "both" else (modes,):
            output = out / "-".join([bug, way, modes, *precision]) / mode
            needs = ["--comm-hook", "bf16"] if bug == "compression_label_lies" else []
            needs += ["--precision", *precision] if precision else []
            args = module.parse_args(["--mode", mode, "--output", str(output), "--quiet", *options, *needs])
            with beneath(bug) if way != "loop" else contextlib.nullcontext():
                with watched(output) if watching and way == "loop" else contextlib.nullcontext():
                    module.run(args, place)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
