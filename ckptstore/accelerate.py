"""`ckptstore.accelerate`, the documented import path of the Hugging Face accelerate
integration (the code lives in `ckptstore.training.accelerate`):

    from ckptstore.accelerate import load_state, save_state
    step = load_state(accelerator, mgr) or 0
    save_state(accelerator, mgr, step)
"""

from .training.accelerate import load_state, save_state

__all__ = ["load_state", "save_state"]
