"""The order a DistributedSampler handed its loader, read from the iteration itself (the samples witness of
checklist item 2): what the epoch delivered, not the sampler's plan for it."""

import weakref

from torch.utils.data.distributed import DistributedSampler


class OrderTap:
    """Each DistributedSampler's last order as it was iterated. Installed once per process, on request (install)."""

    def __init__(self):
        self.orders = weakref.WeakKeyDictionary()
        self.original = None  # DistributedSampler.__iter__ as install found it

    def install(self):
        """Wrap DistributedSampler.__iter__, once per process (a second call changes nothing)."""
        if self.original is None:
            self.original = DistributedSampler.__iter__

            def __iter__(sampler):
                order = list(self.original(sampler))
                self.orders[sampler] = order
                return iter(order)

            DistributedSampler.__iter__ = __iter__
        return self

    def delivered(self, sampler):
        """The order `sampler` was last iterated in; an error where the tap never saw it iterated."""
        if sampler not in self.orders:
            raise RuntimeError("no iteration of this sampler was seen: install the audit's face before the loop runs")
        return self.orders[sampler]


ORDERS = OrderTap()  # the process's one; nothing is wrapped until ORDERS.install()
