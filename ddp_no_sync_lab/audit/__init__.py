"""What a run did, observed as it happened, in every rank: the collective's bytes, the loss's divisor, the
checklist's witnesses, the clock and counts, the profiler. verify.py judges what they saw (checks/).

    tap           what a gradient hook hands to torch.distributed.all_reduce, read from the call
    clipping      which gradients clip_grad_norm_ scaled, and by what factor, read from the call
    orders        the order each DistributedSampler handed its loader, read from the iteration
    memory        what a forward leaves held for its backward, what a rank holds between micro-batches
    scale         the loss's divisor read at each loss and fitted at the logits, their bounds, how it is recorded
    projection    the gradients' float64 projection: every gradient read at once, whole or as a rank's shard
    checklist     the document's checklist observed: witnesses of what a run did, summed per epoch
    instruments   the collective clock and counts, the ranks' step fingerprints, the epoch's trace, shard coverage
    profiler      the profiler over K windows, the audit's second witness, and verify's check of it
    face          the audit's public face: install, a counting hook around any hook, the witnesses attached
"""
