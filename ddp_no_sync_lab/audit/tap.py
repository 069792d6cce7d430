"""What a gradient hook hands to the collective, read from the call itself (the checklist's byte witness)."""

import threading
from contextlib import contextmanager

import torch.distributed as dist


class CollectiveTap:
    """What a gradient hook hands to torch.distributed.all_reduce, read from the call itself: each tensor's dtype
    and element count. Installed once per process, on request (install); it records only inside `handed()` on
    the calling thread."""

    def __init__(self):
        self.local = threading.local()
        self.original = None  # torch.distributed.all_reduce as install found it

    def install(self):
        """Wrap torch.distributed.all_reduce, once per process (a second call changes nothing): torch's hooks call
        it through the package at call time. Installed before anything else wraps it, the tap sits beneath every
        later wrapper and reads what reaches torch's own all_reduce."""
        if self.original is None:
            self.original = dist.all_reduce

            def all_reduce(tensor, *args, **kwargs):
                if getattr(self.local, "handed", None) is not None:
                    self.local.handed.append((tensor.dtype, tensor.numel()))
                return self.original(tensor, *args, **kwargs)

            dist.all_reduce = all_reduce
        return self

    @contextmanager
    def handed(self):
        """Yields the list the block's all_reduce calls on this thread append (dtype, element count) to."""
        self.local.handed = []
        try:
            yield self.local.handed
        finally:
            self.local.handed = None


TAP = CollectiveTap()  # the process's one tap; nothing is wrapped until TAP.install()
