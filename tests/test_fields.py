"""The declared-field reader (convert/fields.py: ``declared``, ``Reader``) and the four families' args read through
it (issue #42): every config the fixtures and the seeded test checkpoints have gives the args the hand-written
parsers gave (``GOLDEN``: their values, recorded from those parsers before the change), and each refusal keeps its
message (``CASES``: one edit of a valid config each, the message or value the hand-written parsers gave).
"""

import ast
import dataclasses
import json
from pathlib import Path

import pytest

from convert import fields
from convert.errors import InputError
from convert.models.dflash2 import DFlash2Args
from convert.models.mtp import MTPArgs
from convert.models.qwen3 import Qwen3Args
from convert.models.qwen3.config import DecoderArgs
from convert.models.qwen3_5 import Qwen35Args
from tests.helpers import checkpoints, mtp_checkpoints, qwen3_5_checkpoints
from tests.helpers.configs import MTP, QWEN3, QWEN3_5
from tests.helpers.dflash2_checkpoints import tiny_config as dflash2_config

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
READERS = {"qwen3": Qwen3Args, "qwen3_5": Qwen35Args, "dflash2": DFlash2Args, "mtp": MTPArgs}
WHERE = "ckpt/config.json"

BASES = {
    "QWEN3": QWEN3,
    "QWEN3_5": QWEN3_5,
    "QWEN3_5-nested": {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
                       "tie_word_embeddings": False,
                       "text_config": {k: v for k, v in QWEN3_5.items() if k != "tie_word_embeddings"}},
    "DFLASH2": dflash2_config(),
    "MTP": MTP,
    "MTP-nested": {"model_type": "qwen3_5", "tie_word_embeddings": False, "text_config": {
        **{k: v for k, v in MTP.items() if k not in ("architectures", "tie_word_embeddings")},
        "model_type": "qwen3_5_text"}},
}


def edited(base: str, edits) -> dict:
    """``BASES[base]`` with each (dotted path, value) set; the value ``"DEL"`` removes the key."""
    config = json.loads(json.dumps(BASES[base]))
    for path, value in edits:
        *parents, key = path.split(".")
        target = config
        for parent in parents:
            target = target[parent]
        if value == "DEL":
            target.pop(key, None)
        else:
            target[key] = value
    return config


def seeded_configs(directory: Path) -> dict[str, dict]:
    """The configs of the fixtures and of the seeded test checkpoints (written here as the tests write them)."""
    configs = {f"fixtures/{p.parent.name}": json.loads(p.read_text()) for p in sorted(FIXTURES.glob("*/config.json"))}
    for name, write in {
        "qwen3": lambda d: checkpoints.write_checkpoint(d),
        "qwen3-v4": lambda d: checkpoints.write_checkpoint(d, v4_config=True),
        "qwen3_5": lambda d: qwen3_5_checkpoints.write_checkpoint(d),
        "qwen3_5-conditional": lambda d: qwen3_5_checkpoints.write_checkpoint(d, conditional=True),
        "mtp-qwen3.5": lambda d: mtp_checkpoints.write_target_with_head(d, layout="qwen3.5"),
        "mtp-deepseek": lambda d: mtp_checkpoints.write_target_with_head(d, layout="deepseek"),
    }.items():
        write(directory / name)
        configs[f"seeded/{name}"] = json.loads((directory / name / "config.json").read_text())
    configs["seeded/mtp-qwen3_5-text"] = mtp_checkpoints.qwen35_text_config(configs["seeded/qwen3"], gated=True,
                                                                             partial_rotary_factor=0.5)
    for version in ("dflash2", "dflash"):
        for window in (48, None):
            configs[f"seeded/{version}-window-{window}"] = dflash2_config(version, window=window)
    configs["seeded/dflash2-mixed"] = dflash2_config(layer_types=["full_attention", "sliding_attention"])
    v4 = dflash2_config(window=None, rope_theta=1e6, block_size=16)
    del v4["rope_parameters"], v4["dflash_config"]["block_size"]
    configs["seeded/dflash2-v4"] = v4
    return configs


def values(args) -> dict:
    """The args' fields, each as its repr (so that 1 and 1.0, or a list and a tuple, differ)."""
    return {f.name: repr(getattr(args, f.name)) for f in dataclasses.fields(args)}


# ------------------------------------------------------------------------------------- the families' args, unchanged

