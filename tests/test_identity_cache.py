"""The key-encoding cache is bounded in bytes: only short identities are cached."""

from __future__ import annotations

import tracemalloc

from ratelimit_mw.core import identity as identity_module
from ratelimit_mw.core.identity import encode_identity


def test_long_identities_are_hashed_without_being_cached() -> None:
    before = identity_module.encode_short.cache_info().currsize
    long = "k" * 65 + "{x}"
    encoded = encode_identity(long)
    assert encoded.startswith("#") and len(encoded) < 30
    assert encode_identity(long) == encoded  # the same digest every time
    assert identity_module.encode_short.cache_info().currsize == before


def test_a_flood_of_distinct_8_kb_identities_leaves_nothing_behind() -> None:
    identities = [f"{i:06d}" + "x" * 8_186 for i in range(2_000)]
    tracemalloc.start()
    try:
        start, _ = tracemalloc.get_traced_memory()
        for text in identities:
            encode_identity(text)
        grown = tracemalloc.get_traced_memory()[0] - start
    finally:
        tracemalloc.stop()
    assert grown < 100_000, grown  # was ~8.5 KB per identity: 17 MB


def test_a_flood_of_distinct_short_identities_stays_within_the_caches_entries() -> None:
    limit = identity_module.encode_short.cache_info().maxsize
    assert limit is not None
    for i in range(limit + 1_000):
        encode_identity(f"{i:064d}")  # as long as is cached
    assert identity_module.encode_short.cache_info().currsize == limit
