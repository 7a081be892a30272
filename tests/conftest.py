import os

import pytest

# One torch thread per process: the ranks of every test share two cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The suite is the gloo/CPU suite: on a machine with GPUs the launcher would otherwise default
# to CUDA (one GPU per rank) for the command lines the tests run.
os.environ["CUDA_VISIBLE_DEVICES"] = ""

# torch.optim imports torch._dynamo lazily on the first optimizer (seconds of imports). Importing it
# once here, before run_ranks forks, spares every rank of every test that cost.
import torch._dynamo  # noqa: E402,F401

from helpers import write_stdlib_corpus  # noqa: E402


@pytest.fixture(scope="session")
def stdlib_corpus(tmp_path_factory):
    """The stdlib corpus (MiniMind's jsonl, helpers.MAX_DOCS documents), written once per session.
    Read it only: a test that writes next to it (a token cache) works on a copy."""
    return write_stdlib_corpus(tmp_path_factory.mktemp("corpus") / "stdlib.jsonl")
