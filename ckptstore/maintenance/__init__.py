"""Keeping a store healthy: `checks` (verify every blob, garbage-collect unreferenced ones),
`leases` (how saves and gc in different processes keep out of each other's way) and
`transfer` (the one protocol that copies checkpoints into a store: `ckpt cp` and
replication).

Takes stores and manifests, never a CheckpointStore."""
