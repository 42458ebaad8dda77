"""Keeping a store healthy: `checks` (verify every blob, garbage-collect unreferenced ones)
and `leases` (how saves and gc in different processes keep out of each other's way).

Takes a store and manifests, never a CheckpointStore."""
