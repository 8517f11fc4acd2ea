"""GPT-2's reversible byte <-> printable character table of byte-level BPE vocabularies.

The one copy: the frontend's tokenizer and fast encoder (``blink.dpu``) and the GGUF
tokenizer builder (``blink.loader.gguf_tokenizer``) use it.
"""
from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """byte -> the printable character a byte-level BPE vocabulary spells it with (one shared
    dict: callers must not modify it)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, (chr(c) for c in chars)))


def unicode_to_bytes() -> dict[str, int]:
    """The inverse table: printable character -> byte."""
    return {char: byte for byte, char in bytes_to_unicode().items()}
