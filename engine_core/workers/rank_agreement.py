"""The checks on the ranks' replies to every step: that all ranks sampled the same tokens, and a
short name for a message that is not the reply awaited, for the error that follows.

Pure functions of the messages: worker_group.py and step_transport.py gather the replies and
raise; nothing here touches a socket or decides what a disagreement costs.
"""

import msgspec

from protocol.buffers import pack_int32, unpack_int32
from protocol.worker_messages import ModelRunnerOutput, WorkerToEngine


def describe_disagreement(step_id: int, outputs: list[ModelRunnerOutput]) -> str | None:
    """Name the ranks whose sampled tokens differ from rank 0's, or None when all agree."""
    reference = outputs[0]
    differing = [
        out.rank
        for out in outputs[1:]
        if out.sampled_token_ids != reference.sampled_token_ids or out.handles != reference.handles
    ]
    if not differing:
        return None
    return (
        f"ranks disagree on the tokens of step {step_id}: "
        f"rank(s) {differing} differ from rank {reference.rank}"
    )


def with_every_failed_disk_slot(outputs: list[ModelRunnerOutput]) -> ModelRunnerOutput:
    """Rank 0's reply, carrying the disk slots that failed on any rank (sorted, once each).

    Each rank holds its own shard of a slot, so a slot is good only where every rank's copy is.
    """
    reference = outputs[0]
    if not any(out.failed_disk_slots for out in outputs):
        return reference
    failed: set[int] = set()
    for out in outputs:
        failed.update(unpack_int32(out.failed_disk_slots))
    return msgspec.structs.replace(reference, failed_disk_slots=pack_int32(sorted(failed)))


def with_every_kv_pull_report(outputs: list[ModelRunnerOutput]) -> ModelRunnerOutput:
    """The reply carrying every rank's P/D pull reports together: a pull id once per rank that
    finished it (and once per rank that failed it), the bytes all ranks pulled, and the pulls
    of their pinned blocks all ranks refused.

    Each rank pulls its own shard of a block, so the engine settles a pull only once every rank
    has reported it, which may take several steps: the counts add up across replies.
    """
    reference = outputs[0]
    if not any(out.finished_kv_pulls or out.num_refused_kv_pulls for out in outputs):
        return reference
    return msgspec.structs.replace(
        reference,
        finished_kv_pulls=[pull_id for out in outputs for pull_id in out.finished_kv_pulls],
        failed_kv_pulls=[pull_id for out in outputs for pull_id in out.failed_kv_pulls],
        kv_pull_bytes=sum(out.kv_pull_bytes for out in outputs),
        num_refused_kv_pulls=sum(out.num_refused_kv_pulls for out in outputs),
    )


def describe_message(message: WorkerToEngine) -> str:
    """A short name of a message for an error: its type, and the step of a reply."""
    match message:
        case ModelRunnerOutput():
            return f"a reply to step {message.step_id} as rank {message.rank}"
        case _:
            return type(message).__name__
