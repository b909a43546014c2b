"""NativeCPUAttention: `blocks`, with every single-query row (decode steps, and the sampled rows
of the last layer) attended by a compiled kernel that reads K and V in place through the block
table (native/paged_decode.cpp), instead of gathering each context out of the pages and widening
it for SDPA.

On a 2-core host a 16-row bfloat16 decode step spent about half its time in that gather, the
widening and SDPA (31 of 65 ms); the kernel reads each K and V row once, in the cache's own
dtype. It also reads each row's query from q and writes its output into `out`, in their own
dtypes, by token index: gathering the rows, casting them and scattering the result back cost a
sixth to a quarter of a layer once the kernel itself took 0.13 ms. Prompt chunks (many queries
per sequence) keep `blocks`' path: SDPA's flash kernel is built for them. Where the kernel cannot
run (no compiler, a shape past its limits, a dtype it does not read, another device) the row
takes `blocks`' path, which computes the same attention; the tests check the two agree.
"""

import numpy as np
import torch

from worker.attention import PagedKV
from worker.attention_backends.block_gather import BlockChunk, BlockGatherAttention
from worker.attention_backends.native_build import load_native

DTYPE_CODES = {
    torch.float32: 0,
    torch.bfloat16: 1,
    torch.float16: 2,
    torch.float8_e4m3fn: 3,
}
HALF_AND_FLOAT = (torch.float32, torch.bfloat16, torch.float16)  # what it reads q in and writes
MAX_HEAD_DIM = 256  # the kernel's limits (paged_decode.cpp)
MAX_GROUP = 16
MAX_BLOCK_SIZE = 64


class NativeCPUAttention(BlockGatherAttention):
    """BlockGatherAttention whose single-query chunks the native kernel attends on the CPU."""

    def __init__(self, kv: PagedKV) -> None:
        super().__init__(kv)
        self._library = load_native() if kv.device.type == "cpu" else None

    def _attend_in_place(
        self,
        cache: torch.Tensor,
        chunk: BlockChunk,
        q: torch.Tensor,
        scale: float,
        softcap: float | None,
        out: torch.Tensor,
    ) -> bool:
        if chunk.starts is None or chunk.ends is None or not self._fits(cache, q, out):
            return False
        _, _, block_size, num_kv_heads, head_dim = cache.shape
        rows = chunk.query_idx.reshape(-1).contiguous()  # [S]: each sequence's token (q, out)
        num_seqs, num_heads = rows.shape[0], q.shape[1]
        block_ids = chunk.block_ids.contiguous()  # [S * nb] int64
        starts = np.ascontiguousarray(chunk.starts, dtype=np.int32)
        ends = np.ascontiguousarray(chunk.ends, dtype=np.int32)
        code = self._library.kvserve_paged_decode(
            q.data_ptr(),
            DTYPE_CODES[q.dtype],
            q.stride(0),
            rows.data_ptr(),
            cache.data_ptr(),
            DTYPE_CODES[cache.dtype],
            cache.stride(0),
            cache.stride(1),
            block_ids.data_ptr(),
            block_ids.numel() // num_seqs,
            starts.ctypes.data,
            ends.ctypes.data,
            num_seqs,
            num_heads,
            num_kv_heads,
            head_dim,
            block_size,
            scale,
            softcap or 0.0,
            out.data_ptr(),
            DTYPE_CODES[out.dtype],
            out.stride(0),
            torch.get_num_threads(),
        )
        if code != 0:
            raise RuntimeError(f"the native decode kernel refused its arguments (code {code})")
        return True

    def _fits(self, cache: torch.Tensor, q: torch.Tensor, out: torch.Tensor) -> bool:
        """The kernel runs here: loaded, on the CPU, dtypes it reads and writes, within its
        limits, and a cache and q whose token rows are contiguous [heads, head_dim]."""
        if self._library is None or cache.device.type != "cpu" or cache.dtype not in DTYPE_CODES:
            return False
        if q.dtype not in HALF_AND_FLOAT or out.dtype not in HALF_AND_FLOAT or out.stride(1) != 1:
            return False
        _, _, block_size, num_kv_heads, head_dim = cache.shape
        num_heads = q.shape[1]
        return (
            num_heads % num_kv_heads == 0
            and num_heads // num_kv_heads <= MAX_GROUP
            and head_dim <= MAX_HEAD_DIM
            and block_size <= MAX_BLOCK_SIZE
            and cache.stride(4) == 1
            and cache.stride(3) == head_dim
            and cache.stride(2) == num_kv_heads * head_dim
            and q.stride(2) == 1
            and q.stride(1) == head_dim
        )
