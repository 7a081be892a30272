"""The book's entry point: `python -m evaluation.parallel <task> [...] -- [task args]`.

Forwards to minimind_parallel's command line (also `python -m minimind_parallel`)."""
import gc
import sys

gc.disable()   # no collection walks the imports' objects (alive to the exit: cli.process_main freezes them)
from minimind_parallel.cli import process_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(process_main())
