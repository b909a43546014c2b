"""A Hypothesis state machine over the Scheduler, through EngineCore and the FakeExecutor.

Arrivals that share prefixes, aborts, prefix-cache resets and steps, in pools small enough to
preempt, under a config drawn once per example. A reference model says what each request must
produce, checked after every rule and in full once the engine is drained: nothing leaks, and no
prefix hit covers tokens that no request admitted earlier held, or that a reset dropped.
"""

from array import array

import hypothesis.strategies as st
import msgspec
from fake_executor import Harness, next_token
from hypothesis import event
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from protocol.client_messages import FinishReason
from protocol.sampling import SamplingParams

BLOCK_SIZE = 4
VOCAB_SIZE = 16  # small, so that EOS and stop ids come up
EOS = 0
MAX_MODEL_LEN = 40
MAX_LIVE = 10  # unfinished requests; an `add` past it steps instead
MAX_NUM_SEQS = 6
# How prompts are cut: (enable_chunked_prefill, max_num_batched_tokens, long_prefill_threshold)
PREFILL_MODES = {"chunked": (True, 16, None), "capped": (True, 16, 8), "whole": (False, 40, None)}
BASES = ([3] * 20, list(range(1, 16)) + [5] * 5, [7, 9] * 10)  # prefixes requests share


def expected_output(
    prompt: list[int], params: SamplingParams, max_model_len: int
) -> tuple[list[int], FinishReason]:
    """What the stop rules leave of the fake model's tokens for `prompt`, and why it stops."""
    finishing = set(params.stop_token_ids) | (set() if params.ignore_eos else {EOS})
    cap = min(len(prompt) + params.max_tokens, max_model_len)
    sequence, out = array("i", prompt), []
    while True:
        token = next_token(sequence, VOCAB_SIZE)
        sequence.append(token)
        out.append(token)
        if token in finishing and len(out) >= params.min_tokens:
            return out, FinishReason.STOP
        if len(sequence) >= cap:
            return out, FinishReason.LENGTH


def shared_blocks_tokens(prompt: list[int], other: list[int]) -> int:
    """The tokens of the whole blocks at the start of `prompt` that `other` also starts with."""
    num_tokens = 0
    while num_tokens + BLOCK_SIZE <= len(prompt) and (
        prompt[num_tokens : num_tokens + BLOCK_SIZE] == other[num_tokens : num_tokens + BLOCK_SIZE]
    ):
        num_tokens += BLOCK_SIZE
    return num_tokens


