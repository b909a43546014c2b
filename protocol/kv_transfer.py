"""Disaggregated prefill and decode (DESIGN.md §12): the wire of a KV transfer.

Four conversations carry it:
- front end -> prefill engine: an `EngineCoreRequest` with `do_remote_decode`, and the final
  `EngineCoreOutput` of that request, which carries a `KVTransferHandle` when its blocks are held;
- front end -> decode engine: the same request again with that handle (`kv_transfer_handle`);
- engine -> its ranks: `KVTransferOrders` riding a `SchedulerOutput` (pins and unpins on a prefill
  engine, pulls on a decode engine); each rank runs a pull beside its steps and reports its end
  once, in a later `ModelRunnerOutput` (`finished_kv_pulls`, `failed_kv_pulls`);
- decode rank r -> prefill rank r: `KVPullRequest`, answered by `KVPullReply` and the pages; or,
  under NIXL, by where the pages lie, which the decode rank READs and confirms with `KVPullDone`.

The contract:
- A handle is valid only while its prefill engine holds the blocks: from the output that carries
  it until the front end releases it (`release_kv_transfer`), or the engine's
  `--kv-transfer-timeout-s` passes. Its `secret` is 128 random bits the prefill engine drew and
  gave only to its ranks and to that one output; a pull must name the transfer id, the secret and
  a run of the pinned block ids exactly as pinned (ids and positions), or it is refused and
  reads nothing.
- Both sides must agree on the `KVTransferLayout` (a pair that does not is refused, naming the
  field), but for the TP size: a decode TP size k times the prefill's pairs too
  (describe_pair_mismatch). Block ids are each engine's own; pages move rank r to rank r, one
  page per shared KV tensor of the rank per block, in tensor order; with k > 1 decode rank r
  pulls from prefill rank r // k the (r % k)-th of k equal slices of each page's KV heads.
- The decode engine pulls only full prompt blocks that its own cache lacks, inserts them in its
  prefix cache, and admits the request, which then finds them as a prefix hit and computes at
  least the prompt's last token itself: its tokens are those one engine would have produced. A
  pull that fails costs only the transfer: the decode engine computes the prompt.
"""

from typing import Annotated

import msgspec

from protocol.kv_cache_spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
    bytes_per_block,
)

Secret = Annotated[str, msgspec.Meta(min_length=32, max_length=32, pattern="^[0-9a-f]+$")]
BlockIds = Annotated[list[Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]], msgspec.Meta()]
KV_TRANSFER_SOCKET_NAME = "kv-transfer"


def describe_unsupported_groups(groups: list[KVCacheGroupSpec]) -> str | None:
    """Why this model's KV cannot move between engines, or None when it can: groups of full or
    sliding-window attention (a Gemma-style hybrid included) of one block size, whose blocks
    hold nothing but the K/V of their own tokens."""
    for group in groups:
        if type(group.spec) not in (FullAttentionSpec, SlidingWindowSpec):
            kind = type(group.spec).__name__
            return f"a KV-cache group is {kind}: P/D moves full and sliding-window attention only"
    block_sizes = sorted({group.spec.block_size for group in groups})
    if len(block_sizes) > 1:
        return f"the KV-cache groups' block sizes differ ({block_sizes}): P/D moves one size"
    return None


