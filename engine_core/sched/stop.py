"""The stop rule: whether a request finishes once it holds a given number of tokens.

Pure: it reads the request and returns a finished status; the scheduler acts on it. It is the one
place the rule lives: the scheduler asks it of each sampled token, and, with asynchronous
scheduling, of each token still in flight before scheduling past it.
"""

from engine_core.sched.request import Request, RequestStatus

_FINISHED_STOPPED = RequestStatus.FINISHED_STOPPED
_FINISHED_LENGTH_CAPPED = RequestStatus.FINISHED_LENGTH_CAPPED


def check_stop(
    request: Request, num_tokens: int, last_token_id: int | None
) -> RequestStatus | None:
    """The status the request finishes with once it holds `num_tokens` tokens, the last of them
    `last_token_id`, or None to continue.

    `last_token_id` is None while that token is still being sampled (asynchronous scheduling):
    only the length cap can tell then. Until `min_tokens` outputs exist, EOS and stop ids are
    ignored; the length cap (`max_tokens` and `max_model_len`, folded into the request's
    `max_num_tokens`) always applies.
    """
    if (
        last_token_id is not None
        and last_token_id in request.finishing_token_ids
        and num_tokens - request.num_prompt_tokens >= request.sampling_params.min_tokens
    ):
        return _FINISHED_STOPPED
    if num_tokens >= request.max_num_tokens:
        return _FINISHED_LENGTH_CAPPED
    return None
