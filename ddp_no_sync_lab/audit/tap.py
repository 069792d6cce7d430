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
                for handed in getattr(self.local, "open", ()):
                    handed.append((tensor.dtype, tensor.numel()))
                return self.original(tensor, *args, **kwargs)

            dist.all_reduce = all_reduce
        return self

    @contextmanager
    def handed(self):
        """Yields the list the block's all_reduce calls on this thread append (dtype, element count) to; nested
        blocks (a counted hook inside another's, the watcher's around a script's) each see every call."""
        handed = []
        self.local.open = (*getattr(self.local, "open", ()), handed)
        try:
            yield handed
        finally:
            self.local.open = tuple(other for other in self.local.open if other is not handed)


TAP = CollectiveTap()  # the process's one tap; nothing is wrapped until TAP.install()
