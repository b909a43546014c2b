"""The rules of the engine-worker handshake (DESIGN.md §6), as pure checks on the messages.

No sockets here: worker_group.py collects the messages and calls these checks, so every refusal
reason is testable without processes.
"""

from protocol import PROTOCOL_VERSION
from protocol.worker_messages import ModelInfo, WorkerHello, WorkerReady


class HandshakeError(RuntimeError):
    """A rank was refused during startup; the message says which rank and what differed."""


def check_hello(hello: WorkerHello, tp_size: int, known: dict[int, WorkerHello]) -> None:
    """Raise HandshakeError when `hello` cannot join the ranks already `known`."""
    who = f"rank {hello.rank} (pid {hello.pid} on {hello.host})"
    if hello.protocol_version != PROTOCOL_VERSION:
        raise HandshakeError(
            f"{who} speaks protocol version {hello.protocol_version}, expected {PROTOCOL_VERSION}"
        )
    if hello.tp_size != tp_size:
        raise HandshakeError(f"{who} has tp_size={hello.tp_size}, expected {tp_size}")
    if hello.rank >= tp_size:
        raise HandshakeError(f"{who} is outside the group: expected a rank in [0, {tp_size})")
    if hello.rank in known:
        first = known[hello.rank]
        raise HandshakeError(
            f"duplicate {who}: rank {hello.rank} already joined "
            f"from pid {first.pid} on {first.host}"
        )
    if hello.num_blocks_available < 2:
        raise HandshakeError(
            f"{who} can hold {hello.num_blocks_available} blocks, expected at least 2"
        )
    for other in known.values():
        difference = describe_model_difference(other.model_info, hello.model_info)
        if difference:
            raise HandshakeError(f"{who} runs another model than rank {other.rank}: {difference}")


def describe_model_difference(expected: ModelInfo, found: ModelInfo) -> str | None:
    """Name the first field in which two ranks' model infos differ, or None when they agree."""
    for field in expected.__struct_fields__:
        mine, theirs = getattr(expected, field), getattr(found, field)
        if mine != theirs:
            return f"{field} is {theirs!r}, expected {mine!r}"
    return None


def check_ready(
    ready: WorkerReady, num_blocks: int, ready_ranks: set[int], generation: int = 1
) -> None:
    if ready.generation != generation:
        raise HandshakeError(
            f"rank {ready.rank} is ready for worker generation {ready.generation}, "
            f"expected {generation}"
        )
    if ready.rank in ready_ranks:
        raise HandshakeError(f"rank {ready.rank} said WorkerReady twice")
    if ready.num_blocks != num_blocks:
        raise HandshakeError(
            f"rank {ready.rank} allocated {ready.num_blocks} blocks, expected {num_blocks}"
        )


def missing_ranks(tp_size: int, present: set[int] | dict[int, object]) -> list[int]:
    return [rank for rank in range(tp_size) if rank not in present]
