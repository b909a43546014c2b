"""The checks on the ranks' replies to every step: that all ranks sampled the same tokens, and a
short name for a message that is not the reply awaited, for the error that follows.

Pure functions of the messages: worker_group.py and step_transport.py gather the replies and
raise; nothing here touches a socket or decides what a disagreement costs.
"""

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


def describe_message(message: WorkerToEngine) -> str:
    """A short name of a message for an error: its type, and the step of a reply."""
    match message:
        case ModelRunnerOutput():
            return f"a reply to step {message.step_id} as rank {message.rank}"
        case _:
            return type(message).__name__
