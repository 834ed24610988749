"""``python -m adaserve.train`` == ``adaserve train``."""

import sys

from adaserve.train.cli import main

sys.exit(main())
