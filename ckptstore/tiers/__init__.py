"""Tiered repositories: one checkpoint store over several locations, nearest first.

Sits between maintenance/ and repository.py: these modules take stores and manifests, never
a CheckpointStore (the facade composes them).

    config.py       the tier list: URIs, per-tier options, {rank}/{node} placeholders
    pending.py      tier-0 records of checkpoints still to replicate (found again on reopen)
    replication.py  copy one checkpoint to the next tier (verified, create-only) and the
                    background Replicator with its retries
    nearest.py      restore sources: each chunk from the nearest tier holding a good copy,
                    repairing the nearer ones
"""
