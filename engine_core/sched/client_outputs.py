"""Client outputs: what the scheduler tells clients, as one EngineCoreOutputs per client.

It only builds messages; it never changes a request or a queue.
"""

import time

from engine_core.sched.request import Request
from protocol.client_messages import EngineCoreOutput, EngineCoreOutputs, FinishReason


def group_by_client(
    outputs: dict[bytes, list[EngineCoreOutput]],
) -> dict[bytes, EngineCoreOutputs]:
    """One EngineCoreOutputs per client, all stamped with the same time."""
    now = time.time()
    return {client_id: EngineCoreOutputs(outs, now) for client_id, outs in outputs.items()}


def final_outputs(
    requests: list[Request], finish_reason: FinishReason | None, error: str | None
) -> dict[bytes, EngineCoreOutputs]:
    """The last output of each request finished between steps (an abort, a failure), by client."""
    outputs: dict[bytes, list[EngineCoreOutput]] = {}
    for request in requests:
        output = EngineCoreOutput(
            request.client_req_id, [], finish_reason, request.num_cached_tokens or 0, error
        )
        outputs.setdefault(request.client_id, []).append(output)
    return group_by_client(outputs)


def rejection(client_req_id: str, error: str) -> EngineCoreOutputs:
    """The one output of a request refused at admission."""
    output = EngineCoreOutput(client_req_id, [], FinishReason.ERROR, error=error)
    return EngineCoreOutputs([output], timestamp=time.time())
