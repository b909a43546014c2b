"""The Scheduler's invariant check, walked by tests and fuzzers after every step (never in the step
loop): it reads every queue and the KV-cache manager, so it costs O(requests + blocks).
"""

from typing import TYPE_CHECKING

from engine_core.sched.request import RequestStatus

if TYPE_CHECKING:
    from engine_core.sched.scheduler import Scheduler


def check_scheduler(scheduler: "Scheduler") -> None:
    """Assert the Scheduler's invariants (its docstring lists them) and those of every part it
    owns: requests, admission counts, the queue, the KV-cache manager, the steps in flight."""
    running_ids = {id(request) for request in scheduler.running}
    waiting = list(scheduler.waiting)
    assert len(running_ids) == len(scheduler.running), "a request is running twice"
    assert len(scheduler.running) <= scheduler.scheduler_config.max_num_seqs, (
        f"{len(scheduler.running)} running requests exceed max_num_seqs"
    )
    for request in scheduler.running:
        assert request.status is RequestStatus.RUNNING, f"{request!r} is in running"
    for request in waiting:
        assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), request
        assert request.num_computed_tokens == 0, f"{request!r} waits with computed tokens"
    live = {id(request) for request in scheduler.requests.values()}
    queued = running_ids | {id(request) for request in waiting}
    assert live == queued and len(queued) == len(scheduler.running) + len(waiting), (
        f"{len(live)} live requests, {len(scheduler.running)} running, {len(waiting)} waiting"
    )
    for request in scheduler.requests.values():
        request.check_invariants()
    num_logprob_requests = sum(
        request.sampling_params.logprobs is not None for request in scheduler.requests.values()
    )
    assert scheduler.num_logprob_requests == num_logprob_requests, (
        f"num_logprob_requests is {scheduler.num_logprob_requests}, expected {num_logprob_requests}"
    )
    num_prompt_logprob_requests = sum(
        request.prompt_logprobs is not None for request in scheduler.requests.values()
    )
    assert scheduler.num_prompt_logprob_requests == num_prompt_logprob_requests, (
        f"num_prompt_logprob_requests is {scheduler.num_prompt_logprob_requests}, expected "
        f"{num_prompt_logprob_requests}"
    )
    scheduler.admission.check_invariants([r.client_id for r in scheduler.requests.values()])
    scheduler.grammar.check_invariants(list(scheduler.requests.values()))
    scheduler.waiting.check_invariants()
    scheduler.kv_cache_manager.check_invariants()
    scheduler.steps_in_flight.check_invariants()
