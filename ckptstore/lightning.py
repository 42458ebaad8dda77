"""`ckptstore.lightning`, the documented import path of the Lightning plugin (the code lives in
`ckptstore.training.lightning`)."""

from .training.lightning import (
    CkptStoreCheckpointIO,
    checkpoint_name,
    lightning_path,
    load_from_checkpoint,
)

__all__ = ["CkptStoreCheckpointIO", "checkpoint_name", "lightning_path", "load_from_checkpoint"]
