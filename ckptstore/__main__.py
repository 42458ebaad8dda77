"""`python -m ckptstore ...` runs the `ckpt` command line (as `python -m dataloader` runs
`ckpt-data`)."""

import sys

from .cli import main

sys.exit(main())
