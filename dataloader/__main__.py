"""``python -m dataloader``: see dataloader.cli."""

import sys

from .cli import main

sys.exit(main())
