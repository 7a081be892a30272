"""The book's entry point: `python -m evaluation.parallel <task> [...] -- [task args]`.

Forwards to minimind_parallel's command line (also `python -m minimind_parallel`)."""
import sys

from minimind_parallel.cli import process_main

if __name__ == "__main__":
    sys.exit(process_main())
