import gc
import sys

gc.disable()   # no collection walks the imports' objects (alive to the exit: cli.process_main freezes them)
from .cli import process_main  # noqa: E402

sys.exit(process_main())