GOLDEN = {  # (config, reader) -> the field reprs the hand-written parsers gave
    ('fixtures/stdlib-qwen3', 'qwen3'): {
        'hidden_size': '256', 'num_hidden_layers': '8', 'num_attention_heads': '8', 'num_key_value_heads': '2',
        'head_dim': '64', 'intermediate_size': '1024', 'vocab_size': '8192', 'rms_norm_eps': '1e-06',
        'rope_theta': '10000.0', 'tie_word_embeddings': 'False', 'max_position_embeddings': '2048',
        'attention_bias': 'False', 'bos_token_id': '0', 'eos_token_id': '1', 'pad_token_id': '2', 'mtp_layers': '0',
    },
    ('fixtures/stdlib-qwen3-dflash2', 'dflash2'): {
        'architecture': "'DFlash2DraftModel'", 'hidden_size': '256', 'intermediate_size': '768',
        'num_hidden_layers': '2', 'num_attention_heads': '8', 'num_key_value_heads': '2', 'head_dim': '64',
        'vocab_size': '8192', 'rms_norm_eps': '1e-06', 'rope_theta': '10000.0', 'layer_windows': '(2048, 2048)',
        'target_layer_ids': '(1, 2, 4, 5, 6)', 'block_size': '8', 'mask_token_id': '3', 'conv_kernel_size': '2',
        'conv_group_size': '16', 'selector_rank': '32', 'selector_top_k': '16',
        'tap_convention': "'output-of-layer-0-based'",
    },
    ('fixtures/stdlib-qwen3-mtp', 'qwen3'): {
        'hidden_size': '256', 'num_hidden_layers': '8', 'num_attention_heads': '8', 'num_key_value_heads': '2',
        'head_dim': '64', 'intermediate_size': '1024', 'vocab_size': '8192', 'rms_norm_eps': '1e-06',
        'rope_theta': '10000.0', 'tie_word_embeddings': 'False', 'max_position_embeddings': '2048',
        'attention_bias': 'False', 'bos_token_id': '0', 'eos_token_id': '1', 'pad_token_id': '2', 'mtp_layers': '1',
    },
    ('fixtures/stdlib-qwen3-mtp', 'mtp'): {
        'hidden_size': '256', 'num_attention_heads': '8', 'num_key_value_heads': '2', 'head_dim': '64',
        'intermediate_size': '1024', 'vocab_size': '8192', 'rms_norm_eps': '1e-06', 'rope_theta': '10000.0',
        'tie_word_embeddings': 'False', 'attention_bias': 'False', 'max_position_embeddings': '2048',
        'num_hidden_layers': '8', 'mtp_layers': '1', 'zero_centred_norm': 'False', 'model_type': "'qwen3'",
        'attn_output_gate': 'False', 'rotary_dim': '64',
    },
    ('fixtures/stdlib-qwen3_5', 'qwen3_5'): {
        'hidden_size': '256', 'num_hidden_layers': '8',
        'layer_types': ("('linear_attention', 'linear_attention', 'linear_attention', 'full_attention', 'linear_at"
                        "tention', 'linear_attention', 'linear_attention', 'full_attention')"),
        'num_attention_heads': '4', 'num_key_value_heads': '2', 'head_dim': '64', 'rotary_dim': '16',
        'rope_theta': '10000.0', 'intermediate_size': '1024', 'vocab_size': '8192', 'rms_norm_eps': '1e-06',
        'tie_word_embeddings': 'False', 'max_position_embeddings': '2048', 'attention_bias': 'False',
        'linear_num_key_heads': '2', 'linear_num_value_heads': '6', 'linear_key_head_dim': '64',
        'linear_value_head_dim': '64', 'linear_conv_kernel_dim': '4', 'bos_token_id': '0', 'eos_token_id': '1',
        'pad_token_id': '2',
    },
    ('fixtures/stdlib-qwen3_5', 'mtp'): {
        'hidden_size': '256', 'num_attention_heads': '4', 'num_key_value_heads': '2', 'head_dim': '64',
        'intermediate_size': '1024', 'vocab_size': '8192', 'rms_norm_eps': '1e-06', 'rope_theta': '10000.0',
        'tie_word_embeddings': 'False', 'attention_bias': 'False', 'max_position_embeddings': '2048',
        'num_hidden_layers': '8', 'mtp_layers': '1', 'zero_centred_norm': 'True', 'model_type': "'qwen3_5_text'",
        'attn_output_gate': 'True', 'rotary_dim': '16',
    },
    ('fixtures/stdlib-qwen3_5-dflash2', 'dflash2'): {
        'architecture': "'DFlash2DraftModel'", 'hidden_size': '256', 'intermediate_size': '768',
        'num_hidden_layers': '2', 'num_attention_heads': '8', 'num_key_value_heads': '2', 'head_dim': '64',
        'vocab_size': '8192', 'rms_norm_eps': '1e-06', 'rope_theta': '10000.0', 'layer_windows': '(2048, 2048)',
        'target_layer_ids': '(1, 3, 4, 5, 6)', 'block_size': '8', 'mask_token_id': '3', 'conv_kernel_size': '2',
        'conv_group_size': '16', 'selector_rank': '32', 'selector_top_k': '16',
        'tap_convention': "'output-of-layer-0-based'",
    },
    ('seeded/qwen3', 'qwen3'): {
        'hidden_size': '64', 'num_hidden_layers': '3', 'num_attention_heads': '4', 'num_key_value_heads': '2',
        'head_dim': '24', 'intermediate_size': '96', 'vocab_size': '4096', 'rms_norm_eps': '1e-06',
        'rope_theta': '10000.0', 'tie_word_embeddings': 'False', 'max_position_embeddings': '512',
        'attention_bias': 'False', 'bos_token_id': '0', 'eos_token_id': '1', 'pad_token_id': '2', 'mtp_layers': '0',
    },
    ('seeded/qwen3-v4', 'qwen3'): {
        'hidden_size': '64', 'num_hidden_layers': '3', 'num_attention_heads': '4', 'num_key_value_heads': '2',
        'head_dim': '24', 'intermediate_size': '96', 'vocab_size': '4096', 'rms_norm_eps': '1e-06',
        'rope_theta': '10000.0', 'tie_word_embeddings': 'False', 'max_position_embeddings': '512',
        'attention_bias': 'False', 'bos_token_id': '0', 'eos_token_id': '1', 'pad_token_id': '2', 'mtp_layers': '0',
    },
    ('seeded/qwen3_5', 'qwen3_5'): {
        'hidden_size': '64', 'num_hidden_layers': '4',
        'layer_types': "('linear_attention', 'linear_attention', 'linear_attention', 'full_attention')",
        'num_attention_heads': '4', 'num_key_value_heads': '2', 'head_dim': '24', 'rotary_dim': '6',
        'rope_theta': '10000.0', 'intermediate_size': '96', 'vocab_size': '4096', 'rms_norm_eps': '1e-06',
        'tie_word_embeddings': 'False', 'max_position_embeddings': '512', 'attention_bias': 'False',
        'linear_num_key_heads': '2', 'linear_num_value_heads': '6', 'linear_key_head_dim': '16',
        'linear_value_head_dim': '12', 'linear_conv_kernel_dim': '4', 'bos_token_id': '0', 'eos_token_id': '1',
        'pad_token_id': '2',
    },
    ('seeded/qwen3_5-conditional', 'qwen3_5'): {
        'hidden_size': '64', 'num_hidden_layers': '4',
        'layer_types': "('linear_attention', 'linear_attention', 'linear_attention', 'full_attention')",
        'num_attention_heads': '4', 'num_key_value_heads': '2', 'head_dim': '24', 'rotary_dim': '6',
        'rope_theta': '10000.0', 'intermediate_size': '96', 'vocab_size': '4096', 'rms_norm_eps': '1e-06',
        'tie_word_embeddings': 'False', 'max_position_embeddings': '512', 'attention_bias': 'False',
        'linear_num_key_heads': '2', 'linear_num_value_heads': '6', 'linear_key_head_dim': '16',
        'linear_value_head_dim': '12', 'linear_conv_kernel_dim': '4', 'bos_token_id': '0', 'eos_token_id': '1',
        'pad_token_id': '2',
    },
    ('seeded/mtp-qwen3.5', 'qwen3'): {
        'hidden_size': '64', 'num_hidden_layers': '3', 'num_attention_heads': '4', 'num_key_value_heads': '2',
        'head_dim': '24', 'intermediate_size': '96', 'vocab_size': '4096', 'rms_norm_eps': '1e-06',
        'rope_theta': '10000.0', 'tie_word_embeddings': 'False', 'max_position_embeddings': '512',
        'attention_bias': 'False', 'bos_token_id': '0', 'eos_token_id': '1', 'pad_token_id': '2', 'mtp_layers': '1',
    },
    ('seeded/mtp-qwen3.5', 'mtp'): {
        'hidden_size': '64', 'num_attention_heads': '4', 'num_key_value_heads': '2', 'head_dim': '24',
        'intermediate_size': '96', 'vocab_size': '4096', 'rms_norm_eps': '1e-06', 'rope_theta': '10000.0',
        'tie_word_embeddings': 'False', 'attention_bias': 'False', 'max_position_embeddings': '512',
        'num_hidden_layers': '3', 'mtp_layers': '1', 'zero_centred_norm': 'False', 'model_type': "'qwen3'",
        'attn_output_gate': 'False', 'rotary_dim': '24',
    },
    ('seeded/mtp-deepseek', 'qwen3'): {
        'hidden_size': '64', 'num_hidden_layers': '3', 'num_attention_heads': '4', 'num_key_value_heads': '2',
        'head_dim': '24', 'intermediate_size': '96', 'vocab_size': '4096', 'rms_norm_eps': '1e-06',
        'rope_theta': '10000.0', 'tie_word_embeddings': 'False', 'max_position_embeddings': '512',
        'attention_bias': 'False', 'bos_token_id': '0', 'eos_token_id': '1', 'pad_token_id': '2', 'mtp_layers': '1',
    },
    ('seeded/mtp-deepseek', 'mtp'): {
        'hidden_size': '64', 'num_attention_heads': '4', 'num_key_value_heads': '2', 'head_dim': '24',
        'intermediate_size': '96', 'vocab_size': '4096', 'rms_norm_eps': '1e-06', 'rope_theta': '10000.0',
        'tie_word_embeddings': 'False', 'attention_bias': 'False', 'max_position_embeddings': '512',
        'num_hidden_layers': '3', 'mtp_layers': '1', 'zero_centred_norm': 'False', 'model_type': "'qwen3'",
        'attn_output_gate': 'False', 'rotary_dim': '24',
    },
    ('seeded/mtp-qwen3_5-text', 'mtp'): {
        'hidden_size': '64', 'num_attention_heads': '4', 'num_key_value_heads': '2', 'head_dim': '24',
        'intermediate_size': '96', 'vocab_size': '4096', 'rms_norm_eps': '1e-06', 'rope_theta': '10000.0',
        'tie_word_embeddings': 'False', 'attention_bias': 'False', 'max_position_embeddings': '512',
        'num_hidden_layers': '3', 'mtp_layers': '1', 'zero_centred_norm': 'True', 'model_type': "'qwen3_5_text'",
        'attn_output_gate': 'True', 'rotary_dim': '12',
    },
    ('seeded/dflash2-window-48', 'dflash2'): {
        'architecture': "'DFlash2DraftModel'", 'hidden_size': '64', 'intermediate_size': '128',
        'num_hidden_layers': '2', 'num_attention_heads': '4', 'num_key_value_heads': '2', 'head_dim': '16',
        'vocab_size': '512', 'rms_norm_eps': '1e-06', 'rope_theta': '10000.0', 'layer_windows': '(48, 48)',
        'target_layer_ids': '(0, 2, 3)', 'block_size': '8', 'mask_token_id': '3', 'conv_kernel_size': '2',
        'conv_group_size': '16', 'selector_rank': '16', 'selector_top_k': '8',
        'tap_convention': "'output-of-layer-0-based'",
    },
    ('seeded/dflash2-window-None', 'dflash2'): {
        'architecture': "'DFlash2DraftModel'", 'hidden_size': '64', 'intermediate_size': '128',
        'num_hidden_layers': '2', 'num_attention_heads': '4', 'num_key_value_heads': '2', 'head_dim': '16',
        'vocab_size': '512', 'rms_norm_eps': '1e-06', 'rope_theta': '10000.0', 'layer_windows': '(None, None)',
        'target_layer_ids': '(0, 2, 3)', 'block_size': '8', 'mask_token_id': '3', 'conv_kernel_size': '2',
        'conv_group_size': '16', 'selector_rank': '16', 'selector_top_k': '8',
        'tap_convention': "'output-of-layer-0-based'",
    },
    ('seeded/dflash-window-48', 'dflash2'): {
        'architecture': "'DFlashDraftModel'", 'hidden_size': '64', 'intermediate_size': '128',
        'num_hidden_layers': '2', 'num_attention_heads': '4', 'num_key_value_heads': '2', 'head_dim': '16',
        'vocab_size': '512', 'rms_norm_eps': '1e-06', 'rope_theta': '10000.0', 'layer_windows': '(48, 48)',
        'target_layer_ids': '(0, 2, 3)', 'block_size': '8', 'mask_token_id': '3', 'conv_kernel_size': 'None',
        'conv_group_size': 'None', 'selector_rank': 'None', 'selector_top_k': 'None',
        'tap_convention': "'output-of-layer-0-based'",
    },
    ('seeded/dflash-window-None', 'dflash2'): {
        'architecture': "'DFlashDraftModel'", 'hidden_size': '64', 'intermediate_size': '128',
        'num_hidden_layers': '2', 'num_attention_heads': '4', 'num_key_value_heads': '2', 'head_dim': '16',
        'vocab_size': '512', 'rms_norm_eps': '1e-06', 'rope_theta': '10000.0', 'layer_windows': '(None, None)',
        'target_layer_ids': '(0, 2, 3)', 'block_size': '8', 'mask_token_id': '3', 'conv_kernel_size': 'None',
        'conv_group_size': 'None', 'selector_rank': 'None', 'selector_top_k': 'None',
        'tap_convention': "'output-of-layer-0-based'",
    },
    ('seeded/dflash2-mixed', 'dflash2'): {
        'architecture': "'DFlash2DraftModel'", 'hidden_size': '64', 'intermediate_size': '128',
        'num_hidden_layers': '2', 'num_attention_heads': '4', 'num_key_value_heads': '2', 'head_dim': '16',
        'vocab_size': '512', 'rms_norm_eps': '1e-06', 'rope_theta': '10000.0', 'layer_windows': '(None, 48)',
        'target_layer_ids': '(0, 2, 3)', 'block_size': '8', 'mask_token_id': '3', 'conv_kernel_size': '2',
        'conv_group_size': '16', 'selector_rank': '16', 'selector_top_k': '8',
        'tap_convention': "'output-of-layer-0-based'",
    },
    ('seeded/dflash2-v4', 'dflash2'): {
        'architecture': "'DFlash2DraftModel'", 'hidden_size': '64', 'intermediate_size': '128',
        'num_hidden_layers': '2', 'num_attention_heads': '4', 'num_key_value_heads': '2', 'head_dim': '16',
        'vocab_size': '512', 'rms_norm_eps': '1e-06', 'rope_theta': '1000000.0', 'layer_windows': '(None, None)',
        'target_layer_ids': '(0, 2, 3)', 'block_size': '16', 'mask_token_id': '3', 'conv_kernel_size': '2',
        'conv_group_size': '16', 'selector_rank': '16', 'selector_top_k': '8',
        'tap_convention': "'output-of-layer-0-based'",
    },
}
CASES = [  # (reader, base, edits, field or None, the value's repr or the message the hand-written parsers gave)
    ('qwen3', 'QWEN3', [('hidden_size', None)], None,
     "ckpt/config.json: missing field 'hidden_size' needed for a Qwen3 model"),
    ('qwen3', 'QWEN3', [('hidden_size', 'big')], None,
     "ckpt/config.json: field 'hidden_size' is 'big'; expected a positive integer (below 2**31)"),
    ('qwen3', 'QWEN3', [('num_hidden_layers', 4097)], None,
     "ckpt/config.json: field 'num_hidden_layers' is 4097; expected a positive integer (at most 4096)"),
    ('qwen3', 'QWEN3', [('num_key_value_heads', 3)], None,
     'ckpt/config.json: num_attention_heads 4 is not a multiple of num_key_value_heads 3'),
    ('qwen3', 'QWEN3', [('num_key_value_heads', None)], 'num_key_value_heads', '4'),
    ('qwen3', 'QWEN3', [('head_dim', None), ('hidden_size', 3)], None,
     "ckpt/config.json: field 'head_dim' is 0; expected a positive integer (below 2**31)"),
    ('qwen3', 'QWEN3', [('head_dim', None)], 'head_dim', '16'),
    ('qwen3', 'QWEN3', [('rope_parameters', {'rope_type': 'yarn'})], None,
     "ckpt/config.json: rope type 'yarn' is not supported yet (only 'default')"),
    ('qwen3', 'QWEN3', [('rope_parameters', None), ('rope_scaling', {'type': 'linear'})], None,
     "ckpt/config.json: rope type 'linear' is not supported yet (only 'default')"),
    ('qwen3', 'QWEN3', [('rope_parameters', None), ('rope_theta', 1000000.0)], 'rope_theta', '1000000.0'),
    ('qwen3', 'QWEN3', [('rope_theta', 'x')], None,
     "ckpt/config.json: field 'rope_theta' is 'x'; expected a finite positive number"),
    ('qwen3', 'QWEN3', [('rope_parameters.rope_theta', 0)], None,
     "ckpt/config.json: field 'rope_parameters.rope_theta' is 0; expected a finite positive number"),
    ('qwen3', 'QWEN3', [('rms_norm_eps', float("nan"))], None,
     "ckpt/config.json: field 'rms_norm_eps' is nan; expected a finite positive number"),
    ('qwen3', 'QWEN3', [('tie_word_embeddings', 'false')], None,
     "ckpt/config.json: field 'tie_word_embeddings' is 'false'; expected true or false"),
    ('qwen3', 'QWEN3', [('eos_token_id', [7, 8])], 'eos_token_id', '7'),
    ('qwen3', 'QWEN3', [('eos_token_id', [1, '2'])], None,
     "ckpt/config.json: field 'eos_token_id[1]' is '2'; expected an integer of at least 0 (below 2**31)"),
    ('qwen3', 'QWEN3', [('bos_token_id', -1)], None,
     "ckpt/config.json: field 'bos_token_id' is -1; expected an integer of at least 0 (below 2**31)"),
    ('qwen3', 'QWEN3', [('num_nextn_predict_layers', 1)], 'mtp_layers', '1'),
    ('qwen3', 'QWEN3', [('mtp_num_hidden_layers', 0), ('num_nextn_predict_layers', 2)], 'mtp_layers', '2'),
    ('qwen3', 'QWEN3', [('mtp_num_hidden_layers', 1), ('num_nextn_predict_layers', 'x')], 'mtp_layers', '1'),
    ('qwen3', 'QWEN3', [('mtp_num_hidden_layers', -1)], None,
     "ckpt/config.json: field 'mtp_num_hidden_layers' is -1; expected an integer of at least 0 (below 2**31)"),
    ('qwen3', 'QWEN3', [('max_position_embeddings', None)], 'max_position_embeddings', '32768'),
    ('qwen3_5', 'QWEN3_5', [('hidden_size', None)], None,
     "ckpt/config.json: missing field 'hidden_size' needed for a Qwen3.5 model"),
    ('qwen3_5', 'QWEN3_5', [('rope_parameters.rope_type', 'mrope')], None,
     "ckpt/config.json: rope type 'mrope' is not supported yet (only 'default')"),
    ('qwen3_5', 'QWEN3_5', [('num_key_value_heads', 3)], None,
     'ckpt/config.json: num_attention_heads 4 is not a multiple of num_key_value_heads 3'),
    ('qwen3_5', 'QWEN3_5',
     [('num_key_value_heads', 3), ('layer_types', ['linear_attention'] * 4)], 'num_key_value_heads',
     '3'),
    ('qwen3_5', 'QWEN3_5', [('linear_num_value_heads', 5)], None,
     ('ckpt/config.json: linear_num_value_heads 5 is not a multiple of linear_num_key_heads 2 (value head j reads '
      'key head j // (value heads / key heads))')),
    ('qwen3_5', 'QWEN3_5', [('rope_parameters.partial_rotary_factor', 0.125)], None,
     ('ckpt/config.json: partial_rotary_factor=0.125 gives 3 rotary dims of head_dim 24: needs a positive even num'
      'ber, at most head_dim')),
    ('qwen3_5', 'QWEN3_5',
     [('rope_parameters.partial_rotary_factor', None), ('partial_rotary_factor', 0.5)], 'rotary_dim',
     '6'),
    ('qwen3_5', 'QWEN3_5', [('vocab_size', None)], 'vocab_size', '248320'),
    ('qwen3_5', 'QWEN3_5', [('hidden_act', 'gelu')], None,
     "ckpt/config.json: hidden_act 'gelu': only silu is supported"),
    ('qwen3_5', 'QWEN3_5-nested', [('tie_word_embeddings', True)], 'tie_word_embeddings', 'True'),
    ('qwen3_5', 'QWEN3_5-nested', [('text_config.tie_word_embeddings', True)], 'tie_word_embeddings', 'False'),
    ('qwen3_5', 'QWEN3_5-nested', [('bos_token_id', 9), ('text_config.bos_token_id', None)], 'bos_token_id', 'None'),
    ('qwen3_5', 'QWEN3_5-nested', [('bos_token_id', 9), ('text_config.bos_token_id', 'DEL')], 'bos_token_id', '9'),
    ('dflash2', 'DFLASH2', [('hidden_size', None)], None,
     "ckpt/config.json: field 'hidden_size' is missing; a DFlash2DraftModel drafter needs it"),
    ('dflash2', 'DFLASH2', [('hidden_size', -1)], None,
     "ckpt/config.json: field 'hidden_size' is -1; expected a non-negative integer (below 2**31)"),
    ('dflash2', 'DFLASH2', [('num_hidden_layers', 5000)], None,
     "ckpt/config.json: field 'num_hidden_layers' is 5000; expected a non-negative integer (at most 4096)"),
    ('dflash2', 'DFLASH2', [('hidden_size', 0)], None,
     "ckpt/config.json: field 'hidden_size' is 0; expected at least 1"),
    ('dflash2', 'DFLASH2', [('num_key_value_heads', 0)], 'num_key_value_heads', '4'),
    ('dflash2', 'DFLASH2', [('head_dim', 0)], 'head_dim', '16'),
    ('dflash2', 'DFLASH2', [('num_key_value_heads', 3)], None,
     'ckpt/config.json: num_attention_heads 4 is not a multiple of num_key_value_heads 3'),
    ('dflash2', 'DFLASH2', [('dflash_config.block_size', None), ('block_size', 16)], 'block_size', '16'),
    ('dflash2', 'DFLASH2', [('dflash_config.mask_token_id', 'x' * 300)], None,
     ("ckpt/config.json: field 'dflash_config.mask_token_id' is 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"
      'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx'
      'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx... (300 characters); expected a non-negative integer (below 2**'
      '31)')),
    ('dflash2', 'DFLASH2', [('dflash_config.conv_group_size', None)], None,
     ("ckpt/config.json: field 'dflash_config.conv_group_size' is missing; a DFlash2DraftModel conv needs conv_ker"
      'nel_size and conv_group_size')),
    ('dflash2', 'DFLASH2', [('num_target_layers', 3)], None,
     ("ckpt/config.json: field 'dflash_config.target_layer_ids' [0, 2, 3] names a layer past the target's num_targ"
      'et_layers 3')),
    ('dflash2', 'DFLASH2', [('rope_parameters.rope_type', 'yarn')], None,
     "ckpt/config.json: rope type 'yarn' is not supported (only 'default')"),
    ('dflash2', 'DFLASH2', [('rope_theta', 'x')], None,
     "ckpt/config.json: field 'rope_theta' is 'x'; expected a finite positive number"),
    ('dflash2', 'DFLASH2', [('sliding_window', 0)], None,
     "ckpt/config.json: field 'sliding_window' is 0; expected a positive integer or null"),
    ('mtp', 'MTP', [('hidden_size', None)], None,
     "ckpt/config.json: missing field 'hidden_size' needed for an MTP head"),
    ('mtp', 'MTP', [('rope_parameters', 'DEL'), ('rope_scaling', {'rope_type': 'yarn'})], None,
     "ckpt/config.json: rope type 'yarn' is not supported for an MTP head (only 'default')"),
    ('mtp', 'MTP', [('num_key_value_heads', 3)], None,
     'ckpt/config.json: num_attention_heads 4 is not a multiple of num_key_value_heads 3'),
    ('mtp', 'MTP', [('partial_rotary_factor', 0.125)], None,
     ('ckpt/config.json: partial_rotary_factor=0.125 gives 3 rotary dims of head_dim 24: an MTP head needs a posit'
      'ive even number, at most head_dim')),
    ('mtp', 'MTP', [('model_type', 'qwen3_next'), ('head_dim', None)], 'head_dim', '256'),
    ('mtp', 'MTP', [('model_type', 'qwen3_next')], 'attn_output_gate', 'True'),
    ('mtp', 'MTP', [('attn_output_gate', 1)], None,
     "ckpt/config.json: field 'attn_output_gate' is 1; expected true or false"),
    ('mtp', 'MTP-nested', [('tie_word_embeddings', True)], 'tie_word_embeddings', 'True'),
    ('mtp', 'MTP-nested',
     [('text_config.tie_word_embeddings', None), ('tie_word_embeddings', True)], 'tie_word_embeddings',
     'False'),
    ('mtp', 'MTP-nested', [('attn_output_gate', False)], 'attn_output_gate', 'False'),
]


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> dict[str, dict]:
    return seeded_configs(tmp_path_factory.mktemp("seeded"))


