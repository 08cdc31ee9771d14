"""The config.json dicts the config-reading tests start from (``tests/test_fields.py``,
``tests/test_properties_checkpoints.py``): a Qwen3 dense target, a Qwen3.5 text model and a Qwen3 target declaring
an MTP head."""

from __future__ import annotations

from tests.helpers.qwen3_5_checkpoints import text_config

QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 4096, "hidden_size": 64,
         "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 24, "max_position_embeddings": 512, "tie_word_embeddings": False, "bos_token_id": 0,
         "eos_token_id": 1, "pad_token_id": 2, "rms_norm_eps": 1e-6, "attention_bias": False,
         "use_sliding_window": False, "layer_types": ["full_attention"] * 3,
         "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
QWEN3_5 = {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", **text_config()}
MTP = {**QWEN3, "mtp_num_hidden_layers": 1}
