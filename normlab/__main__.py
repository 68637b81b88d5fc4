"""``python -m normlab`` runs the command line (see :mod:`normlab.cli`)."""

import sys

from normlab.cli import main

sys.exit(main())
