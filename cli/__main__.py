"""`python -m kvgate.cli`: the `kvgate` command."""

import sys

from kvgate.cli import main

sys.exit(main())
