"""Content-encodings undone with a bound on the decoded size, so a small compressed body cannot become gigabytes.

An upstream (or client) may send a gzip bomb: 0.5 MB that decodes to 512 MB of JSON. mitmproxy's own decoder has no
bound, so the addon decodes here instead, with ``zlib`` and ``max_length``: at most ``limit + 1`` bytes ever exist,
and a body past ``limit`` raises :class:`TooLarge` (issue 27). Only gzip and deflate are decoded: the addon asks the
upstream for ``identity``, and the standard library has no bounded decoder for br or zstd, so those are refused
(:class:`Undecodable`) and the record keeps the encoded bytes. Standard library only.
"""

from __future__ import annotations

import zlib

GZIP = ("gzip", "x-gzip")
DEFLATE = ("deflate",)


class Undecodable(ValueError):
    """The body cannot be decoded (corrupt, or an encoding the addon does not decode)."""


class TooLarge(Undecodable):
    """The body decodes to more than the limit."""


def decode(data: bytes, encoding: str, limit: int) -> bytes:
    """``data`` with its content-``encoding`` undone (``identity`` or empty: as it is); at most ``limit`` bytes."""
    name = encoding.strip().lower()
    if name in ("", "identity"):
        return data
    if name in GZIP:
        return _inflate(data, 16 + zlib.MAX_WBITS, name, limit)
    if name in DEFLATE:
        try:
            return _inflate(data, zlib.MAX_WBITS, name, limit)
        except TooLarge:
            raise
        except Undecodable:  # servers send raw deflate as often as the zlib stream the RFC names
            return _inflate(data, -zlib.MAX_WBITS, name, limit)
    raise Undecodable(
        f"content-encoding {encoding!r} is not decoded (the addon asks for identity; it decodes gzip and deflate)"
    )


def _inflate(data: bytes, wbits: int, name: str, limit: int) -> bytes:
    out = bytearray()
    while True:  # gzip allows several members one after another
        inflater = zlib.decompressobj(wbits)
        try:
            out += inflater.decompress(data, limit + 1 - len(out))  # never 0 (unbounded): out is at most limit here
        except zlib.error as e:
            raise Undecodable(f"{name}: {e}") from e
        if len(out) > limit or inflater.unconsumed_tail:
            raise TooLarge(f"{name} body decodes to more than {limit >> 20} MiB (polar_max_decoded_mb); kept encoded")
        if not inflater.eof:
            raise Undecodable(f"{name}: the compressed stream is truncated")
        data = inflater.unused_data
        if not data or wbits < 0 or name not in GZIP:
            return bytes(out)