class SchedulerMachine(RuleBasedStateMachine):
    """Requests arrive, are aborted and run; every step is checked against the reference."""

    def __init__(self) -> None:
        super().__init__()
        self.harness: Harness | None = None
        self.prompts: dict[str, list[int]] = {}
        self.expected: dict[str, tuple[list[int], FinishReason]] = {}
        self.aborted: set[str] = set()  # aborted while still unfinished
        self.reset_away: set[str] = set()  # finished before the last prefix-cache reset
        self.by_handle: dict[int, str] = {}
        # per request, once first scheduled: its place in admission order, and the requests
        # whose blocks a reset had dropped by then
        self.admitted: dict[str, tuple[int, set[str]]] = {}
        self.enable_prefix_caching = False  # `build` draws these
        self.max_tokens_per_request = 0

    @initialize(
        async_scheduling=st.booleans(),
        enable_prefix_caching=st.booleans(),
        policy=st.sampled_from(["fcfs", "priority"]),
        sliding_window=st.sampled_from([None, 6]),
        num_blocks=st.integers(12, 32),  # one request needs up to 10 (engine refuses fewer)
        prefill=st.sampled_from(sorted(PREFILL_MODES)),
        reserve_full_prompt=st.booleans(),
    )
    def build(
        self,
        async_scheduling: bool,
        enable_prefix_caching: bool,
        policy: str,
        sliding_window: int | None,
        num_blocks: int,
        prefill: str,
        reserve_full_prompt: bool,
    ) -> None:
        is_chunked, max_num_batched_tokens, threshold = PREFILL_MODES[prefill]
        window_blocks = 0 if sliding_window is None else 10  # the engine plans a window group
        self.harness = Harness(
            num_blocks=num_blocks + window_blocks,
            block_size=BLOCK_SIZE,
            vocab_size=VOCAB_SIZE,
            eos_token_ids=[EOS],
            max_model_len=MAX_MODEL_LEN,
            enable_prefix_caching=enable_prefix_caching,
            sliding_window=sliding_window,
            enable_chunked_prefill=is_chunked,
            max_num_batched_tokens=max_num_batched_tokens,
            long_prefill_token_threshold=threshold,
            reserve_full_prompt=reserve_full_prompt,
            max_num_seqs=MAX_NUM_SEQS,
            scheduling_policy=policy,
            async_scheduling=async_scheduling,
        )
        self.enable_prefix_caching = enable_prefix_caching
        self.max_tokens_per_request = threshold or max_num_batched_tokens

    def _live(self) -> list[str]:
        assert self.harness is not None
        return [r for r in self.prompts if r not in self.harness.finish_reasons]

    @rule(data=st.data())
    def add(self, data: st.DataObject) -> None:
        assert self.harness is not None
        if len(self._live()) >= MAX_LIVE:
            self.step()
            return
        base = data.draw(st.sampled_from(BASES))[: data.draw(st.integers(0, 20))]
        tail = data.draw(st.lists(st.integers(1, VOCAB_SIZE - 1), min_size=0 if base else 1))
        prompt = (base + tail)[: MAX_MODEL_LEN - 1]
        max_tokens = data.draw(st.integers(1, 16))
        params = SamplingParams(
            max_tokens=max_tokens,
            min_tokens=data.draw(st.integers(0, max_tokens)),
            ignore_eos=data.draw(st.booleans()),
            stop_token_ids=data.draw(st.lists(st.integers(1, VOCAB_SIZE - 1), max_size=2)),
        )
        req_id = f"r{len(self.prompts)}"
        rejection = self.harness.add(
            req_id,
            prompt,
            priority=data.draw(st.integers(0, 2)),
            arrival_time=float(len(self.prompts)),
            **msgspec.structs.asdict(params),
        )
        assert rejection is None, f"{req_id} rejected: {rejection}"
        self.prompts[req_id] = prompt
        self.expected[req_id] = expected_output(prompt, params, MAX_MODEL_LEN)
        self.by_handle[self.harness.handle(req_id)] = req_id

    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        assert self.harness is not None
        live = self._live()
        if not live:
            return
        req_id = data.draw(st.sampled_from(live))
        self.harness.abort([req_id])
        self.aborted.add(req_id)
        assert self.harness.finish_reasons[req_id] == FinishReason.ABORT

    @rule()
    def reset_prefix_cache(self) -> None:
        """Refused while a request holds blocks; once done, no later request hits what the
        requests finished by then computed."""
        assert self.harness is not None
        is_reset, reason = self.harness.core.reset_prefix_cache()
        if not is_reset:
            assert reason is not None and "cannot reset the prefix cache" in reason, reason
            return
        assert not self.harness.scheduler.running, "a reset while requests run"
        event("the prefix cache was reset")
        self.reset_away = set(self.harness.finish_reasons)

    @rule()
    def step(self) -> None:
        assert self.harness is not None
        num_preemptions = self.harness.scheduler.num_preemptions
        num_outputs = len(self.harness.scheduler_outputs)
        self.harness.step()
        for output in self.harness.scheduler_outputs[num_outputs:]:
            for new in output.scheduled_new_reqs:
                req_id = self.by_handle[new.handle]
                if req_id not in self.admitted:
                    self.admitted[req_id] = (len(self.admitted), set(self.reset_away))
        if self.harness.scheduler.num_preemptions > num_preemptions:
            event("a step preempted")
        self.harness.check_worker_tables()
        self.harness.check_last_step_budget(self.max_tokens_per_request, MAX_NUM_SEQS)

    @invariant()
    def engine_is_consistent(self) -> None:
        """The scheduler, managers and pool hold their invariants (each step checks them too)."""
        if self.harness is not None:
            self.harness.core.check_invariants()

    @invariant()
    def outputs_follow_the_reference(self) -> None:
        """Every request's tokens so far start its reference output; a finished one's are all
        of it (or a start of it, if aborted), with the reference's reason."""
        if self.harness is None:
            return
        for req_id, (want, reason) in self.expected.items():
            got = self.harness.tokens[req_id]
            assert got == want[: len(got)], f"{req_id}: {got}, expected a start of {want}"
            finished = self.harness.finish_reasons.get(req_id)
            if finished is not None and req_id not in self.aborted:
                assert (got, finished) == (want, reason), f"{req_id}: {got} {finished!r}"

    def _check_hits(self) -> None:
        """A request's prefix hit covers whole blocks that another request's tokens began with,
        one admitted before it whose blocks no reset had dropped by then."""
        assert self.harness is not None
        for req_id, prompt in self.prompts.items():
            num_cached = self.harness.num_cached_tokens.get(req_id, 0)
            if req_id not in self.admitted:  # aborted before it ever ran
                assert num_cached == 0, (req_id, num_cached)
                continue
            place, unseen = self.admitted[req_id]
            bound = max(
                (
                    shared_blocks_tokens(prompt, self.prompts[other] + self.expected[other][0])
                    for other, (other_place, _) in self.admitted.items()
                    if other_place < place and other not in unseen
                ),
                default=0,
            )
            assert num_cached % BLOCK_SIZE == 0 and num_cached < len(prompt), (req_id, num_cached)
            assert num_cached <= (bound if self.enable_prefix_caching else 0), (req_id, bound)
            if num_cached:
                event("a prefix hit")

    def teardown(self) -> None:
        """Drain the engine: every request finishes as the reference says, nothing is left."""
        if self.harness is None:
            return
        for _ in range(10_000):  # through `step`, which records each admission
            if not self.harness.core.has_work():
                break
            self.step()
        self.harness.check_no_leaks()
        self.outputs_follow_the_reference()
        assert set(self.harness.finish_reasons) == set(self.prompts)
        self._check_hits()


TestSchedulerMachine = SchedulerMachine.TestCase
