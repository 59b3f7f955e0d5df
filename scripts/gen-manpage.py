"""Write docs/man/gpusched.1 from the CLI's argparse parser (`--check`: exit 1 when it differs).

    python scripts/gen-manpage.py [--check] [--out PATH]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gpusched.cli.main import build_parser, version
from gpusched.cli.manpage import render

PAGE = Path(__file__).resolve().parents[1] / "docs" / "man" / "gpusched.1"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    parser.add_argument("--out", type=Path, default=PAGE)
    args = parser.parse_args()
    page = render(build_parser(), version())
    if args.check:
        if not args.out.exists() or args.out.read_text() != page:
            print(f"{args.out} is out of date: run python scripts/gen-manpage.py", file=sys.stderr)
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(page)
    print(f"wrote {args.out} ({len(page.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
