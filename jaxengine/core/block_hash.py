"""Chained block hashes for prefix caching.

A full block's hash covers its parent's hash, its own token ids and extra keys (a cache salt
on the first block), so equal hashes mean equal whole prefixes. SHA-256 rather than Python's
``hash``: a collision would silently serve another prompt's KV.
"""
from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence as Seq

ROOT_HASH = b"\x00" * 32


def hash_block_tokens(parent_hash: bytes | None, token_ids: Seq[int], extra_keys: tuple = ()) -> bytes:
    h = hashlib.sha256(parent_hash or ROOT_HASH)
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


def extend_block_hashes(block_hashes: list[bytes], token_ids: Seq[int], num_full_blocks: int,
                        block_size: int, extra_keys: tuple = ()) -> list[bytes]:
    """Extend ``block_hashes`` in place to cover the first ``num_full_blocks`` full blocks; the
    first block's hash covers ``extra_keys`` (``Request.prefix_keys``), so every later one does."""
    for i in range(len(block_hashes), num_full_blocks):
        parent = block_hashes[i - 1] if i else None
        extra = extra_keys if i == 0 else ()
        block_hashes.append(hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size], extra))
    return block_hashes
