"""What the watcher puts into a script's process before its first line, through the audit's face: a witness
(watch/witness.py) on every DDP model the script makes and on the root of a model it puts under FSDP2's
fully_shard, fed by the optimizers' step hooks (every optimizer's), by torch's cross-entropy (called as a function
or through its module), by a GradScaler's scale, unscale and step, by its DataLoaders' passes over a
DistributedSampler; and the exchange of every rank's observations before the script tears its process group down.

Nothing here changes what the script computes: the watcher's own collectives run on a group of its own, made where
every rank passes (the first DDP construction, an FSDP2 root's first training forward), and a hook the script
registers on its DDP model runs inside the watcher's counting one, as DDP runs it without the watcher.
"""

import functools
import inspect
import os
import sys
import time
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.data import DataLoader
from torch.utils.data import dataloader as loader_module
from torch.utils.data.distributed import DistributedSampler

from ddp_no_sync_lab.audit import face
from ddp_no_sync_lab.cli import LabError
from ddp_no_sync_lab.strategies import fsdp
from ddp_no_sync_lab.watch.witness import (
    DDP_REGISTER_COMM_HOOK,
    SLOTS,
    HookSlot,
    LoopWitness,
    ShardedView,
    framework_of,
)

# A launcher's rank in the environment at the start (torchrun's, SLURM's, Open MPI's, MPICH's): without one, a
# script whose DDP model spans several ranks started the others itself, without the watcher.
LAUNCHER_RANKS = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
HANDSHAKE_TIMEOUT = timedelta(seconds=20)  # how long the ranks a launcher did not start have to answer the watcher
# The longest a rank waits for the others in the watcher's own collectives (a window's average, the exchange at
# exit): longer than a rank's last evaluation or save before its teardown; ranks stopped apart end, never hang.
EXCHANGE_TIMEOUT = timedelta(minutes=30)


class LaunchError(LabError):
    """The script's ranks cannot all be watched as it was launched: said in one line, the process ended at once (its
    own ranks wait on it in DDP's collectives)."""

    def __init__(self, message):
        super().__init__(message, broken_process=True)


