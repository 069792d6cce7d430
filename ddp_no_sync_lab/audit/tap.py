"""What a gradient hook hands to the collective, read from the call itself (the checklist's byte witness)."""

import threading
from contextlib import contextmanager

import torch.distributed as dist


class CollectiveTap:
    """What a gradient hook hands to torch.distributed.all_reduce, read from the call itself: each tensor's dtype
    and element count. Installed once per process; it records only inside `handed()` on the calling thread."""

    def __init__(self):
        self.local = threading.local()
        self.original = dist.all_reduce

        def all_reduce(tensor, *args, **kwargs):
            if getattr(self.local, "handed", None) is not None:
                self.local.handed.append((tensor.dtype, tensor.numel()))
            return self.original(tensor, *args, **kwargs)

        dist.all_reduce = all_reduce  # torch's hooks call dist.all_reduce through the package at call time

    @contextmanager
    def handed(self):
        """Yields the list the block's all_reduce calls on this thread append (dtype, element count) to."""
        self.local.handed = []
        try:
            yield self.local.handed
        finally:
            self.local.handed = None


TAP = CollectiveTap()  # installed at import, before anything else wraps torch.distributed.all_reduce
