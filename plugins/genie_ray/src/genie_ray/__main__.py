"""``python -m genie_ray up|down|status``: the same as ``genie ray ...``."""

import sys

from genie_ray.cli import main

sys.exit(main())
