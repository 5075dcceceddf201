"""The kv_transfer_params a decode instance takes, checked before anything is allocated or read: a missing key or a
value of the wrong type or range is a clear error for that request alone (it reached the engine's step before and
stopped the whole instance). The prefill instance writes them (KVExporter.export); a client may have altered them."""
from __future__ import annotations

import numbers

STRINGS = ("remote_agent", "remote_metadata", "remote_request_id")
ADDRESSES = ("kv_addr", "kv_layer_bytes", "kv_block_bytes", "summary_addr", "summary_layer_bytes",
             "summary_block_bytes")


def check_transfer_params(p: dict, vocab_size: int) -> None:
    """Raises ValueError naming the first key of `p` that a decode instance cannot use."""
    for key in STRINGS:
        if not isinstance(p.get(key), str) or not p[key]:
            raise ValueError(f"kv_transfer_params.{key} must be a non-empty string, got {p.get(key)!r}")
    for key in (*ADDRESSES, "num_tokens", "first_token_id"):
        if not is_int(p.get(key)) or p[key] < 0:
            raise ValueError(f"kv_transfer_params.{key} must be an integer >= 0, got {p.get(key)!r}")
    if p["first_token_id"] >= vocab_size:
        raise ValueError(f"kv_transfer_params.first_token_id must be below the vocabulary's {vocab_size}, "
                         f"got {p['first_token_id']}")
    blocks = p.get("remote_block_ids")
    if not isinstance(blocks, list) or not all(is_int(b) and b >= 0 for b in blocks):
        raise ValueError(f"kv_transfer_params.remote_block_ids must be a list of integers >= 0, got {blocks!r}")
    for key in ("lease_s", "lease_deadline"):
        if not is_number(p.get(key)) or p[key] <= 0:
            raise ValueError(f"kv_transfer_params.{key} must be a positive number, got {p.get(key)!r}")
    if not isinstance(p.get("layout"), dict):
        raise ValueError(f"kv_transfer_params.layout must be an object, got {p.get('layout')!r}")


def is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
