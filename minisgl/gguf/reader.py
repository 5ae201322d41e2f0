"""Reading a .gguf file: the `gguf` package's reader, its tensors memory-mapped (nothing is copied or
dequantized), and its metadata fields by key."""

from __future__ import annotations

from typing import Any


def open_gguf(path: str) -> Any:
    """The gguf package's reader over a copy-on-write map: tensors are views of the file's pages (shared
    with the page cache, read on first touch), writable in memory, the file never written."""
    try:
        import gguf
    except ImportError:
        raise ValueError("reading a .gguf file needs the package 'gguf': pip install gguf") from None
    return gguf.GGUFReader(path, "c")


def field(reader: Any, key: str, default: Any = None) -> Any:
    """The value of metadata key `key` (a number, a string or a list), or `default` where the file has none."""
    f = reader.fields.get(key)
    return default if f is None else f.contents()