class KVTransferLayout(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """What a prefill/decode pair must agree on for one's pages to mean the same to the other."""

    # the model's name: a built-in one's, or a checkpoint's file or folder name without the
    # path to it (copies mounted at other paths pair; model_fingerprint tells weights apart)
    model: str
    block_size: int  # tokens per block
    kv_cache_dtype: str  # the KV pages' element type, e.g. "float32"
    tp_size: int  # ranks: rank r pulls from rank r
    page_bytes: int  # bytes one block id costs on one rank, every shared tensor included
    # groups sharing the pool (a Gemma-style hybrid has full and sliding-window ones): a handle's
    # block_ids hold one run per group, in group order
    num_kv_cache_groups: int = 1
    # the weights' identity beyond the name: a checkpoint's config and weight files, a built-in
    # model's seed (worker/kv_transfer.model_fingerprint), so engines serving different models
    # never pair even under one name
    model_fingerprint: str = ""

    def mismatch(self, other: "KVTransferLayout") -> str | None:
        """The first field whose values differ, as `field: mine != theirs`; None if they agree.
        (A prefill/decode pair may differ in TP size: describe_pair_mismatch.)"""
        for field in self.__struct_fields__:
            mine, theirs = getattr(self, field), getattr(other, field)
            if mine != theirs:
                return f"{field}: {mine!r} != {theirs!r}"
        return None


def kv_transfer_layout(
    model_name: str, kv_cache_config: KVCacheConfig, tp_size: int, model_fingerprint: str = ""
) -> KVTransferLayout:
    """The layout an engine (and each of its ranks) announces, from the agreed KVCacheConfig;
    `model_name` is the model's (a checkpoint's path: only its last part is kept)."""
    groups = kv_cache_config.kv_cache_groups
    spec = groups[0].spec
    return KVTransferLayout(
        model=model_name.rstrip("/").rsplit("/", 1)[-1] or model_name,
        block_size=spec.block_size,
        kv_cache_dtype=str(getattr(spec, "dtype", "")),
        tp_size=tp_size,
        page_bytes=bytes_per_block(groups, tp_size),
        num_kv_cache_groups=len(groups),
        model_fingerprint=model_fingerprint,
    )


def describe_pair_mismatch(prefill: KVTransferLayout, decode: KVTransferLayout) -> str | None:
    """Why a decode engine of layout `decode` cannot pull from a prefill engine of layout
    `prefill`, as `field: prefill's != decode's (why)`; None when it can. Every field must agree
    but the TP size and the page bytes that follow from it: a decode TP size that is a multiple
    of the prefill's pairs when a block holds the same bytes over all ranks on both sides (no
    KV head replicated on either), and each decode rank then pulls its slice of the KV heads
    from the prefill rank that holds them (rank r from rank r // (decode TP / prefill TP))."""
    for field in prefill.__struct_fields__:
        mine, theirs = getattr(prefill, field), getattr(decode, field)
        if field not in ("tp_size", "page_bytes") and mine != theirs:
            return f"{field}: {mine!r} != {theirs!r}"
    if prefill.tp_size == decode.tp_size:
        if prefill.page_bytes != decode.page_bytes:
            return f"page_bytes: {prefill.page_bytes!r} != {decode.page_bytes!r}"
        return None
    if decode.tp_size % prefill.tp_size:
        return (
            f"tp_size: {prefill.tp_size!r} != {decode.tp_size!r} (a decode TP size must be a "
            "multiple of the prefill's)"
        )
    if prefill.page_bytes * prefill.tp_size != decode.page_bytes * decode.tp_size:
        return (
            f"page_bytes: {prefill.page_bytes!r} != {decode.page_bytes!r} (a block's bytes over "
            "all ranks differ: a KV head is replicated on one side)"
        )
    return None


class KVTransferHandle(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """What a decode engine needs to pull a request's prompt KV from the prefill engine."""

    engine_id: str  # the prefill engine's random id, announced in its routing info
    transfer_id: int  # unique within that engine, never reused
    secret: Secret  # hex of 16 random bytes; a pull without it reads nothing
    # the prefill engine's blocks of the prompt, in sequence order; with several KV-cache groups
    # one equal run per group, group after group, NULL_BLOCK_ID (0) where a sliding window had
    # already dropped a block (there is nothing to pull there)
    block_ids: BlockIds
    num_tokens: int  # prompt tokens whose KV those blocks hold
    endpoints: list[str]  # rank r's transfer server, at index r
    layout: KVTransferLayout


class KVPin(msgspec.Struct, frozen=True, array_like=True):
    """Prefill engine -> its ranks: serve pulls of these blocks under this transfer id (the
    handle's block_ids, NULL_BLOCK_ID included: it is never served)."""

    transfer_id: int
    secret: Secret
    block_ids: BlockIds


class KVPull(msgspec.Struct, frozen=True, array_like=True):
    """Decode engine -> its ranks: pull `src_block_ids` of a handle into `dst_block_ids`. No
    step reads or writes the destination blocks until every rank has reported the pull."""

    pull_id: int  # the decode engine's own, never reused: the ranks report the pull by it
    transfer_id: int  # the handle's
    secret: Secret  # the handle's
    endpoints: list[str]  # the handle's: rank r pulls from endpoints[r]
    first_block_idx: int  # where src_block_ids start in the handle's block_ids
    src_block_ids: BlockIds  # the prefill engine's block ids: handle.block_ids from that index
    dst_block_ids: BlockIds  # this engine's, aligned with src_block_ids
    layout: KVTransferLayout  # this engine's own; the prefill rank refuses a different one
    # where each of src_block_ids lies in the handle's block_ids, when they are not one run from
    # first_block_idx (several KV-cache groups); [] for a run
    src_block_idxs: list[int] = []


class KVTransferOrders(msgspec.Struct, frozen=True, array_like=True):
    """One step's transfer orders. Each rank applies pins and unpins before the step's forward:
    an unpin rides the first step that could reuse the blocks, so a pull is never served from a
    block given to another request. Pulls are queued then, and run beside the steps."""

    pins: list[KVPin] = []
    unpins: list[int] = []  # transfer ids no longer served
    pulls: list[KVPull] = []


class KVPullRequest(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """Decode rank -> prefill rank: the pages of `block_ids` under a transfer's secret."""

    protocol_version: int
    # the puller's rank: the server's, or with a decode TP size k times the prefill's one of
    # the server's k (rank // k == the server's), which is served its slice of the KV heads
    rank: int
    transfer_id: int
    secret: Secret
    # the pinned blocks from index first_block_idx on, in order: the server checks both, so a
    # handle whose block ids were changed reads nothing
    first_block_idx: int
    block_ids: BlockIds
    layout: KVTransferLayout  # the puller's; the server refuses a different one, naming the field
    # the puller shares this host's /dev/shm (it came over ipc://): the pages may come in a
    # shared memory segment rather than in frames
    via_shm: bool = False
    # the puller READs through NIXL (worker/kv_transfer_nixl.py): a server that has it answers
    # with where the pages lie instead of the pages, and awaits a KVPullDone
    via_nixl: bool = False
    # where each of block_ids lies in the pinned ones, when they are not one run from
    # first_block_idx (KVPull.src_block_idxs); [] for a run
    block_idxs: list[int] = []


class KVPullReply(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """Prefill rank -> decode rank: when `ok`, the pages, one run per shared KV tensor (block
    after block in the request's order), either in one frame per tensor following this one or,
    when `shm_name` is set, in that segment under /dev/shm, which the puller removes once read;
    `error` says why otherwise."""

    ok: bool
    error: str | None = None
    num_bytes: int = 0  # of the pages together
    shm_name: str | None = None  # the segment holding them; None: they follow in frames
    # Under NIXL (the request's via_nixl, when the server has it too): the server's agent, its
    # metadata, and where the pages lie on its device, one address per shared KV tensor and
    # block (tensor after tensor, block after block); no page follows
    nixl_agent: str | None = None
    nixl_metadata: bytes = b""
    nixl_addresses: list[int] = []
    nixl_device_id: int = 0


class KVPullDone(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """Decode rank -> prefill rank, after its NIXL READ of a pull's pages ended: answered ok
    only while the transfer still pins those blocks (no step reused them during the READ), and
    the pull completes only then."""

    protocol_version: int
    rank: int
    transfer_id: int
    secret: Secret
    first_block_idx: int
    block_ids: BlockIds
    block_idxs: list[int] = []  # as KVPullRequest's
