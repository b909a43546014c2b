"""KVCacheBlock (the metadata of one paged KV-cache block) and FreeKVCacheBlockQueue.

The queue is an intrusive doubly linked list threaded through the blocks themselves, so every
operation is O(1) per block and allocates nothing. It holds no policy: BlockPool decides the order.
"""

from collections.abc import Sequence
from dataclasses import dataclass

from engine_core.kv_cache.hashing import BlockHashWithGroupId

SENTINEL_BLOCK_ID = -1  # the id of the queue's fake head and tail; never a real block


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """Metadata of one block; the K/V data itself lives in the workers' paged tensors.

    A block is free when `ref_cnt == 0` (then it sits in the free queue, linked through
    `prev_free_block` / `next_free_block`) and in use otherwise (both links are None).
    """

    block_id: int
    ref_cnt: int = 0  # requests (and prefix hits) currently holding this block
    block_hash: BlockHashWithGroupId | None = None  # set once the block is full and cached
    prev_free_block: "KVCacheBlock | None" = None  # owned by FreeKVCacheBlockQueue
    next_free_block: "KVCacheBlock | None" = None  # owned by FreeKVCacheBlockQueue
    is_null: bool = False  # the placeholder block 0: never ref-counted, hashed or freed

    def __repr__(self) -> str:
        # Name the neighbours by id: printing them whole would recurse along the queue.
        prev_id = None if self.prev_free_block is None else self.prev_free_block.block_id
        next_id = None if self.next_free_block is None else self.next_free_block.block_id
        return (
            f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, "
            f"block_hash={self.block_hash!r}, prev={prev_id}, next={next_id}, "
            f"is_null={self.is_null})"
        )


class FreeKVCacheBlockQueue:
    """The free blocks in reuse order: the head is the next block handed out.

    Invariants: walking from the fake head reaches the fake tail after exactly `num_free_blocks`
    blocks; each block's `prev_free_block` is the block before it; a block not in the queue has
    both links None.
    """

    __slots__ = ("fake_free_list_head", "fake_free_list_tail", "num_free_blocks")

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        head = KVCacheBlock(SENTINEL_BLOCK_ID)
        tail = KVCacheBlock(SENTINEL_BLOCK_ID)
        self.fake_free_list_head = head
        self.fake_free_list_tail = tail
        self.num_free_blocks = len(blocks)
        _link_run(head, blocks, tail)

    def popleft(self) -> KVCacheBlock:
        """Take the block at the head."""
        block = self.fake_free_list_head.next_free_block
        if block is self.fake_free_list_tail or block is None:
            raise ValueError("cannot pop from the free block queue: it is empty")
        nxt = block.next_free_block
        self.fake_free_list_head.next_free_block = nxt
        nxt.prev_free_block = self.fake_free_list_head
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1
        return block

    def popleft_n(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` blocks from the head, in queue order."""
        if num_blocks > self.num_free_blocks or num_blocks < 0:
            raise ValueError(
                f"cannot pop {num_blocks} blocks from the free block queue: "
                f"{self.num_free_blocks} free"
            )
        if num_blocks == 0:
            return []
        head = self.fake_free_list_head
        block = head.next_free_block
        popped = [block] * num_blocks  # preallocated; every slot is overwritten below
        for idx in range(num_blocks):
            popped[idx] = block
            nxt = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            block = nxt
        head.next_free_block = block
        block.prev_free_block = head
        self.num_free_blocks -= num_blocks
        return popped

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink a block from anywhere in the queue."""
        prev = block.prev_free_block
        nxt = block.next_free_block
        if prev is None or nxt is None:
            raise ValueError(f"cannot remove block {block.block_id}: it is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def remove_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Unlink each of `blocks` from wherever it sits: `remove` for many, in one call."""
        num_removed = 0
        for block in blocks:
            prev = block.prev_free_block
            nxt = block.next_free_block
            if prev is None or nxt is None:
                self.num_free_blocks -= num_removed
                raise ValueError(
                    f"cannot remove block {block.block_id}: it is not in the free queue"
                )
            prev.next_free_block = nxt
            nxt.prev_free_block = prev
            block.prev_free_block = block.next_free_block = None
            num_removed += 1
        self.num_free_blocks -= num_removed

    def append(self, block: KVCacheBlock) -> None:
        """Put a block at the tail (reused last)."""
        tail = self.fake_free_list_tail
        last = tail.prev_free_block
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = tail
        tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Put blocks at the tail in the order given: the first of them is reused first."""
        if not blocks:
            return
        tail = self.fake_free_list_tail
        _link_run(tail.prev_free_block, blocks, tail)
        self.num_free_blocks += len(blocks)

    def prepend_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Put blocks at the head in the order given: the first of them becomes the head."""
        if not blocks:
            return
        head = self.fake_free_list_head
        _link_run(head, blocks, head.next_free_block)
        self.num_free_blocks += len(blocks)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Every free block, head first (a walk; for tests and invariants, not the hot path)."""
        blocks: list[KVCacheBlock] = []
        tail = self.fake_free_list_tail
        block = self.fake_free_list_head.next_free_block
        while block is not tail and block is not None:
            blocks.append(block)
            block = block.next_free_block
        return blocks

    def check_invariants(self) -> None:
        """Walk the list both ways and check the links and the count."""
        head, tail = self.fake_free_list_head, self.fake_free_list_tail
        seen: set[int] = set()
        prev, block = head, head.next_free_block
        while block is not tail:
            assert block is not None, f"free queue broken after block {prev.block_id}"
            assert block.prev_free_block is prev, (
                f"block {block.block_id} links back to {block.prev_free_block!r}, "
                f"expected block {prev.block_id}"
            )
            assert block.block_id not in seen, f"block {block.block_id} is in the queue twice"
            seen.add(block.block_id)
            prev, block = block, block.next_free_block
        assert tail.prev_free_block is prev, "the fake tail does not link back to the last block"
        assert len(seen) == self.num_free_blocks, (
            f"num_free_blocks is {self.num_free_blocks}, the walk found {len(seen)}"
        )

    def __len__(self) -> int:
        return self.num_free_blocks


def _link_run(before: KVCacheBlock, blocks: Sequence[KVCacheBlock], after: KVCacheBlock) -> None:
    """Splice `blocks`, in order, between the adjacent queue nodes `before` and `after`."""
    prev = before
    for block in blocks:
        block.prev_free_block = prev
        prev.next_free_block = block
        prev = block
    prev.next_free_block = after
    after.prev_free_block = prev
