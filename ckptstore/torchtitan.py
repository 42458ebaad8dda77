"""`ckptstore.torchtitan`, the documented import path of the torchtitan checkpointer (the code
lives in `ckptstore.training.torchtitan`):

    from ckptstore.torchtitan import CkptStoreCheckpointManager
    config.checkpoint = CkptStoreCheckpointManager.Config(enable=True, interval=500)
"""

from .training.torchtitan import RNG, CkptStoreCheckpointManager

__all__ = ["RNG", "CkptStoreCheckpointManager"]
