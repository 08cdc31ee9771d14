"""MLIR bytecode (https://mlir.llvm.org/docs/BytecodeFormat/), as far as the Core AI backend reads and rewrites it: the
sections of a ``main.mlirb``, its string section, its resource blobs by name, and the renaming of those blobs that
makes a package reproducible (``canonicalize_resource_names``; ``convert/backends/coreai.py`` says why).

The bytecode is a magic, a version and a producer, then sections of
[id | 0x80 if aligned, varint length, (varint alignment, 0xCB padding), data].
"""

from __future__ import annotations

from pathlib import Path

from convert.errors import PackageError

_MAGIC = b"ML\xefR"
_STRINGS, RESOURCE, _RESOURCE_OFFSETS = 0, 5, 6  # section ids
_ALIGNED = 0x80
_PADDING = b"\xcb"
_BLOB = 0  # resource entry kind


def canonicalize_resource_names(mlirb: Path) -> None:
    """Rename the bytecode's resource blobs ``resource_<i>`` in order of use (``convert/backends/coreai.py``'s
    docstring says why)."""
    header, sections = bytecode_sections(mlirb.read_bytes())
    offsets = next((data for section, data, _ in sections if section == _RESOURCE_OFFSETS), b"")
    keys = _resource_keys(offsets)
    rebuilt = []
    for section, data, alignment in sections:
        if section == _STRINGS:
            strings = _read_strings(data)
            for index, key in enumerate(keys):
                strings[key] = f"resource_{index}".encode()
            data = _write_strings(strings)
        rebuilt.append((section, data, alignment))
    mlirb.write_bytes(_write_sections(header, rebuilt))


def bytecode_sections(content: bytes) -> tuple[bytes, list[tuple[int, bytes, int]]]:
    """Split bytecode into its header (magic, version, producer) and (id, data, alignment) sections."""
    if not content.startswith(_MAGIC):
        raise PackageError("main.mlirb is not MLIR bytecode; coreai-core changed its format, update this backend")
    _, pos = _read_varint(content, len(_MAGIC))
    pos = content.index(b"\0", pos) + 1
    header, sections = content[:pos], []
    while pos < len(content):
        code = content[pos]
        length, pos = _read_varint(content, pos + 1)
        alignment = 1
        if code & _ALIGNED:
            alignment, pos = _read_varint(content, pos)
            pos += -pos % alignment
        sections.append((code & ~_ALIGNED, content[pos : pos + length], alignment))
        pos += length
    return header, sections


def _write_sections(header: bytes, sections: list[tuple[int, bytes, int]]) -> bytes:
    out = bytearray(header)
    for section, data, alignment in sections:
        out += bytes([section | (_ALIGNED if alignment > 1 else 0)]) + _encode_varint(len(data))
        if alignment > 1:
            out += _encode_varint(alignment)
            out += _PADDING * (-len(out) % alignment)
        out += data
    return bytes(out)


def _resource_keys(offsets: bytes) -> list[int]:
    """String-table indices of every resource key, in order, from the resource offset section."""
    return list(dict.fromkeys(key for key, _, _ in _resource_entries(offsets)))


def _resource_entries(offsets: bytes) -> list[tuple[int, int, int]]:
    """(key string index, size, kind) of every resource entry, in the order of their data.

    The section is a count of external groups, then groups (external, then dialect) until its end, each a
    group key, an entry count and entries of (key string index, size, kind byte).
    """
    entries = []
    _, pos = _read_varint(offsets, 0)
    while pos < len(offsets):
        _, pos = _read_varint(offsets, pos)
        count, pos = _read_varint(offsets, pos)
        for _ in range(count):
            key, pos = _read_varint(offsets, pos)
            size, pos = _read_varint(offsets, pos)
            entries.append((key, size, offsets[pos]))
            pos += 1
    return entries


def resource_blobs(content: bytes) -> dict[str, bytes]:
    """Every blob resource of the bytecode by its name.

    The resource section holds the entries back to back; a blob entry is its alignment (varint), its size
    (varint), padding to that alignment (the section itself starts aligned to the largest) and the bytes.
    """
    _, sections = bytecode_sections(content)
    data = {section: payload for section, payload, _ in sections}
    strings = _read_strings(data[_STRINGS])
    resources, blobs, start = data.get(RESOURCE, b""), {}, 0
    for key, size, kind in _resource_entries(data.get(_RESOURCE_OFFSETS, b"")):
        if kind == _BLOB:
            alignment, pos = _read_varint(resources, start)
            length, pos = _read_varint(resources, pos)
            pos += -pos % alignment
            blobs[strings[key].decode()] = resources[pos : pos + length]
        start += size
    return blobs


def _read_strings(data: bytes) -> list[bytes]:
    """The string section: a count, the sizes (with NUL) in reverse order, then the NUL-terminated strings."""
    count, pos = _read_varint(data, 0)
    sizes = []
    for _ in range(count):
        size, pos = _read_varint(data, pos)
        sizes.append(size)
    strings = []
    for size in reversed(sizes):
        strings.append(data[pos : pos + size - 1])
        pos += size
    return strings


def _write_strings(strings: list[bytes]) -> bytes:
    sizes = b"".join(_encode_varint(len(s) + 1) for s in reversed(strings))
    return _encode_varint(len(strings)) + sizes + b"".join(s + b"\0" for s in strings)


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    """MLIR's prefix varint: the trailing zeros of the first byte count the extra bytes (0: 8 raw bytes)."""
    first = data[pos]
    if first == 0:
        return int.from_bytes(data[pos + 1 : pos + 9], "little"), pos + 9
    size = (first & -first).bit_length()
    return int.from_bytes(data[pos : pos + size], "little") >> size, pos + size


def _encode_varint(value: int) -> bytes:
    for size in range(1, 9):
        if value < 1 << (7 * size):
            return (((value << 1) | 1) << (size - 1)).to_bytes(size, "little")
    return b"\0" + value.to_bytes(8, "little")