def test_every_fixture_and_seeded_config_gives_the_args_it_gave(configs):
    assert {name for name, _ in GOLDEN} == set(configs)
    for (name, reader), expected in GOLDEN.items():
        args = READERS[reader].from_config(json.loads(json.dumps(configs[name])), WHERE)
        assert values(args) == expected, (name, reader)


@pytest.mark.parametrize("reader, base, edits, field, expected", CASES,
                         ids=[f"{c[0]}-{'+'.join(p for p, _ in c[2])}" for c in CASES])
def test_each_edit_gives_the_value_or_message_it_gave(reader, base, edits, field, expected):
    config = edited(base, edits)
    if field is None:
        with pytest.raises(InputError) as refused:
            READERS[reader].from_config(config, WHERE)
        assert str(refused.value) == expected
    else:
        assert repr(getattr(READERS[reader].from_config(config, WHERE), field)) == expected


# ------------------------------------------------------------------------------------------------------ the reader


@dataclasses.dataclass(frozen=True)
class Toy:
    size: int = fields.declared()
    width: int = fields.declared(default=lambda r: 2 * r["size"])
    ratio: float = fields.declared(kind=float, default=0.5, positive=False)
    tied: bool = fields.declared(kind=bool, default=False, sources=("", "top"))
    count: int = fields.declared("n_count", minimum=0, zero_unset=True, default=lambda r: r["size"])
    theta: float = fields.rope_theta()
    token: int | None = fields.declared(kind=fields.TOKEN, default=None)
    label: str = "given"


