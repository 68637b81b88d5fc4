"""``python -m normlab_lab``: the lab's command line (:func:`normlab_lab.cli.main`)."""

import sys

from normlab_lab.cli import main

if __name__ == "__main__":  # not again in a worker process that imports the main module
    sys.exit(main())
