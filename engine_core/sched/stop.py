"""Stop rules, applied to a request right after a sampled token is appended.

Pure: it reads the request and returns a finished status; the scheduler acts on it.
"""

from engine_core.sched.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> RequestStatus | None:
    """The status the request finishes with after its latest token, or None to continue.

    Until `min_tokens` outputs exist, EOS and stop ids are ignored; the length caps
    (`max_tokens`, `max_model_len`) always apply.
    """
    params = request.sampling_params
    num_output_tokens = len(request.all_token_ids) - request.num_prompt_tokens
    if num_output_tokens >= params.min_tokens:
        last_token_id = request.all_token_ids[-1]
        if last_token_id == request.eos_token_id and not params.ignore_eos:
            return RequestStatus.FINISHED_STOPPED
        if params.stop_token_ids and last_token_id in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
    if num_output_tokens >= params.max_tokens or len(request.all_token_ids) >= max_model_len:
        return RequestStatus.FINISHED_LENGTH_CAPPED
    return None
