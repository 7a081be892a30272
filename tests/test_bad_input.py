"""Bad input is refused before any process starts: exit 2 and one line naming the constraint and
the values, nothing launched, nothing written. Every list is one family of inputs; the pipeline's
own are in tests/test_pipeline.py."""
import json
import os
import shutil

import pytest
import torch

from minimind_parallel import cli, launcher, options
from minimind_parallel.config import ConfigError
from minimind_parallel.memory import predict_memory
from test_cli import assert_refused_before_launch
from test_train import checkpointed, corpus  # noqa: F401  (the fixtures)

# ---------------------------------------------------------------- sizes, layouts and flags

VALIDATE = [
    (["validate", "--tp_size", "3", "--"], "num_attention_heads must be divisible by tp_size"),
    (["validate", "--tp_size", "2", "--", "--num_attention_heads", "4", "--num_key_value_heads", "1",
      "--hidden_size", "64"], "num_key_value_heads must be divisible by tp_size"),
    (["validate", "--tp_size", "2", "--", "--num_attention_heads", "6", "--num_key_value_heads", "4"],
     "num_attention_heads must be divisible by num_key_value_heads"),
    (["validate", "--tp_size", "2", "--", "--hidden_size", "100", "--num_attention_heads", "8",
      "--num_key_value_heads", "4"], "hidden_size must be divisible by num_attention_heads"),
    (["validate", "--tp_size", "4", "--", "--vocab_size", "130", "--vocab_parallel"],
     "vocab_size must be divisible by tp_size with --vocab_parallel"),
    (["validate", "--tp_size", "2", "--", "--seq_len", "15", "--sequence_parallel"],
     "seq_len must be divisible by tp_size with --sequence_parallel"),
    (["validate", "--", "--sequence_parallel"], "--sequence_parallel needs tensor parallelism"),
    (["validate", "--", "--async_communication"], "--async_communication needs tensor parallelism"),
    (["validate", "--", "--vocab_parallel"], "--vocab_parallel needs tensor parallelism"),
    (["validate", "--tp_size", "2", "--", "--shared_sp_gather"], "--shared_sp_gather"),
    (["validate", "--tp_size", "0", "--"], "tp size must be >= 1"),
    (["train_fast", "--"], "unknown task"),
    (["validate", "--tp_size", "2", "--", "--mode", "tp_magic"], "unknown mode"),
    (["validate", "--", "--dtype", "float8"], "invalid choice"),
    (["validate", "--device", "cuda", "--"], "CUDA"),
    (["validate", "--tp_size", "2", "--nnodes", "3", "--"], "world size must be divisible by nnodes"),
    (["validate", "--", "--dtype", "float16"], "float16 parameters cannot take AdamW steps"),
    (["validate", "--", "--seq_len", "1"], "seq_len must be >= 2"),
    # found by trying the command line as a new user would
    (["validate", "--", "--hidden_size", "24", "--num_attention_heads", "8", "--num_key_value_heads", "4"],
     "head_dim must be even (rotary embeddings rotate pairs of channels); got head_dim=3 (hidden_size=24 / "
     "num_attention_heads=8)"),
    (["validate", "--", "--intermediate_size", "0"], "intermediate_size must be >= 1; got intermediate_size=0"),
    (["validate", "--", "--intermediate_size", "-64"], "intermediate_size must be >= 1; got intermediate_size=-64"),
    (["validate", "--", "--learning_rate", "-0.001"], "learning_rate must be >= 0; got learning_rate=-0.001"),
    (["validate", "--", "--learning_rate", "nan"], "learning_rate must be a finite number; got learning_rate=nan"),
    (["validate", "--", "--log_interval", "0"], "log_interval must be >= 1; got log_interval=0"),
    (["validate", "--", "--optimizer_steps", "-1"], "optimizer_steps must be >= 0; got optimizer_steps=-1"),
    (["validate", "--", "--atol", "-0.001"], "atol must be >= 0; got atol=-0.001"),
    (["validate", "--", "--rtol", "-1"], "rtol must be >= 0; got rtol=-1"),
    (["validate", "--", "--atol", "nan"], "atol must be a finite number; got atol=nan"),
    (["validate", "--tp_size", "2", "--", "--perturb", "no.such.parameter"],
     "--perturb must name a parameter of the model"),
    (["validate", "--", "--perturb", "model.layers.2.mlp.up_proj.weight", "--num_hidden_layers", "2"],
     "got --perturb model.layers.2.mlp.up_proj.weight"),
    (["validate", "--", "--micro_batch_size", "0"], "micro_batch_size must be >= 1"),
    (["validate", "--dp_size", "0", "--"], "dp size must be >= 1"),
    (["validate", "--", "--hidden_size", "0"], "hidden_size must be >= 1"),
    (["validate", "--", "--num_key_value_heads", "0"], "num_key_value_heads must be >= 1"),
    (["validate", "--", "--seq_len", "40000"], "seq_len must be <= max_position_embeddings"),
    (["validate", "--cp_size", "2", "--"], "--cp_size 2 needs --cp"),
    (["validate", "--", "--no_such_flag"], "unrecognized arguments: --no_such_flag"),
    (["validate", "--", "--tp_size", "2"], "unrecognized arguments: --tp_size 2"),
    (["validate", "--tp_size", "two", "--"], "invalid int value: 'two'"),
    # expert parallelism: its ranks are carved out of the DP x CP ones
    (["validate", "--ep_size", "0", "--"], "ep size must be >= 1; got ep=0"),
    (["validate", "--ep_size", "2", "--", "--use_moe"], "ep_size must be <= dp_size x cp_size (the expert-parallel ranks are "
     "carved out of the data- and context-parallel ones); got ep_size=2, dp_size=1, cp_size=1"),
    (["validate", "--ep_size", "2", "--dp_size", "3", "--", "--use_moe"], "ep_size must divide dp_size x cp_size (the "
     "expert-parallel ranks are carved out of the data- and context-parallel ones); got ep_size=2, dp_size=3, "
     "cp_size=1"),
    (["validate", "--ep_size", "2", "--dp_size", "2", "--"],
     "--ep_size 2 spreads the experts of a mixture-of-experts model and needs --use_moe"),
    (["validate", "--ep_size", "4", "--dp_size", "4", "--", "--use_moe", "--num_experts", "6"],
     "num_experts must be divisible by ep_size (each expert-parallel rank holds num_experts / ep_size experts); "
     "got num_experts=6, ep_size=4"),
    (["validate", "--", "--moe_aux_loss", "batch"], "invalid choice: 'batch'"),
]

