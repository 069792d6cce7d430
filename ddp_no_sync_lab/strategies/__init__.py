"""The wrappers train_epoch drives (no_sync(), a backward, the optimizer's step, a full state dict) and what the
audit must know of each: its own collectives, its settings, its expected counts.

    surface       the wrapper surface train.py's loop asks of a strategy, declared once (Wrapper)
    ddp           DDP: AuditedDDP, the settings check, DDP's gradient errors in one line
    fsdp          FSDP2: the CNN under fully_shard, its collectives counted, its reduction made the mean
"""
