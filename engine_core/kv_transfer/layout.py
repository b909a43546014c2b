"""Which KV layouts can move between engines in disaggregated prefill and decode (DESIGN.md §12)."""

import importlib.util

from protocol.kv_cache_spec import KVCacheConfig
from protocol.kv_transfer import describe_unsupported_groups


def nixl_available() -> bool:
    """Whether NIXL is installed here (the `nixl` extra), without importing it."""
    return importlib.util.find_spec("nixl") is not None


def describe_unauthenticated_nixl(kv_transfer_address: str, has_curve: bool) -> str | None:
    """Why a prefill engine's ranks serving pulls at `kv_transfer_address` must not hand out
    NIXL descriptors, or None when they may.

    A NIXL agent registers a rank's whole KV tensors, and the metadata and page addresses a pull
    is answered with let the puller READ any page of them for the agent's life: after the
    transfer's unpin, and pages of other requests too. The handle's secret decides what an
    honest puller is told, never what a peer holding the metadata can READ (and the pages cross
    UCX unencrypted). So the control channel must admit the deployment's decode ranks alone:
    under CURVE (the worker key), or over ipc in the engine's private folder."""
    if has_curve or kv_transfer_address.startswith("ipc://"):
        return None
    return (
        f"--kv-transfer-address {kv_transfer_address} without CURVE keys admits any peer that "
        "reaches it, and NIXL lets a peer that pulled once READ every page of the ranks' KV"
    )


def describe_unsupported_layout(kv_cache_config: KVCacheConfig) -> str | None:
    """Why this model's KV cannot move yet, or None when it can (protocol/kv_transfer.py)."""
    return describe_unsupported_groups(kv_cache_config.kv_cache_groups)
