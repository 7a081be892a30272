#!/usr/bin/env bash
# The GPU path on one CUDA device: NCCL init, validate against the dense model on the GPU, and
# the CUDA memory meter (torch.cuda.max_memory_allocated) beside the analytic model, the
# fake-tensor estimate and the allocator's prediction from a CPU, at the book's section 4.1 model
# size; MiniMind's MoE (validate, and step time with the grouped expert GEMMs); then step time,
# and a short train run (stopped half-way, resumed), export and generate.
# One GPU means world size 1 (NCCL refuses two ranks on one device), so TP/SP/PP on NCCL need a
# multi-GPU machine. Written for a few minutes of GPU time (about 5 on an H200, most of it starting jobs).
#   bash scripts/gpu_check.sh [OUT_DIR]
set -u
out=${1:-results/gpu_check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
py=${PYTHON:-python3}
tiny="--hidden_size 64 --num_attention_heads 8 --num_key_value_heads 4 --vocab_size 128 --seq_len 32 --num_hidden_layers 2"
seed="--hidden_size 768 --num_attention_heads 8 --num_key_value_heads 4 --vocab_size 6400 --seq_len 2048 --micro_batch_size 2"
$py -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
echo "== validate: float32 and bfloat16, NCCL world 1, 3 AdamW steps"
$py -m evaluation.parallel validate --tp_size 1 --pp_size 1 --device ${DEVICE:-cuda} -- $tiny --dtype float32 --optimizer_steps 3
$py -m evaluation.parallel validate --tp_size 1 --pp_size 1 --device ${DEVICE:-cuda} -- $tiny --dtype bfloat16 --optimizer_steps 3
echo "== memory on CUDA (allocator peak) beside the analytic model"
$py -m evaluation.parallel benchmark --kind memory --tp_size 1 --pp_size 1 --device ${DEVICE:-cuda} -- --modes ddp \
  --num_hidden_layers 1 2 4 8 $seed --dtype bfloat16 --warmup_iters 1 --benchmark_iters 3 \
  --overwrite --output_csv "$out/cuda_memory.csv" --output_json "$out/cuda_memory.json" --output_plot "$out/cuda_memory.png"
echo "== the same cells under --estimate (fake tensors, CPU tracker)"
$py -m evaluation.parallel benchmark --kind memory --tp_size 1 --pp_size 1 -- --estimate --modes ddp \
  --num_hidden_layers 1 2 4 8 $seed --dtype bfloat16 \
  --overwrite --output_csv "$out/estimate_memory.csv" --output_json "$out/estimate_memory.json" --output_plot "$out/estimate_memory.png"
echo "== the allocator's predicted max_memory_allocated (CPU replay, memory/allocator.py) for the same cells"
$py -m evaluation.parallel benchmark --kind memory --tp_size 1 --pp_size 1 --device cuda -- --estimate --modes ddp \
  --num_hidden_layers 1 2 4 8 $seed --dtype bfloat16 --cuda_capability "${CUDA_CAPABILITY:-9.0}" \
  --overwrite --output_csv "$out/allocator_prediction.csv" --output_json "$out/allocator_prediction.json" \
  --output_plot "$out/allocator_prediction.png"
echo "== --recompute selective on CUDA: GQA without repeat_kv copies, lean norms, SwiGLU recompute (validate)"
$py -m evaluation.parallel validate --tp_size 1 --pp_size 1 --device ${DEVICE:-cuda} -- $tiny --dtype float32 --optimizer_steps 3 \
  --recompute selective
$py -m evaluation.parallel validate --tp_size 1 --pp_size 1 --device ${DEVICE:-cuda} -- $tiny --dtype bfloat16 --optimizer_steps 3 \
  --recompute selective
echo "== MiniMind's MoE on CUDA: validate in float32 (per-expert loop) and bfloat16 (torch._grouped_mm at capability >= 9.0)"
$py -m evaluation.parallel validate --tp_size 1 --pp_size 1 --device ${DEVICE:-cuda} -- $tiny --dtype float32 --optimizer_steps 3 \
  --use_moe --num_experts 4 --num_experts_per_tok 2
$py -m evaluation.parallel validate --tp_size 1 --pp_size 1 --device ${DEVICE:-cuda} -- $tiny --dtype bfloat16 --optimizer_steps 3 \
  --use_moe --num_experts 4 --num_experts_per_tok 2
echo "== MoE step time on CUDA: dense, sorted experts (grouped GEMM in bfloat16), MiniMind's loop"
$py scripts/moe_step_time.py --device ${DEVICE:-cuda} --hidden_size 768 --num_hidden_layers 8 --seq_len 2048 --batch 2 --iters 10
$py scripts/moe_step_time.py --device ${DEVICE:-cuda} --dtype bfloat16 --hidden_size 768 --num_hidden_layers 8 --seq_len 2048 --batch 2 --iters 10
echo "== step time on CUDA (ddp, world 1) at the same size, 8 layers"
$py -m evaluation.parallel benchmark --kind throughput --tp_size 1 --pp_size 1 --device ${DEVICE:-cuda} -- --modes ddp ${BENCH_MODES:-} \
  --num_hidden_layers 8 $seed --dtype bfloat16 --warmup_iters 3 --benchmark_iters ${BENCH_ITERS:-20} \
  --overwrite --output_csv "$out/cuda_throughput.csv" --output_json "$out/cuda_throughput.json" --output_plot "$out/cuda_throughput.png"
echo "== train on CUDA (world 1, NCCL): corpus, tokenizer, a run stopped half-way and resumed, export, generate"
data="$out/data"; run="$out/run"
$py -m minimind_parallel.data.corpus --out "$data/stdlib.jsonl"
$py -m minimind_parallel.data.tokenizer --data "$data/stdlib.jsonl" --out "$data/tokenizer" --vocab_size 6400
steps=${TRAIN_STEPS:-400}
train="--data_path $data/stdlib.jsonl --tokenizer_path $data/tokenizer --vocab_size 6400 --hidden_size 512
  --num_hidden_layers 8 --num_attention_heads 8 --num_key_value_heads 4 --max_seq_len 512 --batch_size 16 --accumulation_steps 1
  --learning_rate 1e-3 --max_steps $steps --log_interval $((steps / 8)) --eval_fraction 0.05 --eval_interval $((steps / 4))
  --save_interval $((steps / 2)) --save_dir $run"
$py -m evaluation.parallel train --device ${DEVICE:-cuda} -- $train --stop_at_step $((steps / 2)) --overwrite
$py -m evaluation.parallel train --device ${DEVICE:-cuda} -- $train --resume
$py -m evaluation.parallel export -- --checkpoint "$run" --format hf --out "$run/hf" --tokenizer_path "$data/tokenizer"
$py -m evaluation.parallel generate --device ${DEVICE:-cuda} -- --checkpoint "$run" --tokenizer_path "$data/tokenizer" \
  --prompt "Return the" --max_new_tokens 40
