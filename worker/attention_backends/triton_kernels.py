"""Triton kernels of paged attention: `store_kv` writes one step's K/V into a layer's paged cache,
and `paged_attention` attends every query of the step over its context through the block table.

Both take plain tensors and know nothing of kvserve's classes. Importing this module imports
triton: only a CUDA worker (or a test under TRITON_INTERPRET=1) may import it.

The cache of one layer is [num_blocks, 2, block_size, num_kv_heads, head_dim] (index 0 of dim 1
is K, 1 is V); the kernels address it through all five strides, so a group whose pages a shared
tensor pads (block stride above 2 * block_size * num_kv_heads * head_dim) works unchanged.

- `store_kv` writes K and V of token t to slot_mapping[t] = block_id * block_size + offset; a
  negative slot writes nothing (the padded rows of a CUDA graph). It reads nothing else.
- `paged_attention`: request r owns queries [query_start_loc[r], query_start_loc[r + 1]), the
  last tokens of its context of seq_lens[r] tokens, so its query i sits at position
  p = seq_lens[r] - num_queries_r + i and reads positions [max(0, p - window + 1), p] (from 0
  without a window) through block_table[r]. It loads no position outside the reads of its tile's
  queries (the engine may have freed those blocks) and writes only the rows of owned queries.

Run by the interpreter (CPU tensors), two limits shape the kernel. Its triton 3.6 with numpy 2.4
cannot bound a `for` loop by a kernel argument, a loaded value or anything assigned, only by an
inline constant, so there every program walks the key tiles of the host's `max_seq_len` (a
constexpr) and masks those outside its reads; compiled, each walks only its own. And its bf16
`tl.dot` gives wrong results, so there dots are in float32; compiled, they take the query's dtype
(float32 ones in IEEE precision, not TF32) and accumulate in float32.
"""

import torch
import triton
import triton.language as tl

MIN_DOT_SIZE = 16  # compiled tl.dot needs M, N and K of at least 16
KEY_TILE_SIZE = 32  # context positions per step of the online softmax; a power of two >= 16
MAX_TILE_ROWS = 64  # (query, head) rows per program at most, unless one KV head has more heads


def store_kv(
    kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write K and V [T, num_kv_heads, head_dim] of T tokens into `kv_cache` at `slot_mapping` [T]
    (block_id * block_size + offset; a negative slot writes nothing), cast to the cache's dtype."""
    num_tokens, num_kv_heads, head_dim = k.shape
    _check_cache(kv_cache, num_kv_heads, head_dim)
    if v.shape != k.shape or slot_mapping.shape != (num_tokens,):
        raise ValueError(
            f"store_kv got k {tuple(k.shape)}, v {tuple(v.shape)} and slot_mapping "
            f"{tuple(slot_mapping.shape)}: expected v as k and slot_mapping [{num_tokens}]"
        )
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        kv_cache,
        k,
        v,
        slot_mapping,
        *kv_cache.stride(),
        *k.stride(),
        *v.stride(),
        kv_cache.shape[2],
        num_kv_heads,
        head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        DIM_PAD=triton.next_power_of_2(head_dim),
    )


