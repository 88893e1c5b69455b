"""`python -m flashv41`: the command line of flashv41.cli."""

import sys

from flashv41.cli import main

sys.exit(main())
