"""``python -m bench [suite ...]``: run the quick mode of every suite (or of the suites named), one
command at a time, each as its own process, and print how long each took."""

from __future__ import annotations

import importlib
import subprocess
import sys
import time

from bench.common import ROOT, SUITES


def main(argv: list[str] | None = None) -> int:
    names = (argv if argv is not None else sys.argv[1:]) or list(SUITES)
    unknown = [n for n in names if n not in SUITES]
    if unknown:
        print(f"unknown suite(s) {', '.join(unknown)}; the suites are {', '.join(SUITES)}", file=sys.stderr)
        return 2
    failed = []
    for suite in names:
        for command in importlib.import_module(f"bench.{suite}").QUICK:
            print(f"== python -m {' '.join(command)}", flush=True)
            start = time.monotonic()
            status = subprocess.call([sys.executable, "-m", *command], cwd=ROOT)
            print(f"== {command[0]}: exit {status} after {time.monotonic() - start:.0f} s", flush=True)
            if status:
                failed.append(command[0])
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
