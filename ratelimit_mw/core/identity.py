"""Redis key encoding: injective, slot-stable and bounded.

A key is ``<prefix>:{<identity>}:<policy>.<algorithm>:<tier>``. The identity sits in the
hash tag, so on a Redis Cluster every key of one identity lands in one slot, and client text
can never move it: identities made only of safe characters (no braces, no ``#``, at most 64)
are written as they are; anything else becomes ``#`` + a 128-bit BLAKE2b digest. A plain
value never starts with ``#``, so the two forms cannot meet, and nothing a client sends can
make a key longer than the fixed bound.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import re

_SAFE = re.compile(r"[A-Za-z0-9_.:/@=+\-]{1,64}")
_SAFE_SEGMENT = re.compile(r"[A-Za-z0-9_.;:/@=+\-]{1,48}")


def _digest(text: str) -> str:
    raw = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()
    return "#" + base64.urlsafe_b64encode(raw).decode("ascii").rstrip("=")


# Only identities of at most 64 characters are cached, so the cache holds at most
# 16,384 x (a 64-character key, a 23-character digest, ~150 bytes of bookkeeping): ~5 MB however
# clients choose their identities. Longer ones are hashed on every call (a few µs for 8 KB):
# caching them would keep their whole text (65,536 of 8 KB: 530 MB).
CACHED_LENGTH = 64


@functools.lru_cache(maxsize=16_384)
def encode_short(identity: str) -> str:
    """`encode_identity` of an identity of at most `CACHED_LENGTH` characters, cached."""
    if _SAFE.fullmatch(identity):
        return identity
    return _digest(identity)


def encode_identity(identity: str) -> str:
    """The hash-tag body for an identity; cached because the same clients come back."""
    if len(identity) > CACHED_LENGTH:
        return _digest(identity)
    return encode_short(identity)


def identity_slot(identity: str) -> int:
    """The Redis Cluster hash slot of every key of one identity: CRC16 (XMODEM, as Redis
    computes it) of its encoded form, the keys' hash tag."""
    return binascii.crc_hqx(encode_identity(identity).encode(), 0) % 16_384


# Names of decorators and rules hold spaces ("route app.search 5/minute"): written with "~",
# which no safe name holds, they stay readable in the store (ratelimit-mw list) and distinct.
_SPACED_SEGMENT = re.compile(r"[A-Za-z0-9_.;:/@=+\- ]{1,48}")


def encode_segment(name: str) -> str:
    """A policy name as a key segment: short safe names kept as they are, spaces written
    as ``~``, anything else hashed."""
    if _SAFE_SEGMENT.fullmatch(name):
        return name
    if _SPACED_SEGMENT.fullmatch(name):
        return name.replace(" ", "~")
    return _digest(name)


def decode_segment(segment: str) -> str | None:
    """The policy name a key segment stands for, or None when it was hashed."""
    return None if segment.startswith("#") else segment.replace("~", " ")


def identity_head(prefix: str, identity: str) -> str:
    """``<prefix>:{<identity>}:`` — the part of every key of one identity."""
    return f"{prefix}:{{{encode_identity(identity)}}}:"
