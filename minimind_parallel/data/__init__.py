"""Data: the batches every task feeds the models, and pretraining data for MiniMind-3.

- `batches`: batches of token ids and next-token targets (labels shifted once, here), split over
  data-parallel ranks and microbatches; the one place a real dataset and a context-parallel split
  plug in.

- `corpus`: a corpus that needs no download (the documentation strings of Python's standard
  library) written as MiniMind-style jsonl, one `{"text": ...}` per line.
- `tokenizer`: a ByteLevel BPE tokenizer trained with Hugging Face `tokenizers` in MiniMind's
  format (`<|endoftext|>`=0 pad, `<|im_start|>`=1 bos, `<|im_end|>`=2 eos), and its loader.
- `token_cache`: a jsonl tokenised once into a memory-mapped uint16 token file plus an index of
  document offsets, cached next to the data and reused while data and tokenizer are unchanged.
- `jsonl`: reading MiniMind-style jsonl, bad input refused with one line (its line number).
- `files`: atomic file writing (unique temporary name, then rename).
- `identity`: a data file's identity (size, hash of head and tail), saved with a checkpoint and
  checked before a resume.
- `chat_template`, `chat`: MiniMind-3's ChatML chat template (the tokenizer carries it) and
  conversation rows `{"conversations": [...]}` checked and rendered with it (tools, tool calls,
  reasoning), a row without an assistant turn or a tokenizer without a template refused in one line.
- `sft`: MiniMind's supervised fine-tuning rows on the token cache of the rendered conversations
  (truncated, padded; labels -100 outside the assistant spans).
- `conversations`: a conversation corpus with no download (questions about the standard library
  answered by its docstrings), MiniMind's SFT jsonl.
- `pretrain`: MiniMind's pretraining rows (bos + text + eos, padded; labels -100 at padding) on the
  cache, the deterministic data-parallel sampler whose position is saved with a checkpoint, and a
  loading-throughput measurement.
"""