class Watch:
    """A script's watcher: adopts each DDP model as the script makes it, and at the script's teardown exchanges
    every rank's observations (close). The process-wide patches (installed once) report to the watch installed
    last."""

    active = None  # the watch the patches report to
    patched = False

    def __init__(self):
        self.witnesses = []
        self.declined = []  # DDP models not watched, and why
        self.unit_hooks = {}  # per FSDP unit, until its model's root is called: that call adopts the root
        self.syncs_unattributed = None  # why the syncs cannot be attributed to the model judged, where they cannot
        self.rank = None  # this process's global rank, once it made a process group
        self.window_judge = None  # called with a witness's observations as each window ends (--fail-fast)
        self.compiled_loss = False  # a cross-entropy was traced into a compiled region (never read there)
        self.group = None  # the watcher's own process group
        # per DataLoader pass over a DistributedSampler: [sampler, epoch, shuffle, order, who set its epoch]
        self.sampler_passes = []
        self.samplers = weakref.WeakKeyDictionary()
        self.epoch_set_by = weakref.WeakKeyDictionary()  # per sampler: the framework that set its epoch last, or None
        self.current_pass = None  # the pass whose batch the script took last
        self.trained_passes = set()  # passes a training forward followed a batch of
        self.of_optimizer = weakref.WeakKeyDictionary()
        self.step_depth = 0  # optimizers' steps under way (a wrapper's step runs its inner optimizer's)
        self.steps_ended = 0  # optimizer steps taken (outermost), for a GradScaler's skipped one to show
        self.stepping, self.step_read = [], True  # the witnesses of the step under way; its gradients read yet
        self.own_read_hooks = weakref.WeakKeyDictionary()  # per optimizer: its pre-hook that reads a step
        self.observed = None  # every rank's observations, once exchanged
        self.torn_down_failing = False  # the script tore the default group down while handling an exception
        self.launched = any(name in os.environ for name in LAUNCHER_RANKS)  # this process given its rank

    def install(self):
        """This watch the one the process's events go to, the patches put in on the first install."""
        face.install()
        Watch.active = self
        if not Watch.patched:
            patch_process()
            Watch.patched = True

    def adopt(self, ddp_model):
        """A DDP model the script made, or the ShardedView of an FSDP2 root (a collective: every rank makes it, or
        calls it first): its syncs counted, witnessed."""
        if dist.get_world_size(ddp_model.process_group) != dist.get_world_size():
            self.declined.append(
                "a DDP model over a subgroup of the ranks (not watched: the watcher's exchange spans all)"
            )
            return
        if dist.get_world_size() > 1 and not self.launched:
            self.check_every_rank_watched()
        if self.group is None:
            self.group = dist.new_group(backend="gloo", timeout=EXCHANGE_TIMEOUT)
        self.rank = dist.get_rank()
        self.of_optimizer = weakref.WeakKeyDictionary()  # an optimizer that stepped before may update this model
        device = next(ddp_model.module.parameters()).device
        comm_audit = face.CommAudit(dist.get_world_size(), group=self.group)
        if isinstance(ddp_model, ShardedView):
            fsdp.counting_into(comm_audit, owner="watch")  # FSDP's reduce-scatters, from the calls themselves
        else:
            slot = SLOTS[ddp_model] = HookSlot(ddp_model)
            DDP_REGISTER_COMM_HOOK(ddp_model, (comm_audit, None), face.counting(slot.run))
            ddp_model._comm_hooks.clear()  # the script reads DDP's record of its hooks: its own only
        witness = LoopWitness(ddp_model, self, comm_audit, device)
        witness.begin_epoch(face.EpochTrace())
        self.witnesses.append(witness)

    def check_every_rank_watched(self):
        """Where no launcher gave this process its rank, the script may have started the others itself, without the
        watcher (Lightning under plain python, a spawn of its own): every rank must join the watcher's handshake,
        a group of its own, in a short time (the ranks have just passed DDP's construction together)."""
        try:
            dist.new_group(backend="gloo", timeout=HANDSHAKE_TIMEOUT)
        except Exception as error:  # noqa: BLE001 - gloo says only that the others never came
            world_size = dist.get_world_size()
            raise LaunchError(
                f"the script made a model over {world_size} ranks, and the others did not answer the watcher in "
                f"{HANDSHAKE_TIMEOUT.seconds} s: the script started them itself (as Lightning does under plain "
                f"python), without the watcher: launch it with torchrun --nproc-per-node={world_size} -m "
                f"ddp_no_sync_lab.watch SCRIPT ({type(error).__name__})"
            ) from None

    def on_fully_shard(self, module):
        """A module fully_shard made an FSDP unit: the first unit called is its model's root (the others run inside
        its forward), adopted at that call, before FSDP's own pre-forward hook: the witnesses take the parameters as
        fully_shard left them, before FSDP's lazy initialization (as the lab's attach takes them)."""
        self.unit_hooks[module] = module.register_forward_pre_hook(
            self.on_first_sharded_call, prepend=True, with_kwargs=True
        )

    def on_first_sharded_call(self, module, positional, keywords):
        """The root of a model under fully_shard, called: the first called in training, with parameters to train, is
        adopted; a frozen one (a teacher, a reference model) is let be; a second trained one makes the syncs
        unattributable (its reduce-scatters are counted with the first's)."""
        if not any(p.requires_grad for p in module.parameters()):
            self.release_units(module)
            return
        if not (module.training and torch.is_grad_enabled()):  # a teacher's, or an evaluation's: not yet a training
            return
        self.release_units(module)
        if any(isinstance(witness.ddp_model, ShardedView) for witness in self.witnesses):
            self.syncs_unattributed = "two models under fully_shard trained: their reduce-scatters are not told apart"
            return
        if next(module.parameters()).device_mesh.ndim > 1:
            self.declined.append(
                "a model under fully_shard over a 2-D mesh (HSDP, or with tensor parallelism): not watched"
            )
            return
        self.adopt(ShardedView(module))
        if self.witnesses and self.witnesses[-1].module is module:  # its first forward began before its hook
            self.witnesses[-1].on_forward(module, positional, keywords)

    def release_units(self, root):
        """The first-call hooks of `root` and of the units inside it, removed."""
        for unit in list(root.modules()):
            handle = self.unit_hooks.pop(unit, None)
            if handle is not None:
                handle.remove()

    # -- the events

    def window_ended(self, witness):
        """A window of the witness's model ended (seen at the next training forward, its step's wrappers done)."""
        if self.window_judge is not None:
            self.window_judge(witness.summary(), self.rank, dist.get_world_size())

    def witnesses_of(self, optimizer):
        """The witnesses whose model the optimizer updates (looked up once per optimizer)."""
        if optimizer not in self.of_optimizer:
            stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
            self.of_optimizer[optimizer] = [w for w in self.witnesses if stepped & {id(p) for p in w.parameters}]
        return self.of_optimizer[optimizer]

    def on_step_begin(self, optimizer, step_args, step_kwargs):
        """A step's gradients read as it begins, after the optimizer's own pre-hooks (which may change them; an
        optimizer may change them as it updates: SGD's Nesterov momentum does, in place); a step given a closure, as
        the closure returns: the closure runs the window's last forward and backward inside step() (Lightning's
        does), before the update."""
        self.step_depth += 1
        if self.step_depth > 1:  # an inner optimizer's step inside a wrapper's: one step
            return None
        self.stepping = [witness for witness in self.witnesses_of(optimizer) if not witness.joins_last_step(optimizer)]
        for witness in self.stepping:
            if witness.optimizer is None:  # its updates counted from before its first
                witness.bind(optimizer)
        self.step_read = False
        # torch's hooks see step()'s arguments with the optimizer first: (optimizer, closure?)
        closure = step_kwargs.get("closure", step_args[1] if len(step_args) > 1 else None)
        if not callable(closure):
            self.read_after_own_hooks(optimizer)
            return None

        def closure_read(*args, **kwargs):
            loss = closure(*args, **kwargs)
            self.read_step(optimizer)
            return loss

        if "closure" in step_kwargs:
            return step_args, {**step_kwargs, "closure": closure_read}
        return (step_args[0], closure_read, *step_args[2:]), step_kwargs

    def read_after_own_hooks(self, optimizer):
        """The step read by a pre-hook of the optimizer's own, run last of them (torch runs the global pre-hooks,
        this one's caller, before the optimizer's)."""
        if optimizer not in self.own_read_hooks:
            self.own_read_hooks[optimizer] = optimizer.register_step_pre_hook(
                lambda stepped, *_: self.read_step(stepped)
            )
        optimizer._optimizer_step_pre_hooks.move_to_end(self.own_read_hooks[optimizer].id)

    def read_step(self, optimizer):
        """The gradients the step takes, read once (an optimizer that calls its closure again reads nothing more)."""
        if not self.step_read:
            self.step_read = True
            for witness in self.stepping:
                witness.on_step_begin(optimizer, (), {})

    def on_step_end(self, optimizer, step_args, step_kwargs):
        self.step_depth -= 1
        if self.step_depth > 0:
            return
        self.read_step(optimizer)  # a closure the step never called
        self.steps_ended += 1
        for witness in self.stepping:
            witness.on_step_end(optimizer, step_args, step_kwargs)

    def on_loss_scaled(self, scale):
        """A GradScaler multiplied a loss by `scale` (a tensor) before its backward."""
        for witness in self.witnesses:
            witness.scaled_by = scale.detach().clone()

    def on_unscaled(self, optimizer, scale):
        """A GradScaler divided the optimizer's gradients by `scale` in place: expected of them at the step, as a
        clip is."""
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for witness in self.witnesses_of(optimizer):
            witness.on_clip(stepped, scale.double().reciprocal())

    def on_skipped_step(self, optimizer, ended):
        """A GradScaler skipped the optimizer's update on inf or NaN gradients: its window ended with the step's hooks
        (`ended`: a fused optimizer's), or ends now."""
        for witness in self.witnesses_of(optimizer):
            if not ended and witness.joins_last_step(optimizer):
                continue
            if witness.optimizer is None:
                witness.bind(optimizer)
            witness.on_skipped_step(optimizer, ended)

    def on_loss(self, call, output):
        """A cross-entropy the script computed: read as a mean (or a sum) over its targets but those ignored, where
        it is one; a loss weighted, smoothed or over probabilities is not read (item 4 then rests on the rest)."""
        call.apply_defaults()
        given = call.arguments
        plain = (
            not given["target"].is_floating_point()
            and given["weight"] is None
            and given["label_smoothing"] == 0.0
            and given["size_average"] is None
            and given["reduce"] is None
            and given["reduction"] in ("mean", "sum")
        )
        for witness in self.witnesses:
            if plain:
                witness.read_loss(given["input"], given["target"], output, given["ignore_index"])
            else:
                witness.skip_loss()

    def on_sampler_pass(self, sampler):
        """A DataLoader began a pass over a DistributedSampler: its number, its epoch, the order it will deliver."""
        number = self.samplers.setdefault(sampler, len(self.samplers))
        order = hash(tuple(iter(sampler)))
        self.sampler_passes.append([number, sampler.epoch, sampler.shuffle, order, self.epoch_set_by.get(sampler)])
        return len(self.sampler_passes) - 1

    # -- the exchange

    def close(self):
        """Every rank's observations exchanged over the watcher's group (once, before the script's teardown), then
        the hooks' callbacks let finish (face.settle's reason: gloo's threads need the GIL at exit)."""
        if self.observed is not None or not dist.is_initialized():
            return
        self.rank = dist.get_rank()
        models = [witness.end_epoch() for witness in self.witnesses]
        passes = [[*record, number in self.trained_passes] for number, record in enumerate(self.sampler_passes)]
        mine = {
            "sampler_passes": passes,
            "declined": self.declined,
            "syncs_unattributed": self.syncs_unattributed,
            "compiled_loss": self.compiled_loss,
        }
        group = self.group if self.group is not None else dist.new_group(backend="gloo", timeout=EXCHANGE_TIMEOUT)
        gathered = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, mine, group=group)
        self.observed = {
            "world_size": dist.get_world_size(),
            "backend": str(dist.get_backend()),
            "models": models,
            "ranks": gathered,
        }
        dist.barrier(group=group)
        time.sleep(0.1)


