"""Times one pass of train-draft's prompt source (draft_data.file_snippets over every standard-library file), with
this checkout's draft_data.py and, with --rev, with the one of an earlier commit; checks both give the same snippets.

    PYTHONPATH=. python scripts/time_stdlib_snippets.py [--rev 5309313]
"""
from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time

from oasiskv.lookahead import draft_data


def module_at(rev: str):
    source = subprocess.run(["git", "show", f"{rev}:oasiskv/lookahead/draft_data.py"], check=True,
                            capture_output=True, text=True).stdout
    path = tempfile.NamedTemporaryFile("w", suffix=".py", delete=False)
    path.write(source)
    path.close()
    spec = importlib.util.spec_from_file_location(f"draft_data_{rev}", path.name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def one_pass(module, files: list[str]) -> tuple[float, list]:
    start = time.perf_counter()
    snippets = [(s.name, s.source) for f in files for s in module.file_snippets(f)]
    return time.perf_counter() - start, snippets


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rev", help="also time draft_data.py as of this commit")
    args = p.parse_args()
    files = draft_data.stdlib_files()
    seconds, snippets = one_pass(draft_data, files)
    print(f"this checkout: {len(files)} files, {len(snippets)} snippets in {seconds:.1f} s")
    if args.rev:
        old_seconds, old_snippets = one_pass(module_at(args.rev), files)
        print(f"{args.rev}: {len(old_snippets)} snippets in {old_seconds:.1f} s; same snippets: {old_snippets == snippets}")


if __name__ == "__main__":
    main()
