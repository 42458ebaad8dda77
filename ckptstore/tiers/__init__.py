"""Tiered repositories: one checkpoint store over several locations, nearest first.

Sits between maintenance/ and repository/: these modules take stores and manifests, never
a CheckpointStore (repository/tiered.py composes them).

    config.py       the tier list: URIs, per-tier options, {rank}/{node} placeholders
    pending.py      tier-0 records of checkpoints still to replicate (found again on reopen)
    replication.py  copy one checkpoint to the next tier (the copy protocol of
                    maintenance/transfer.py) and the background Replicator with its retries
    far.py          a later tier's store: opened on first use, known down after a failure

Restores from the nearest good copy use the reader's fallback sources
(pipeline/reader.py); repository/tiered.py repairs the nearer tiers (TieredStore._repair). Peer
replicas over torch.distributed are training/peers.py.
"""