def patch_process():
    """The watcher's taps, once per process, each reporting to Watch.active: DDP's constructor and its hook
    registration, every optimizer's step (torch's global step hooks), torch's cross_entropy (a module's call
    reaches it too), a DataLoader's pass over a DistributedSampler and each batch it hands over, the default
    group's teardown (the exchange first), FSDP2's fully_shard, and GradScaler's scale, unscale and step."""
    ddp_init = DistributedDataParallel.__init__

    @functools.wraps(ddp_init)
    def __init__(ddp_model, *args, **kwargs):
        ddp_init(ddp_model, *args, **kwargs)
        Watch.active.adopt(ddp_model)

    @functools.wraps(DDP_REGISTER_COMM_HOOK)
    def watched_register_comm_hook(ddp_model, state, hook):
        slot = SLOTS.get(ddp_model)
        if slot is None:
            return DDP_REGISTER_COMM_HOOK(ddp_model, state, hook)
        ddp_model._check_comm_hook(hook)  # checked as DDP checks it, then run inside the watcher's count
        if slot.registered:
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called once.")
        slot.hook, slot.state, slot.registered = hook, state, True
        ddp_model._comm_hooks.append((hook, state))  # DDP's record of its hooks: the script's, as without us

    builtin = DistributedDataParallel._register_builtin_comm_hook

    @functools.wraps(builtin)
    def watched_builtin_comm_hook(ddp_model, comm_hook_type):
        if ddp_model in SLOTS:
            raise RuntimeError(
                f"ddp_no_sync_lab.watch: DDP's C++ built-in hook {comm_hook_type} cannot run inside the watcher's "
                f"count: register its Python twin instead (torch.distributed.algorithms.ddp_comm_hooks.default_hooks)"
            )
        return builtin(ddp_model, comm_hook_type)

    DistributedDataParallel.__init__ = __init__
    DistributedDataParallel.register_comm_hook = watched_register_comm_hook
    DistributedDataParallel._register_builtin_comm_hook = watched_builtin_comm_hook
    register_optimizer_step_pre_hook(lambda *event: Watch.active.on_step_begin(*event))  # may wrap the closure
    register_optimizer_step_post_hook(lambda *event: Watch.active.on_step_end(*event))
    cross_entropy = F.cross_entropy
    signature = inspect.signature(cross_entropy)

    @functools.wraps(cross_entropy)
    def watched_cross_entropy(*args, **kwargs):
        output = cross_entropy(*args, **kwargs)
        # A loss inside a compiled region is traced (on fake or functional tensors: a compiler may put this wrapper
        # in its graph as torch's own), not read: only a loss computed eagerly, a plain tensor, is.
        if type(output) is torch.Tensor and not torch.compiler.is_compiling():
            Watch.active.on_loss(signature.bind(*args, **kwargs), output)
        else:
            Watch.active.compiled_loss = True
        return output

    F.cross_entropy = watched_cross_entropy
    patch_loaders()
    patch_teardown()
    patch_fully_shard()
    patch_grad_scaler()


