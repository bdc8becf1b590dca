"""`python -m orchestrator.cli`: the `dpfleet` command without the console script."""

import sys

from orchestrator.cli import main

sys.exit(main())