def toy(config: dict, top: dict | None = None, rope: dict | None = None, **given):
    sections = {"": config, "top": config if top is None else top, "rope": rope or {}}
    return fields.Reader(Toy, WHERE, sections).build(**given)


def refusal(read, *args, **kwargs) -> str:
    with pytest.raises(InputError) as refused:
        read(*args, **kwargs)
    return str(refused.value)


def test_declared_fields_read_with_their_defaults():
    assert toy({"size": 3}) == Toy(size=3, width=6, ratio=0.5, tied=False, count=3, theta=10000.0, token=None)
    assert toy({"size": 3, "width": 4, "ratio": -1, "tied": True, "n_count": 2, "token": [5, 6]}, label="x") == \
        Toy(size=3, width=4, ratio=-1.0, tied=True, count=2, theta=10000.0, token=5, label="x")
    assert toy({"size": 3, "n_count": 0}).count == 3  # zero_unset: 0 takes the default, as ``value or default``
    assert refusal(toy, {}) == "ckpt/config.json: missing field 'size'"
    assert refusal(toy, {"size": True}) == "ckpt/config.json: field 'size' is True; expected a positive integer " \
                                           "(below 2**31)"
    assert refusal(toy, {"size": 3, "ratio": float("inf")}) == "ckpt/config.json: field 'ratio' is inf; expected a " \
                                                               "finite number"
    reader = fields.Reader(Toy, WHERE, {"": {}}, missing="field {field!r} is missing; a toy needs it")
    assert refusal(reader.build) == "ckpt/config.json: field 'size' is missing; a toy needs it"