def patch_grad_scaler():
    """torch.amp.GradScaler as the witnesses must read it: the loss it scales (its divisor read times the scale),
    the gradients it unscales in place (expected at the step, as a clip), the step it skips on inf or NaN
    gradients (a window's end with no update)."""
    scaler_class = torch.amp.GradScaler
    scale, unscale, step = scaler_class.scale, scaler_class.unscale_, scaler_class.step

    @functools.wraps(scale)
    def watched_scale(scaler, outputs):
        scaled = scale(scaler, outputs)
        if scaler.is_enabled() and isinstance(outputs, torch.Tensor):
            Watch.active.on_loss_scaled(scaler._scale)
        return scaled

    @functools.wraps(unscale)
    def watched_unscale(scaler, optimizer):
        unscale(scaler, optimizer)
        if scaler.is_enabled():
            Watch.active.on_unscaled(optimizer, scaler._scale)

    @functools.wraps(step)
    def watched_step(scaler, optimizer, *args, **kwargs):
        ended = Watch.active.steps_ended
        result = step(scaler, optimizer, *args, **kwargs)
        found = (
            scaler._per_optimizer_states[id(optimizer)].get("found_inf_per_device", {}) if scaler.is_enabled() else {}
        )
        if sum(value.item() for value in found.values()):  # a fused optimizer is stepped, and skips the update itself
            Watch.active.on_skipped_step(optimizer, ended=Watch.active.steps_ended != ended)
        return result

    scaler_class.scale, scaler_class.unscale_, scaler_class.step = watched_scale, watched_unscale, watched_step