LAUNCHER = [
    (["validate", "--nnodes", "0", "--"], "nnodes must be >= 1; got nnodes=0"),
    (["validate", "--tp_size", "2", "--nnodes", "2", "--node_rank", "2", "--"],
     "node_rank must be in [0, nnodes); got node_rank=2, nnodes=2"),
    (["validate", "--node_rank", "-1", "--"], "node_rank must be in [0, nnodes); got node_rank=-1, nnodes=1"),
    (["validate", "--master_port", "70000", "--"], "master_port must be a TCP port in 1-65535; got master_port=70000"),
    (["validate", "--master_port", "0", "--"], "master_port must be a TCP port in 1-65535; got master_port=0"),
    (["validate", "--collective_timeout", "0", "--"],
     "collective_timeout must be > 0 seconds; got collective_timeout=0"),
    (["validate", "--collective_timeout", "nan", "--"], "collective_timeout must be a finite number"),
    (["validate", "--rdzv_timeout", "-5", "--"], "rdzv_timeout must be > 0 seconds; got rdzv_timeout=-5"),
    (["validate", "--rdzv_timeout", "inf", "--"], "rdzv_timeout must be a finite number; got rdzv_timeout=inf"),
]


@pytest.mark.parametrize("argv,message", VALIDATE + LAUNCHER, ids=[m for _, m in VALIDATE + LAUNCHER])
def test_bad_input_is_one_line_and_launches_nothing(argv, message, monkeypatch, capsys):
    if "cuda" in argv:  # the check under test: a machine without CUDA asked for cuda
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert_refused_before_launch(argv, message, monkeypatch, capsys)


# ---------------------------------------------------------------- the benchmark's sweep and outputs

def outputs(tmp_path):
    return ["--output_csv", str(tmp_path / "b.csv"), "--output_json", str(tmp_path / "b.json"),
            "--output_plot", str(tmp_path / "b.png")]


