"""`dpfleet ledger rekey`: chain the history under the history key and seal it, as the admin's recorded act.

Opening a ledger never does this by itself: a file that is not what its
schema version wrote is refused, and a ledger opened with another key does
not chain to its history. A module of its own, as the command runs on the
store only.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from accounting.ledger.databases import is_postgresql, shown_location
from accounting.ledger.store import default_ledger_path, rekey_ledger
from orchestrator.cli.ledger import ledger_command
from orchestrator.errors import UsageError


@ledger_command
def run_rekey(args: argparse.Namespace) -> int:
    """Check the history, then chain it under --history-key and seal it; print what was found and accepted."""
    path = args.db if args.db and is_postgresql(args.db) else Path(args.db) if args.db else default_ledger_path()
    if isinstance(path, Path) and not path.exists():
        raise UsageError(f"no ledger file at {path}; give the file or URL dpfleet ledger serve --db uses")
    accepted = rekey_ledger(path, args.history_key, args.from_key, args.accept_findings)
    for finding in accepted:
        print(f"accepted and recorded: {finding}")
    print(f"the history of {shown_location(str(path))} is chained under the history key and sealed "
          f"({len(accepted)} finding(s) accepted); dpfleet ledger verify checks it, and dpfleet ledger head gives "
          "its new head to keep elsewhere")
    return 0
