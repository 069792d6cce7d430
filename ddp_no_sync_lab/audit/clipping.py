"""Gradient-norm clipping read from the call itself: which gradients torch scaled to a norm, and by what factor, so
that the checklist's witnesses tell a clip of the synchronized gradient from an alteration."""

import weakref

import torch
from torch.nn.utils import clip_grad


class ClipTap:
    """Each scaling of gradients to a norm (torch's `_clip_grads_with_norm_`, which `clip_grad_norm_` calls, and its
    public alias `clip_grads_with_norm_`), reported to the witnesses listening: the ids of the parameters it was
    given and the factor it multiplied their gradients by, computed as torch computes it. Installed once per
    process, on request (install)."""

    def __init__(self):
        self.listeners = weakref.WeakSet()
        self.original = None  # _clip_grads_with_norm_ as install found it

    def install(self):
        """Wrap the scaling where torch reaches it (clip_grad_norm_ looks it up in its module at each call, so a
        clip_grad_norm_ imported before this is seen too), once per process: a second call changes nothing."""
        if self.original is None:
            self.original = clip_grad._clip_grads_with_norm_

            def clip_grads_with_norm_(parameters, max_norm, total_norm, *args, **kwargs):
                parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
                self.original(parameters, max_norm, total_norm, *args, **kwargs)
                if self.listeners:
                    factor = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)  # torch's own arithmetic
                    scaled = {id(parameter) for parameter in parameters if parameter.grad is not None}
                    for listener in list(self.listeners):
                        listener.on_clip(scaled, factor)

            clip_grad._clip_grads_with_norm_ = clip_grads_with_norm_
            torch.nn.utils.clip_grads_with_norm_ = clip_grads_with_norm_
        return self


CLIPS = ClipTap()  # the process's one; nothing is wrapped until CLIPS.install()