BENCHMARK = [
    (["--tp_size", "2", "--", "--modes", "tp", "--num_hidden_layers", "1", "2", "--seq_len", "16", "32"],
     "sweep one dimension at a time"),
    (["--tp_size", "2", "--", "--modes", "tp", "tp_magic"], "unknown mode 'tp_magic'"),
    (["--tp_size", "2", "--", "--modes", "ddp", "tp_sp", "--num_hidden_layers", "1", "--seq_len", "16", "15"],
     "seq_len must be divisible by tp_size with --sequence_parallel; got seq_len=15, tp_size=2"),
    (["--tp_size", "3", "--", "--modes", "ddp", "tp"], "num_attention_heads must be divisible by tp_size"),
    (["--tp_size", "2", "--", "--modes", "tp_vp", "--vocab_size", "129"],
     "vocab_size must be divisible by tp_size with --vocab_parallel"),
    (["--kind", "throughput", "--tp_size", "2", "--", "--modes", "ddp", "tp", "--micro_batch_size", "1"],
     "fixed_global"),
    (["--kind", "throughput", "--tp_size", "2", "--", "--estimate"], "--estimate measures memory"),
    (["--kind", "profile", "--tp_size", "2", "--", "--estimate"],
     "--estimate measures memory without running kernels; got --kind profile"),
    (["--tp_size", "2", "--", "--num_microbatches", "2"], "num_microbatches > 1 needs pipeline parallelism"),
    (["--tp_size", "2", "--", "--benchmark_iters", "0"], "benchmark_iters must be >= 1"),
    (["--tp_size", "2", "--", "--dtype", "float16"], "float16 parameters cannot take AdamW steps"),
    (["--kind", "memory", "--tp_size", "2", "--", "--kind", "throughput"], "--kind given twice"),
    (["--tp_size", "2", "--", "--batch_policy", "per_node"], "invalid choice"),
    (["--tp_size", "2", "--", "--cell_timeout", "0"], "cell_timeout must be > 0 seconds; got cell_timeout=0"),
    # found by trying the command line as a new user would
    (["--tp_size", "2", "--", "--cell_timeout", "nan"], "cell_timeout must be a finite number; got cell_timeout=nan"),
    (["--tp_size", "2", "--", "--warmup_iters", "-1"], "warmup_iters must be >= 0"),
    (["--tp_size", "2", "--", "--learning_rate", "nan"], "learning_rate must be a finite number"),
    (["--tp_size", "2", "--", "--modes", "tp", "--num_hidden_layers", "1", "--hidden_size", "24",
      "--num_attention_heads", "8", "--num_key_value_heads", "4"], "head_dim must be even"),
    (["--nnodes", "0", "--tp_size", "2", "--"], "nnodes must be >= 1"),
    (["--dp_size", "2", "--", "--modes", "ddp", "ep"],
     "mode ep is expert-parallel and needs --ep_size > 1; got --ep_size 1"),
    (["--dp_size", "2", "--ep_size", "2", "--", "--modes", "ep", "--num_experts", "3"],
     "num_experts must be divisible by ep_size"),
    (["--dp_size", "2", "--ep_size", "2", "--", "--modes", "ep", "--routing", "no_such_histogram.json"],
     "argument --routing: not balanced or worst, nor a readable JSON file"),
    (["--dp_size", "2", "--", "--modes", "ddp", "--routing", "worst"],
     "--routing is the routing of MoE cells; no mode of this sweep is MoE (got --routing worst)"),
]


