"""`python -m ckptstore.cli ...` runs the `ckpt` command line."""

import sys

from . import main

sys.exit(main())
