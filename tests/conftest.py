import os

# One torch thread per process: the ranks of every test share two cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
