"""Interoperability with jingyaogong/minimind and Hugging Face transformers.

- `minimind`: MiniMind's own weight file, `{weight}_{hidden_size}.pth` (the model's state dict in
  half precision, as MiniMind's trainer writes it), read strictly into the dense model's state
  dict and written back.
- `huggingface`: a folder that `transformers.AutoModelForCausalLM.from_pretrained` loads as
  Qwen3 (MiniMind-3's layout under its transformers name): `config.json`, `model.safetensors`,
  `generation_config.json` and the tokenizer files.

Neither module imports transformers: the export is plain JSON and safetensors.
"""
from .huggingface import export_hf, qwen3_config_dict
from .minimind import (check_dense_state, dense_state_dict, load_minimind_state_dict, minimind_weight_name,
                       save_minimind_state_dict)

__all__ = ["check_dense_state", "dense_state_dict", "export_hf", "load_minimind_state_dict", "minimind_weight_name",
           "qwen3_config_dict", "save_minimind_state_dict"]