def patch_fully_shard():
    """FSDP2's fully_shard, as scripts import it (torch.distributed.fsdp): each unit it makes reported."""
    from torch.distributed import fsdp as torch_fsdp  # imports torch._dynamo: about 0.8 s, once per process

    shard = torch_fsdp.fully_shard

    @functools.wraps(shard)  # its attributes too (fully_shard.state)
    def fully_shard(module, *args, **kwargs):
        sharded = shard(module, *args, **kwargs)
        if isinstance(sharded, torch.nn.Module):
            Watch.active.on_fully_shard(sharded)
        return sharded

    torch_fsdp.fully_shard = fully_shard


def patch_teardown():
    """The default group's teardown: the exchange first, on the script's way out only."""
    destroy = dist.destroy_process_group

    @functools.wraps(destroy)
    def destroy_process_group(group=None):
        # The exchange on the script's way out, not on its way down: an exception being handled means it failed.
        if group is None or group is dist.GroupMember.WORLD:
            if sys.exc_info()[0] is None:
                Watch.active.close()
            else:
                Watch.active.torn_down_failing = True
        destroy(group)

    dist.destroy_process_group = destroy_process_group


def patch_loaders():
    """A DataLoader's pass over a DistributedSampler recorded as it begins, and each batch it hands over marked
    with its pass (torch's loader iterators share their base class's __next__); who set a sampler's epoch, the
    script or a framework."""
    loader_iter, next_batch = DataLoader.__iter__, loader_module._BaseDataLoaderIter.__next__

    @functools.wraps(loader_iter)
    def __iter__(loader):
        iterator = loader_iter(loader)
        sampler = loader.sampler if isinstance(loader.sampler, DistributedSampler) else None
        sampler = sampler or getattr(loader.batch_sampler, "sampler", None)
        iterator.watched_pass = (
            Watch.active.on_sampler_pass(sampler) if isinstance(sampler, DistributedSampler) else None
        )
        return iterator

    @functools.wraps(next_batch)
    def __next__(iterator):
        batch = next_batch(iterator)
        Watch.active.current_pass = getattr(iterator, "watched_pass", None)
        return batch

    set_epoch = DistributedSampler.set_epoch

    @functools.wraps(set_epoch)
    def watched_set_epoch(sampler, epoch):
        Watch.active.epoch_set_by[sampler] = framework_of(sys._getframe(1))
        set_epoch(sampler, epoch)

    DataLoader.__iter__ = __iter__
    loader_module._BaseDataLoaderIter.__next__ = __next__
    DistributedSampler.set_epoch = watched_set_epoch
