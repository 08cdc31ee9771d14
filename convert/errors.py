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


def quote(value: object, limit: int = QUOTE_LIMIT) -> str:
    """``repr(value)`` cut to ``limit`` characters: an error names the offending value without echoing a huge one."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
