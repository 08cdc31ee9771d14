"""The two kinds of failure a user sees, with their exit codes (DESIGN.md: 1 gate failed, 2 bad input)."""


class InputError(Exception):
    """Bad input: the message is one line that names the file, field or tensor and what to do. Exit 2."""

    exit_code = 2


class SourceUnavailable(InputError):
    """A pinned checkpoint that is not on this machine (no local directory, not in the Hugging Face cache and no
    download possible). ``build --dry-run`` can still plan from the recipe's ``contract``."""


class GateError(Exception):
    """A numeric or identity check failed; nothing is published. Exit 1."""

    exit_code = 1


QUOTE_LIMIT = 200
FIELD_PART_LIMIT = 60
MESSAGE_LIMIT = 1000


def quote(value: object, limit: int = QUOTE_LIMIT) -> str:
    """``repr(value)`` cut to ``limit`` characters: an error names the offending value without echoing a huge one.

    Containers are written piece by piece and stop at the limit, so that a YAML alias bomb (a list of a billion
    shared items) or a self-containing list is quoted in bounded time and memory, and no nesting depth recurses."""
    if isinstance(value, (str, bytes)) and len(value) > limit:
        return f"{repr(value[:limit])[:limit]}... ({len(value)} characters)"
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 14_000:
        return f"an integer of {value.bit_length()} bits"  # repr refuses ints over 4300 digits
    if not isinstance(value, (list, tuple, dict, set, frozenset)):
        text = repr(value)
        return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
    pieces: list[str] = []
    size = 0
    for piece in _repr_pieces(value, limit):
        pieces.append(piece)
        size += len(piece)
        if size > limit:
            return "".join(pieces)[:limit] + "..."
    return "".join(pieces)


def _repr_pieces(value: object, limit: int):
    """The pieces of ``repr(value)`` in order, without recursion (a stack of pending pieces and values)."""
    brackets = {list: "[]", tuple: "()", set: "{}", frozenset: "{}", dict: "{}"}
    stack: list[tuple[bool, object]] = [(False, value)]  # (is_text, item)
    while stack:
        is_text, item = stack.pop()
        if is_text:
            yield item
            continue
        kind = next((k for k in brackets if isinstance(item, k)), None)
        if kind is None:
            yield quote(item, limit)
            continue
        if kind in (set, frozenset) and not item:
            yield f"{kind.__name__}()"
            continue
        opening, closing = brackets[kind]
        todo: list[tuple[bool, object]] = [(True, opening)]
        entries = item.items() if isinstance(item, dict) else item
        for i, entry in enumerate(entries):
            if i:
                todo.append((True, ", "))
            if i * 2 > limit:  # more items than could show
                todo.append((True, "..."))
                break
            if isinstance(item, dict):
                todo += [(False, entry[0]), (True, ": "), (False, entry[1])]
            else:
                todo.append((False, entry))
        todo.append((True, ("," if kind is tuple and len(item) == 1 else "") + closing))
        stack.extend(reversed(todo))


def field_name(loc: tuple | list) -> str:
    """A pydantic error location as a dotted field name, each part cut to ``FIELD_PART_LIMIT`` characters (a 1 MB
    unknown key is named, not echoed) and quoted when it is empty or not printable (a key holding a line break)."""
    parts = []
    for part in loc:
        text = str(part)
        if not text or not text.isprintable():  # an empty key, or one holding a line break or a control character
            text = repr(text[: FIELD_PART_LIMIT + 1])
        parts.append(text if len(text) <= FIELD_PART_LIMIT else f"{text[:FIELD_PART_LIMIT]}...")
    return ".".join(parts)


def one_line(message: str, limit: int = MESSAGE_LIMIT) -> str:
    """A message as the one line a user sees: line breaks folded, cut at ``limit`` characters (a safety net; every
    echoed value is already quoted)."""
    text = " ".join(str(message).splitlines())  # \r, \x85, \u2028 ... too
    return text if len(text) <= limit else f"{text[:limit]}..."


class PackageError(RuntimeError):
    """A package could not be written or failed its read-back check; the message names what."""
