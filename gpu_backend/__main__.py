"""``python -m gpu_backend [flags]``: see :mod:`gpu_backend.cli`."""

import sys

from gpu_backend.cli import main

if __name__ == "__main__":
    sys.exit(main())
