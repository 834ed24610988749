"""``python -m adaserve.server``: same as ``adaserve serve``."""

import sys

from adaserve.cluster.serve_app import run_replicas
from adaserve.server.cli import main

sys.exit(main(replicas=run_replicas))
