"""The lab's machinery beneath the document's scripts (train.py, verify.py, infer.py, check_env.py), one module
per concern; docs/architecture.md draws what flows between them.

    cli           errors as one line that names the remedy, argparse with such lines, progress on stderr
    tap           what a gradient hook hands to torch.distributed.all_reduce, read from the call
    experiment    the documented configuration, the window plan, the exact counts a configuration implies
    memory        what a forward leaves held for its backward, what a rank holds between micro-batches
    precision     BF16 autocast or float32, chosen for the hardware
    pictures      the pictures, drawn with Pillow
    records       the run folder written all or nothing, the run's configuration, rows and results, read back
    scale         the loss's divisor read at each loss and fitted at the logits, their bounds, how it is recorded
    checklist     the document's checklist observed: witnesses of what a run did, summed per epoch
    data          CIFAR-10's two layouts, the decode cache, the seeded split and the samplers
    loaders       the two loaders (tensor, PIL) over the split, and an epoch's batches from any batch on
    packed        the text task's corpus, split by document, packed rows, and the tokens of every window
    language      the text task's byte transformer, its per-token loss, evaluation, continuation and report
    audit         the instruments beside DDP: clock, counts, AuditedDDP, settings check, fingerprints, memory
    sharded       FSDP2 beside DDP: the CNN under fully_shard, its collectives counted, its reduction made the mean
    launch        where a process runs, and every rank's agreement on options, device, precision and data
    resume        the run's state saved at epochs' and windows' ends, resumed bit for bit; SIGTERM as a stop
    profiler      the profiler over K windows, the audit's second witness, and verify's check of it
    certify       verify.py's check of each checklist item against the witnesses, one function per item; the table
    strict_audit  the strict audit: the documented experiment key by key, on real data, learned; per-token weights
    checks        the facts verify.py checks, one function per artifact or fact
    tables        what verify.py prints and draws once every check has held

A module imports only modules listed above it (and model.py, which imports nothing of the lab);
tests/test_architecture.py checks it.
"""
