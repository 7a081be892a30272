import os

# One torch thread per process: the ranks of every test share two cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# torch.optim imports torch._dynamo lazily on the first optimizer (seconds of imports). Importing it
# once here, before run_ranks forks, spares every rank of every test that cost.
import torch._dynamo  # noqa: E402,F401
