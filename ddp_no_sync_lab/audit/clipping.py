"""Gradient-norm clipping read from the call itself: which gradients `torch.nn.utils.clip_grad_norm_` scaled, and by
what factor, so that the checklist's witnesses tell a clip of the synchronized gradient from an alteration."""

import weakref

import torch
from torch.nn.utils import clip_grad


class ClipTap:
    """Each call of clip_grad_norm_, reported to the witnesses listening: the ids of the parameters it was given and
    the factor it multiplied their gradients by, recomputed from the norm it returned as torch computes it.
    Installed once per process, on request (install)."""

    def __init__(self):
        self.listeners = weakref.WeakSet()
        self.original = None  # clip_grad_norm_ as install found it

    def install(self):
        """Wrap clip_grad_norm_ where scripts reach it (torch.nn.utils and its clip_grad module), once per process
        (a second call changes nothing); a script that imported the function itself before this is not seen."""
        if self.original is None:
            self.original = clip_grad.clip_grad_norm_

            def clip_grad_norm_(parameters, max_norm, *args, **kwargs):
                parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
                total_norm = self.original(parameters, max_norm, *args, **kwargs)
                factor = torch.clamp(float(max_norm) / (total_norm + 1e-6), max=1.0)  # torch's own arithmetic
                clipped = {id(parameter) for parameter in parameters}
                for listener in list(self.listeners):
                    listener.on_clip(clipped, factor)
                return total_norm

            clip_grad.clip_grad_norm_ = clip_grad_norm_
            torch.nn.utils.clip_grad_norm_ = clip_grad_norm_
        return self


CLIPS = ClipTap()  # the process's one; nothing is wrapped until CLIPS.install()