def test_a_default_is_checked_as_a_value_is_but_a_natural_ones():
    reader = fields.Reader(Toy, WHERE, {"": {"size": 3, "big": 8}, "rope": {}})
    with pytest.raises(InputError, match="^ckpt/config.json: field 'width' is 0; expected a positive integer"):
        reader.read(fields.Declared(default=lambda r: r["size"] - 3), "width")
    assert reader.read(fields.Declared("spare", kind=fields.NATURAL, default=None)) is None  # unset, not refused
    assert reader.read(fields.Declared("spare", kind=fields.NATURAL, default=lambda r: 0)) == 0
    assert refusal(reader.read, fields.Declared("big", kind=fields.NATURAL, maximum=7, prefix="draft.")) == \
        "ckpt/config.json: field 'draft.big' is 8; expected a non-negative integer (at most 7)"


def test_sources_give_the_first_that_holds_the_key():
    assert toy({"size": 3}, top={"tied": True}).tied is True
    assert toy({"size": 3, "tied": None}, top={"tied": True}).tied is False  # null where it is read: the default
    draft = fields.Declared("block", kind=fields.NATURAL, sources=("draft", ""), skip_null=True)
    reader = fields.Reader(Toy, WHERE, {"": {"block": 16}, "draft": {"block": None}})
    assert reader.read(draft) == 16 and reader.raw("size") is None  # skip_null: a null gives way to the next


