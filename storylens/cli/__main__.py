"""``python -m storylens.cli``: the same as ``python -m storylens``."""

import sys

from storylens.cli import main

sys.exit(main())
