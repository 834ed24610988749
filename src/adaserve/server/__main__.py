"""``python -m adaserve.server``: same as ``adaserve serve``."""

import sys

from adaserve.server.cli import main

sys.exit(main())
