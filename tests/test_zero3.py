"""--zero 3 (FSDP2's fully_shard over the DP x CP mesh) in the benchmark: a cell runs it, its meter
counting this rank's shards (the padded dim-0 rows FSDP2 keeps), not the DTensors' global sizes.
(Its numbers, checkpoints and train runs are tests/test_zero.py's.)"""
import json

import torch

from distributed import run_ranks
from minimind_parallel import cli, tasks
from minimind_parallel.job import read_job, write_job
from minimind_parallel.tasks.benchmark.cells import cell_job
from minimind_parallel.tasks.benchmark.checks import check_benchmark
from minimind_parallel.tasks.benchmark.rank import run_cell
from minimind_parallel.model import MiniMindForCausalLM


BENCH = ["--num_hidden_layers", "2", "--seq_len", "32", "--hidden_size", "64", "--num_attention_heads", "8",
         "--num_key_value_heads", "4", "--vocab_size", "250", "--micro_batch_size", "2", "--dtype", "float32",
         "--warmup_iters", "1", "--benchmark_iters", "1"]


def _bench_rank(job_path):
    run_cell(read_job(job_path, lambda name: tasks.get(name).parser()), torch.device("cpu"))


def test_a_zero3_benchmark_cell_meters_this_ranks_shards(tmp_path):
    job = cli.resolve(["benchmark", "--kind", "memory", "--dp_size", "2", "--", "--modes", "zero3", *BENCH])
    (run,) = check_benchmark(job)
    report = tmp_path / "cell.json"
    cell = cell_job(job, run, report=str(report), profile_dir=None)
    run_ranks(_bench_rank, 2, write_job(cell, str(tmp_path / "job.json")))   # what the launcher hands torchrun
    result = json.loads(report.read_text())
    dense = MiniMindForCausalLM(cell.model)
    # rank 0's Shard(0) rows of every parameter: ceil(dim 0 / 2) rows (FSDP2 pads dim 0 to the mesh)
    shards = sum(-(-p.shape[0] // 2) * (p.numel() // p.shape[0]) * 4 for p in dense.parameters())
    buffers = sum(b.numel() * b.element_size() for b in dense.buffers())
    assert result["breakdown"]["params"] == shards + buffers
    # AdamW's exp_avg and exp_avg_sq of those rows (rank 0's are never padding), a float32 step per parameter
    assert result["breakdown"]["optimizer"] == 2 * shards + 4 * len(list(dense.parameters()))



def test_the_tp_sp_async_zero3_mode_is_fsdp2_over_the_tp_shards():
    job = cli.resolve(["benchmark", "--kind", "memory", "--tp_size", "2", "--dp_size", "2", "--", "--modes",
                       "tp_sp_async_zero3", *BENCH])
    (run,) = check_benchmark(job)
    par = run.par
    assert (par.tp, par.dp, par.zero, par.sequence_parallel, par.async_communication) == (2, 2, 3, True, True)