@pytest.mark.parametrize("argv,message", BENCHMARK, ids=[m for _, m in BENCHMARK])
def test_bad_benchmark_input_is_one_line_and_launches_nothing(argv, message, monkeypatch, capsys, tmp_path):
    launched = []
    monkeypatch.setattr(launcher, "run_torchrun", lambda *a, **k: launched.append(a) or 0)
    code = cli.main(["benchmark", *argv, *outputs(tmp_path)] if "--" in argv else ["benchmark", *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and not launched
    assert len(err.splitlines()) == 1 and message in err, err
    assert not (tmp_path / "b.csv").exists()


def test_a_routing_histogram_that_does_not_fit_a_cell_is_refused_in_one_line(monkeypatch, capsys, tmp_path):
    (tmp_path / "routing.json").write_text('{"model.layers.0.mlp": [64, 64, 0, 0]}')
    launched = []
    monkeypatch.setattr(launcher, "run_torchrun", lambda *a, **k: launched.append(a) or 0)
    code = cli.main(["benchmark", "--dp_size", "2", "--ep_size", "2", "--", "--modes", "ep", "--num_hidden_layers", "2",
                     "--seq_len", "32", "--micro_batch_size", "2", "--routing", str(tmp_path / "routing.json"),
                     *outputs(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and not launched and len(err.splitlines()) == 1, err
    assert "--routing, cell ep:2: routing histogram: no counts for MoE layer(s) [1]; got layers [0]" in err, err


def refused(argv, monkeypatch, capsys) -> str:
    """Run the benchmark command line; assert it was refused before launching; -> its one line."""
    launched = []
    monkeypatch.setattr(launcher, "run_torchrun", lambda *a, **k: launched.append(a) or 0)
    code = cli.main(["benchmark", "--tp_size", "2", "--", "--num_hidden_layers", "1", *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and not launched, err
    assert len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize("existing", ["b.csv", "b.json", "b.png"])
def test_an_earlier_runs_outputs_are_not_replaced_without_overwrite(existing, tmp_path, monkeypatch, capsys):
    (tmp_path / existing).write_text("an earlier run's result")
    err = refused(["--output_csv", str(tmp_path / "b.csv")], monkeypatch, capsys)
    assert f"exists (an earlier run's result); got {tmp_path / existing}" in err and "--overwrite" in err
    assert (tmp_path / existing).read_text() == "an earlier run's result"


def test_overwrite_lets_a_run_replace_its_earlier_outputs(tmp_path, monkeypatch):
    (tmp_path / "b.csv").write_text("an earlier run's result")
    launched = []
    monkeypatch.setattr(launcher, "run_torchrun", lambda *a, **k: launched.append(a) or 1)
    cli.main(["benchmark", "--tp_size", "2", "--", "--num_hidden_layers", "1", "--hidden_size", "64",
              "--seq_len", "16", "--output_csv", str(tmp_path / "b.csv"), "--overwrite"])
    assert launched and "an earlier run's result" not in (tmp_path / "b.csv").read_text()


@pytest.mark.parametrize("flags,clash", [
    (["--output_csv", "{d}/same", "--output_json", "{d}/same"], "--output_csv and --output_json name the same file"),
    (["--output_csv", "{d}/b.csv", "--output_plot", "{d}/b.csv"], "--output_csv and --output_plot name the same file"),
    (["--output_json", "{d}/r.json", "--output_plot", "{d}/sub/../r.json"],
     "--output_json and --output_plot name the same file"),
])
def test_two_outputs_on_one_path_are_refused(flags, clash, tmp_path, monkeypatch, capsys):
    err = refused([f.format(d=tmp_path) for f in flags], monkeypatch, capsys)
    assert clash in err


def test_an_output_that_is_a_directory_is_refused(tmp_path, monkeypatch, capsys):
    (tmp_path / "out.csv").mkdir()
    err = refused(["--output_csv", str(tmp_path / "out.csv")], monkeypatch, capsys)
    assert err == f"error: --output_csv is a directory; got {tmp_path / 'out.csv'}"


def test_an_output_under_a_file_is_refused(tmp_path, monkeypatch, capsys):
    (tmp_path / "file").write_text("")
    err = refused(["--output_csv", str(tmp_path / "file" / "sub" / "b.csv")], monkeypatch, capsys)
    assert f"cannot create the directory of --output_csv: {tmp_path / 'file'} is a file" in err
    assert not os.path.exists(tmp_path / "file.tmp")


def test_an_unknown_plot_format_is_refused(tmp_path, monkeypatch, capsys):
    err = refused([*outputs(tmp_path)[:4], "--output_plot", str(tmp_path / "b.xyz")], monkeypatch, capsys)
    assert "--output_plot must end in a format matplotlib writes (" in err and "png" in err
    assert err.endswith(f"got {tmp_path / 'b.xyz'}")


# ---------------------------------------------------------------- what the machine can start and hold

HUGE = ["--hidden_size", "16384", "--num_attention_heads", "128", "--num_key_value_heads", "8",
        "--num_hidden_layers", "256", "--seq_len", "4096"]


def test_a_model_predicted_not_to_fit_the_machine_is_refused(monkeypatch, capsys):
    argv = ["validate", "--tp_size", "2", "--device", "cpu", "--", *HUGE, "--dtype", "bfloat16"]
    assert_refused_before_launch(argv, "predicted memory exceeds the machine: 2 ranks x (256 MiB per process + the "
                                       "worst rank's predicted peak", monkeypatch, capsys)


def test_skip_resource_check_launches_anyway(monkeypatch):
    launched = []
    monkeypatch.setattr(launcher, "run_torchrun", lambda *a, **k: launched.append(a) or 0)
    cli.main(["validate", "--tp_size", "2", "--device", "cpu", "--skip_resource_check", "--", *HUGE,
              "--dtype", "bfloat16"])
    assert launched


def test_more_ranks_than_the_machine_can_start_are_refused(monkeypatch, capsys):
    monkeypatch.setattr(options, "mem_available", lambda: 3 * options.RANK_PROCESS_BYTES)
    assert_refused_before_launch(
        ["validate", "--tp_size", "2", "--dp_size", "2", "--device", "cpu", "--", "--hidden_size", "64"],
        "the machine cannot start 4 ranks: each CPU rank is a process of about 256 MiB before the model, 4 ranks "
        "need 1.0 GiB and 0.8 GiB are available (MemAvailable); pass --skip_resource_check", monkeypatch, capsys)


def test_a_benchmark_cell_predicted_not_to_fit_is_refused_before_the_first_cell(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(launcher, "run_torchrun", lambda *a, **k: pytest.fail("launched"))
    code = cli.main(["benchmark", "--tp_size", "2", "--device", "cpu", "--", "--modes", "tp", "--dtype", "bfloat16",
                     *HUGE[:6], "--num_hidden_layers", "1", "256", "--seq_len", "4096", *outputs(tmp_path)])
    assert code == 2 and "predicted memory exceeds the machine" in capsys.readouterr().err


def test_a_model_predicted_not_to_fit_the_gpu_is_refused(monkeypatch, capsys):
    class Properties:
        total_memory = 2**30
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Properties)
    argv = ["validate", "--tp_size", "2", "--device", "cuda", "--", *HUGE, "--dtype", "bfloat16"]
    assert_refused_before_launch(argv, "predicted memory exceeds the GPU: the worst rank's predicted peak",
                                 monkeypatch, capsys)


@pytest.mark.parametrize("spare,fits", [(0, True), (-1, False)], ids=["fits", "one byte short"])
def test_the_cpu_rule_is_ranks_times_process_plus_the_analytic_peak(spare, fits, monkeypatch):
    """Not a bound picked by hand: refused exactly when ranks x (process + predicted peak) > MemAvailable."""
    job = cli.resolve(["validate", "--tp_size", "2", "--device", "cpu", "--", "--hidden_size", "64"])
    launch, args, par = job.launch, job.task, job.parallel
    peak = predict_memory(options.model_config(args), par, seq_len=args.seq_len, micro_batch_size=2,
                          dtype=torch.float32, device="cpu").peak_bytes
    monkeypatch.setattr(options, "mem_available", lambda: 2 * (options.RANK_PROCESS_BYTES + peak) + spare)
    if fits:
        options.check_resources(launch, [(args, par)])
    else:
        with pytest.raises(ConfigError, match="predicted memory exceeds the machine"):
            options.check_resources(launch, [(args, par)])


# ---------------------------------------------------------------- found only once a task's launch reads its input

def test_a_config_error_found_by_a_tasks_launch_is_one_line(checkpointed, tmp_path, capsys):  # noqa: F811
    """export reads the shards only in its launch: a checkpoint whose meta.json names another model
    than its shards hold (here one layer, the shards two) is found there."""
    mixed = tmp_path / "mixed"
    shutil.copytree(checkpointed, mixed)
    (meta_path,) = mixed.glob("step_*/meta.json")
    meta = json.loads(meta_path.read_text())
    meta["config"]["num_hidden_layers"] = 1
    meta_path.write_text(json.dumps(meta))
    code = cli.main(["export", "--", "--checkpoint", str(mixed), "--format", "minimind", "--out",
                     str(tmp_path / "out.pth")])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: ") and "unknown key model.layers.1." in err
    assert not (tmp_path / "out.pth").exists()


# ---------------------------------------------------------------- a checkpoint that is not there

@pytest.mark.parametrize("task", ["export", "generate"])
def test_a_missing_checkpoint_directory_is_said_not_to_exist(task, tmp_path, monkeypatch, capsys):
    absent = tmp_path / "runs" / "absent"
    tail = (["--format", "minimind", "--out", str(tmp_path / "x.pth")] if task == "export"
            else ["--tokenizer_path", str(tmp_path / "tokenizer"), "--prompt", "Return the"])
    assert_refused_before_launch([task, "--", "--checkpoint", str(absent), *tail],
                                 f"checkpoint directory {absent} does not exist", monkeypatch, capsys)
