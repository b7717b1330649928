"""``python -m router`` runs the ``tiered-router`` command line."""

import sys

from router.cli import main

sys.exit(main())