@triton.jit
def _store_kv_kernel(
    cache_ptr,
    k_ptr,
    v_ptr,
    slot_ptr,
    cache_stride_block,
    cache_stride_kind,
    cache_stride_offset,
    cache_stride_head,
    cache_stride_dim,
    k_stride_token,
    k_stride_head,
    k_stride_dim,
    v_stride_token,
    v_stride_head,
    v_stride_dim,
    block_size,
    num_kv_heads,
    head_dim,
    HEADS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
):
    """One program per token: all of its KV heads."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, HEADS_PAD)[:, None]  # [HEADS_PAD, 1]
    dims = tl.arange(0, DIM_PAD)[None, :]  # [1, DIM_PAD]
    mask = (heads < num_kv_heads) & (dims < head_dim)
    k = tl.load(k_ptr + token * k_stride_token + heads * k_stride_head + dims * k_stride_dim, mask)
    v = tl.load(v_ptr + token * v_stride_token + heads * v_stride_head + dims * v_stride_dim, mask)
    k_dst = (
        cache_ptr
        + (slot // block_size) * cache_stride_block
        + (slot % block_size) * cache_stride_offset
        + heads * cache_stride_head
        + dims * cache_stride_dim
    )
    tl.store(k_dst, k.to(cache_ptr.dtype.element_ty), mask)
    tl.store(k_dst + cache_stride_kind, v.to(cache_ptr.dtype.element_ty), mask)


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    out: torch.Tensor,
) -> None:
    """Attention of queries `q` [T, H, head_dim] over their paged contexts, written into `out`
    [T, H, head_dim] (q's dtype); rows of tokens no request owns are left as they are.

    Args:
        block_table: [R, max_blocks] int32, the block ids of each request's context in order.
        seq_lens: [R] int32, each request's context length, its queries included.
        query_start_loc: [R + 1] int32, request r owns tokens [query_start_loc[r], [r + 1]).
        max_query_len: the most queries any request has (host side: it sizes the tiles).
        max_seq_len: at least every seq_lens[r] (host side: it bounds the interpreter's loop).
        softcap: scores become softcap * tanh(score / softcap) before masking; None: unchanged.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    num_reqs = seq_lens.shape[0]
    _check_cache(kv_cache, num_kv_heads, head_dim)
    if num_heads % num_kv_heads or out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(
            f"paged_attention got q {tuple(q.shape)} for {num_kv_heads} KV heads and out "
            f"{tuple(out.shape)} {out.dtype}: expected heads a multiple of the KV heads and out "
            f"as q in {q.dtype}"
        )
    if block_table.shape[0] != num_reqs or query_start_loc.shape != (num_reqs + 1,):
        raise ValueError(
            f"paged_attention got {num_reqs} seq_lens, block_table {tuple(block_table.shape)} and "
            f"query_start_loc {tuple(query_start_loc.shape)}: expected {num_reqs} rows and "
            f"{num_reqs + 1} starts"
        )
    if num_tokens == 0 or num_reqs == 0:
        return
    group = num_heads // num_kv_heads
    # Each program takes one request's tile of queries with all heads of one KV head, packed as
    # rows (query, head); decode fills a tile's rows with one query's heads, prefill with more.
    tile_rows = max(MIN_DOT_SIZE, triton.next_power_of_2(group * min(max_query_len, num_tokens)))
    tile_rows = max(min(tile_rows, MAX_TILE_ROWS), triton.next_power_of_2(group))
    tile_queries = tile_rows // group
    # Request r's tiles are numbered from query_start_loc[r] // tile_queries + r on, a numbering
    # the kernel can search without the host; it never needs more than this many tiles.
    num_tiles = num_tokens // tile_queries + num_reqs
    is_interpreted = q.device.type == "cpu"  # triton compiles for GPUs only
    is_fp32_dot = is_interpreted or q.dtype == torch.float32
    _paged_attention_kernel[(num_tiles, num_kv_heads)](
        q,
        out,
        kv_cache,
        block_table,
        seq_lens,
        query_start_loc,
        *q.stride(),
        *out.stride(),
        *kv_cache.stride(),
        block_table.stride(0),
        num_reqs,
        kv_cache.shape[2],
        head_dim,
        scale,
        sliding_window if sliding_window is not None else 0,
        softcap if softcap is not None else 0.0,
        GROUP=group,
        TILE_QUERIES=tile_queries,
        TILE_ROWS=tile_rows,
        TILE_KEYS=KEY_TILE_SIZE,
        DIM_PAD=max(MIN_DOT_SIZE, triton.next_power_of_2(head_dim)),
        HAS_WINDOW=sliding_window is not None,
        HAS_SOFTCAP=softcap is not None,
        IS_INTERPRETED=is_interpreted,
        DOT_PRECISION="ieee" if is_fp32_dot else "tf32",
        # a constant, so that compiled kernels are not specialized on it
        INTERPRETED_KEY_TILES=triton.cdiv(max_seq_len, KEY_TILE_SIZE) if is_interpreted else 0,
    )


def _check_cache(kv_cache: torch.Tensor, num_kv_heads: int, head_dim: int) -> None:
    expected = (2, num_kv_heads, head_dim)  # of dims 1, 3 and 4
    if kv_cache.dim() != 5 or (kv_cache.shape[1], *kv_cache.shape[3:]) != expected:
        raise ValueError(
            f"KV cache is {tuple(kv_cache.shape)}: expected [num_blocks, 2, block_size, "
            f"{num_kv_heads}, {head_dim}]"
        )


@triton.jit(do_not_specialize=["num_reqs"])
def _paged_attention_kernel(
    q_ptr,
    out_ptr,
    cache_ptr,
    block_table_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    q_stride_token,
    q_stride_head,
    q_stride_dim,
    out_stride_token,
    out_stride_head,
    out_stride_dim,
    cache_stride_block,
    cache_stride_kind,
    cache_stride_offset,
    cache_stride_head,
    cache_stride_dim,
    block_table_stride,
    num_reqs,
    block_size,
    head_dim,
    scale,
    sliding_window,
    softcap,
    GROUP: tl.constexpr,  # query heads per KV head
    TILE_QUERIES: tl.constexpr,  # queries of one request per program
    TILE_ROWS: tl.constexpr,  # a power of two >= TILE_QUERIES * GROUP: one row per (query, head)
    TILE_KEYS: tl.constexpr,  # context positions per step of the online softmax
    DIM_PAD: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    IS_INTERPRETED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 dots, else "tf32" (Triton's default)
    INTERPRETED_KEY_TILES: tl.constexpr,  # interpreted: key tiles of the longest context; else 0
):
    """Program (tile, kv_head): up to TILE_QUERIES queries of one request, each with the GROUP
    query heads that read `kv_head`, attended with an online softmax in float32."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = _find_request(query_start_loc_ptr, tile, num_reqs, TILE_QUERIES)
    query_start = tl.load(query_start_loc_ptr + req)
    num_queries = tl.load(query_start_loc_ptr + req + 1) - query_start
    first_query = (tile - (query_start // TILE_QUERIES + req)) * TILE_QUERIES
    if first_query >= num_queries:
        return  # a spare tile: the grid is an upper bound
    seq_len = tl.load(seq_lens_ptr + req)
    rows = tl.arange(0, TILE_ROWS)
    query = first_query + rows // GROUP  # [TILE_ROWS] index among the request's queries
    head = kv_head * GROUP + rows % GROUP  # [TILE_ROWS]
    is_row = (rows < TILE_QUERIES * GROUP) & (query < num_queries)
    position = seq_len - num_queries + query  # [TILE_ROWS]
    token = (query_start + query).to(tl.int64)
    dims = tl.arange(0, DIM_PAD)
    row_mask = is_row[:, None] & (dims[None, :] < head_dim)
    q = tl.load(
        q_ptr
        + token[:, None] * q_stride_token
        + head[:, None] * q_stride_head
        + dims[None, :] * q_stride_dim,
        row_mask,
        other=0.0,
    )  # [TILE_ROWS, DIM_PAD]
    if IS_INTERPRETED:
        q = q.to(tl.float32)

    # The tile reads [context_start, context_end): its first query's window to its last query.
    first_position = seq_len - num_queries + first_query
    context_end = tl.minimum(first_position + TILE_QUERIES, seq_len)
    context_start = 0
    if HAS_WINDOW:
        context_start = tl.maximum(first_position - sliding_window + 1, 0)
    block_row_ptr = block_table_ptr + req.to(tl.int64) * block_table_stride
    row_max = tl.full([TILE_ROWS], float("-inf"), tl.float32)  # of the scores seen so far
    denominator = tl.zeros([TILE_ROWS], tl.float32)  # sum of exp(score - row_max)
    acc = tl.zeros([TILE_ROWS, DIM_PAD], tl.float32)  # sum of exp(score - row_max) * value
    # Interpreted, every program walks the same constant number of key tiles and masks those
    # outside its reads; the bounds stay inline because the interpreter turns an assigned
    # constant into a tensor, which its `range` refuses.
    for key_tile in range(
        0 if IS_INTERPRETED else context_start // TILE_KEYS,
        INTERPRETED_KEY_TILES if IS_INTERPRETED else tl.cdiv(context_end, TILE_KEYS),
    ):
        key_position = key_tile * TILE_KEYS + tl.arange(0, TILE_KEYS)  # [TILE_KEYS]
        is_read = (key_position >= context_start) & (key_position < context_end)
        block_id = tl.load(block_row_ptr + key_position // block_size, is_read, other=0)
        key_offset = (
            block_id.to(tl.int64) * cache_stride_block
            + (key_position % block_size) * cache_stride_offset
            + kv_head * cache_stride_head
        )  # [TILE_KEYS] where each position's K starts
        k_t = tl.load(
            cache_ptr + key_offset[None, :] + dims[:, None] * cache_stride_dim,
            is_read[None, :] & (dims[:, None] < head_dim),
            other=0.0,
        )  # [DIM_PAD, TILE_KEYS]
        v = tl.load(
            cache_ptr + cache_stride_kind + key_offset[:, None] + dims[None, :] * cache_stride_dim,
            is_read[:, None] & (dims[None, :] < head_dim),
            other=0.0,
        )  # [TILE_KEYS, DIM_PAD]
        scores = tl.dot(q, k_t.to(q.dtype), input_precision=DOT_PRECISION) * scale
        if HAS_SOFTCAP:
            scores = softcap * _tanh(scores / softcap)
        is_visible = is_read[None, :] & (key_position[None, :] <= position[:, None])
        if HAS_WINDOW:
            is_visible = is_visible & (key_position[None, :] > position[:, None] - sliding_window)
        scores = tl.where(is_visible, scores, float("-inf"))  # [TILE_ROWS, TILE_KEYS]
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        # A row that has seen no visible position keeps max -inf: shift it by 0 so exp gives 0.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        weights = tl.exp(scores - shift[:, None])  # [TILE_ROWS, TILE_KEYS]
        rescale = tl.exp(row_max - shift)  # [TILE_ROWS] the old sums' factor
        denominator = denominator * rescale + tl.sum(weights, axis=1)
        acc = acc * rescale[:, None] + tl.dot(
            weights.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION
        )
        row_max = new_max

    result = acc / tl.where(denominator > 0, denominator, 1.0)[:, None]
    tl.store(
        out_ptr
        + token[:, None] * out_stride_token
        + head[:, None] * out_stride_head
        + dims[None, :] * out_stride_dim,
        result.to(out_ptr.dtype.element_ty),
        row_mask,
    )


@triton.jit
def _find_request(query_start_loc_ptr, tile, num_reqs, TILE_QUERIES: tl.constexpr):
    """The request whose tiles hold `tile`: the last r with query_start_loc[r] // TILE_QUERIES + r
    <= tile (a binary search; the numbering grows strictly with r)."""
    lo = 0
    hi = num_reqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        is_at_or_before = tl.load(query_start_loc_ptr + mid) // TILE_QUERIES + mid <= tile
        lo = tl.where(is_at_or_before, mid, lo)
        hi = tl.where(is_at_or_before, hi, mid)
    return lo


@triton.jit
def _tanh(x):
    """tanh from exp, which every backend and the interpreter have: 1 - 2 / (e^2x + 1)."""
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)