def test_a_fallback_is_checked_first_and_taken_when_the_key_is_absent():
    assert toy({"size": 3, "rope_theta": 5.0}).theta == 5.0
    assert toy({"size": 3, "rope_theta": 5.0}, rope={"rope_theta": 7}).theta == 7.0
    assert refusal(toy, {"size": 3, "rope_theta": "x"}, rope={"rope_theta": 7.0}) == \
        "ckpt/config.json: field 'rope_theta' is 'x'; expected a finite positive number"
    assert refusal(toy, {"size": "x", "rope_theta": "x"}) == \
        "ckpt/config.json: field 'rope_theta' is 'x'; expected a finite positive number"  # before any field
    assert refusal(toy, {"size": 3}, rope={"rope_theta": 0}) == \
        "ckpt/config.json: field 'rope_parameters.rope_theta' is 0; expected a finite positive number"


def test_fields_are_read_once_in_the_order_asked():
    reader = fields.Reader(Toy, WHERE, {"": {"size": 3, "width": "w", "n_count": "c"}, "top": {}, "rope": {}})
    assert refusal(reader.take, "count", "width") == \
        "ckpt/config.json: field 'n_count' is 'c'; expected an integer of at least 0 (below 2**31)"
    assert refusal(reader.build) == "ckpt/config.json: field 'width' is 'w'; expected a positive integer (below 2**31)"
    reader = fields.Reader(Toy, WHERE, {"": {"size": "x"}, "top": {}, "rope": {}}, size=5)  # known: not read
    assert reader.build().width == 10


