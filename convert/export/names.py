"""Every input, output and state name the functions and the host contracts speak, spelled once (as gguf-py's
``constants.py`` spells its keys): the package's tensors are named by these in both formats, and a runtime reads them
from the manifest's functions and host contract (docs/bundle.md, docs/layouts.md)."""

from __future__ import annotations

from manifests.schema import ARGMAX_IDS as ARGMAX_IDS  # re-exported: one spelling, the schema's

# inputs a caller passes
INPUT_IDS = "input_ids"  # [1, S] int32 token ids
POSITION_IDS = "position_ids"  # [1, S] int32 absolute positions
ACCEPT = "accept"  # a hybrid's count of the previous verify rows to commit (commit-next-call)
VALID = "valid"  # a hybrid's count of this call's rows that are real (the rest is padding)
TAPS = "taps"  # the target's tapped rows a DFlash2 drafter's context calls take, and the target's output of them
HIDDEN = "hidden"  # the target's final-norm rows an MTP head takes, and the target's output of them
ANCHOR_EMBEDDING = "anchor_embedding"  # a DFlash2 draft's anchor row
ANCHOR_ID = "anchor_id"  # a DFlash2 draft's anchor token (its selector walk starts there)
HIDDEN_STATES = "hidden_states"  # the rows a part after the first takes (the embedding rows, or the previous part's)

# inputs the host computes (the ane layout)
ROPE_COS = "rope_cos"  # cos of the call's positions times RoPE's inverse frequencies
ROPE_SIN = "rope_sin"
HISTORY_MASK = "history_mask"  # which history rows a call's queries see
KEY_HISTORY = "key_history"  # the host's key and value rows
VALUE_HISTORY = "value_history"
COMMIT_MASK = "commit_mask"  # a hybrid's pending rows to commit, as a mask and as a selection
COMMIT_SELECT = "commit_select"
VALID_MASK = "valid_mask"  # a hybrid's real rows of this call
VALID_SELECT = "valid_select"
KEY_ROWS = "key_rows"  # the ane layout's call outputs: the key and value rows the host writes into its history
VALUE_ROWS = "value_rows"

# outputs
LOGITS = "logits"
# ARGMAX_IDS: the head's argmax a row (a package's own, or the host's from its logits), named where the manifest
# schema, a layer below, gives it as the host contract's default
MAX_LOGIT = "max_logit"  # a split head's part: its rows' largest logit, with which the host merges the parts' ids
DRAFT_IDS = "draft_ids"
HIDDEN_OUT = "hidden_out"  # an MTP head's own rows for its next chained step
SELECTOR_SCORES = "selector_scores"  # a DFlash2 selector walk's scores
SELECTOR_PROJECTED = "selector_projected"  # the ane draft's projection of its rows, which the host walks

# states (a stateful package keeps them; the ane layout's host owns their rows)
KEY_CACHE = "key_cache"
VALUE_CACHE = "value_cache"
CONV_STATE = "conv_state"  # a hybrid's Gated DeltaNet causal conv window
RECURRENT_STATE = "recurrent_state"  # a hybrid's Gated DeltaNet state
PENDING_QKV = "pending_qkv"  # a hybrid's decode / verify rows left pending until the next call commits them
PENDING_BA = "pending_ba"
RING_KEYS = "ring_keys"  # a DFlash2 drafter's context ring
RING_VALUES = "ring_values"
RING_LAPS = "ring_laps"
