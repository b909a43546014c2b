"""Stop rules, applied to a request right after a sampled token is appended.

Pure: it reads the request and returns a finished status; the scheduler acts on it.
"""

from engine_core.sched.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> RequestStatus | None:
    """The status the request finishes with after its latest token, or None to continue.

    Until `min_tokens` outputs exist, EOS and stop ids are ignored; the length caps
    (`max_tokens`, `max_model_len`) always apply.
    """
    tokens = request.all_token_ids
    num_tokens = len(tokens)
    if (
        tokens[-1] in request.finishing_token_ids
        and num_tokens - request.num_prompt_tokens >= request.sampling_params.min_tokens
    ):
        return RequestStatus.FINISHED_STOPPED
    if num_tokens >= request.max_num_tokens or num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH_CAPPED
    return None
