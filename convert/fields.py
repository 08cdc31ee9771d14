"""Typed reads of config.json fields: a field of the wrong type is refused naming the file and the field, before any
arithmetic turns it into a traceback or a silently wrong model.

JSON gives any type anywhere: ``"hidden_size": "big"``, ``"num_hidden_layers": null``, ``"vocab_size": 1e400``
(parsed as inf), ``"tie_word_embeddings": "false"`` (a non-empty string, true to ``bool``). Every family reads its
config through these helpers instead of ``int()`` / ``float()`` / ``bool()``:

- ``integer``: an int (not a bool, float or string), at least ``minimum`` (1: a size or count), below 2**31 (the
  largest dimension Core ML takes) or ``maximum`` (``MAX_LAYERS`` for a layer count).
- ``number``: an int or a finite float (not a bool or string), positive unless told otherwise.
- ``flag``: a JSON ``true`` / ``false``.
- ``mapping``: an object (``rope_parameters``, ``rope_scaling``); ``strings``: a list of strings (``layer_types``).
- ``token_id``: a token id, a list of them (the first is taken) or null.
- ``section``: ``text_config`` when the config nests its text model there, else the config itself.

A field that is absent or null takes ``default`` (what transformers does with an unset field); without a default it
is refused as missing. Defaults are checked too, so that a size derived from other fields (``hidden_size //
num_attention_heads``) cannot slip through as 0.
"""

from __future__ import annotations

import math

from convert.errors import InputError, quote

REQUIRED = object()
VALUE_LIMIT = 100  # characters of a quoted value in an error
INT_LIMIT = 2**31
MAX_LAYERS = 4096  # a layer count is looped over (every layer's tensors are listed): far past any real model's


def integer(config: dict, name: str, where: str, default=REQUIRED, *, minimum: int = 1, maximum: int = INT_LIMIT - 1,
            field: str | None = None, needed: str = "") -> int:
    """``config[name]`` as an int in ``minimum..maximum``; ``field`` names it in errors (default ``name``),
    ``needed`` ends the missing-field message (" needed for a Qwen3 model")."""
    value = _get(config, name, where, default, field, needed)
    return check_integer(value, field or name, where, minimum=minimum, maximum=maximum)


def check_integer(value, field: str, where: str, *, minimum: int = 1, maximum: int = INT_LIMIT - 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        want = "a positive integer" if minimum == 1 else f"an integer of at least {minimum}"
        bound = "below 2**31" if maximum == INT_LIMIT - 1 else f"at most {maximum}"
        raise InputError(f"{where}: field {field!r} is {_value(value)}; expected {want} ({bound})")
    return value


def number(config: dict, name: str, where: str, default=REQUIRED, *, positive: bool = True,
           field: str | None = None) -> float:
    """``config[name]`` as a finite float (an int is taken too), positive unless ``positive`` is false."""
    value = _get(config, name, where, default, field, "")
    return check_number(value, field or name, where, positive=positive)


def check_number(value, field: str, where: str, *, positive: bool = True) -> float:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not ok or (positive and value <= 0):
        raise InputError(f"{where}: field {field!r} is {_value(value)}; expected a finite "
                         f"{'positive ' if positive else ''}number")
    return float(value)


def flag(config: dict, name: str, where: str, default: bool = False, *, field: str | None = None) -> bool:
    """``config[name]``: JSON true or false (a string "false" is refused, not read as true)."""
    return check_flag(_get(config, name, where, default, field, ""), field or name, where)


def check_flag(value, field: str, where: str) -> bool:
    if not isinstance(value, bool):
        raise InputError(f"{where}: field {field!r} is {_value(value)}; expected true or false")
    return value


def mapping(config: dict, name: str, where: str, *, field: str | None = None) -> dict:
    """``config[name]`` as an object; absent or null is ``{}``."""
    value = config.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InputError(f"{where}: field {field or name!r} is {_value(value)}; expected an object")
    return value


def strings(config: dict, name: str, where: str, *, field: str | None = None) -> list[str] | None:
    """``config[name]`` as a list of strings; None when absent or null."""
    value = config.get(name)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise InputError(f"{where}: field {field or name!r} is {_value(value)}; expected a list of strings")
    return value


def token_id(value, field: str, where: str) -> int | None:
    """A token id field's value: an id, a list of ids (the first is the one a bundle records) or null."""
    if isinstance(value, list):
        for i, item in enumerate(value):
            check_integer(item, f"{field}[{i}]", where, minimum=0)
        return value[0] if value else None
    return None if value is None else check_integer(value, field, where, minimum=0)


def section(config: dict, where: str) -> dict:
    """The text model's fields: ``text_config`` when present (vision-language configs), else ``config``."""
    if "text_config" not in config:
        return config
    text = config["text_config"]
    if not isinstance(text, dict):
        raise InputError(f"{where}: field 'text_config' is {_value(text)}; expected an object")
    return text


def _value(value) -> str:
    return quote(value, VALUE_LIMIT)


def _get(config: dict, name: str, where: str, default, field: str | None, needed: str):
    value = config.get(name)
    if value is not None:
        return value
    if default is REQUIRED:
        raise InputError(f"{where}: missing field {field or name!r}{needed}")
    return default
