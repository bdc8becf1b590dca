"""Regenerate the checked-in gRPC stubs from accounting/ledger.proto.

    python -m accounting.ledger.generate          # rewrite the stubs
    python -m accounting.ledger.generate --check  # exit 1 if they are stale

The stubs import each other package-relatively, so they live inside
accounting/ledger/ and need no change to sys.path.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

PACKAGE_DIR = Path(__file__).resolve().parent
REPOSITORY_ROOT = PACKAGE_DIR.parents[1]
PROTO = "accounting/ledger.proto"
STUBS = ("ledger_pb2.py", "ledger_pb2_grpc.py")


def generate_stubs() -> dict[str, str]:
    """Run protoc on the .proto and return {file name: text} of the fixed-up stubs."""
    with tempfile.TemporaryDirectory() as output:
        status = protoc.main(
            [
                "grpc_tools.protoc",
                f"-I{REPOSITORY_ROOT}",
                f"--python_out={output}",
                f"--grpc_python_out={output}",
                PROTO,
            ]
        )
        if status != 0:
            raise RuntimeError(f"protoc failed on {PROTO} with status {status}; see its message above")
        generated = Path(output) / "accounting"
        stubs = {name: (generated / name).read_text() for name in STUBS}
    absolute = "from accounting import ledger_pb2 as accounting_dot_ledger__pb2"
    if absolute not in stubs["ledger_pb2_grpc.py"]:
        raise RuntimeError(f"protoc's service stub no longer contains {absolute!r}; update generate.py")
    stubs["ledger_pb2_grpc.py"] = stubs["ledger_pb2_grpc.py"].replace(
        absolute, "from . import ledger_pb2 as accounting_dot_ledger__pb2"
    )
    # The module name protoc derives from the .proto's path, for the classes' __module__.
    module = "'accounting.ledger_pb2'"
    if module not in stubs["ledger_pb2.py"]:
        raise RuntimeError(f"protoc's message stub no longer names the module {module}; update generate.py")
    stubs["ledger_pb2.py"] = stubs["ledger_pb2.py"].replace(module, "'accounting.ledger.ledger_pb2'")
    return stubs


def stale_stubs() -> list[str]:
    """Names of checked-in stubs that differ from freshly generated ones."""
    return [
        name
        for name, text in generate_stubs().items()
        if not (PACKAGE_DIR / name).exists() or (PACKAGE_DIR / name).read_text() != text
    ]


def main(argv: list[str] | None = None) -> int:
    """Write the stubs, or with --check report stale ones and return 1."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only check that the checked-in stubs are current")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_stubs()
        if stale:
            print(f"stale: {', '.join(stale)}; run python -m accounting.ledger.generate", file=sys.stderr)
            return 1
        return 0
    for name, text in generate_stubs().items():
        (PACKAGE_DIR / name).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
