"""`python -m scripts.bench` (and `make bench`): the open-ended and input-grounded comparison of open_grounded.py."""

import sys

from scripts.bench.open_grounded import main

if __name__ == "__main__":
    sys.exit(main())
