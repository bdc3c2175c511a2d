"""``python -m autoshard``: the ``autoshard`` command, for environments without its script on PATH."""

import sys

from autoshard.cli import main

sys.exit(main())
