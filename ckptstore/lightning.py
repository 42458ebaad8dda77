"""`ckptstore.lightning`, the documented import path of the Lightning plugin (the code lives in
`ckptstore.training.lightning`)."""

from .training.lightning import CkptStoreCheckpointIO, checkpoint_name

__all__ = ["CkptStoreCheckpointIO", "checkpoint_name"]