def test_the_shared_checks():
    assert fields.rope({"rope_parameters": {"rope_type": "default", "rope_theta": 3.0}}, WHERE) == \
        {"rope_type": "default", "rope_theta": 3.0}
    assert fields.rope({}, WHERE) == {}
    assert refusal(fields.rope, {"rope_scaling": {"type": "dynamic"}}, WHERE, " for an MTP head") == \
        "ckpt/config.json: rope type 'dynamic' is not supported for an MTP head (only 'default')"
    fields.check_heads(8, 2, WHERE)
    assert refusal(fields.check_heads, 8, 3, WHERE) == \
        "ckpt/config.json: num_attention_heads 8 is not a multiple of num_key_value_heads 3"
    assert fields.partial_rotary({"partial_rotary_factor": 0.5}, {"partial_rotary_factor": 1}, WHERE, 1.0) == 0.5
    assert fields.partial_rotary({}, {"partial_rotary_factor": 1}, WHERE, 0.25) == 1.0
    assert fields.partial_rotary({}, {}, WHERE, 0.25) == 0.25
    assert fields.rotary_dim(0.25, 64, WHERE) == 16
    assert refusal(fields.rotary_dim, 1.5, 64, WHERE, "a head ") == "ckpt/config.json: partial_rotary_factor=1.5 " \
        "gives 0 rotary dims of head_dim 64: a head needs a positive even number, at most head_dim"


def test_an_mtp_head_reads_a_qwen3_decoders_fields_but_is_no_target():
    """MTPArgs builds on Qwen3's declared decoder fields (``DecoderArgs``), not on Qwen3Args: a head has no token
    ids and no family (``family_of`` must not take it for a Qwen3 target)."""
    assert issubclass(MTPArgs, DecoderArgs) and issubclass(Qwen3Args, DecoderArgs)
    assert not issubclass(MTPArgs, Qwen3Args) and not hasattr(MTPArgs, "family")
    assert {f.name for f in dataclasses.fields(DecoderArgs)} <= {f.name for f in dataclasses.fields(MTPArgs)}


def test_config_functions_stay_short():
    """Issue #42: the config parsers are declarations plus their cross-field checks; no function grows past 30
    lines again."""
    root = Path(__file__).resolve().parent.parent / "convert"
    for path in [root / "fields.py", *sorted(root.glob("models/*/config.py"))]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno - node.lineno + 1 < 30, (str(path), node.name)
