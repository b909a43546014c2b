"""EngineRecord: everything the front end knows of one engine, in one place: its liveness and
what it announced, the work this front end has outstanding there (EngineLoad, the one count of
outstanding tokens), the router's counts of its decisions there, and its KV-event stream with the
index's slice of its blocks (KVEventStream). Plain state: no sockets, no awaits, no clock.

The pool makes one record per engine address, in flag order, and hands the same list to the
Router, the KV-event subscriber and the KV index: each writes its own part, and every reader
(the policies, /router, /metrics) reads the one record, so no two copies of a count can drift.
The engine's connection (its client) is the pool's EngineHandle, which holds its record.
"""

import asyncio
from collections import deque
from dataclasses import dataclass, field

from kv_hashing.hash_params import HashParams

RECENT_BATCHES = 1024  # digests kept to tell a late duplicate from a restarted publisher


@dataclass(slots=True, eq=False)
class EngineLoad:
    """One engine's outstanding work: what the front end has sent it and not yet seen finish,
    plus the work of other clients, from the engine's own last load report.

    A request waits (its prompt tokens less its predicted hit count as waiting prefill) until
    its first output, then decodes until it ends. A report (`on_report`) counts everything the
    engine holds, this front end's requests included, and the engine counts a waiting request's
    whole prompt: the others' share is the report less this front end's own requests, whole
    prompts, as they stood when the report was asked (`own_snapshot`). So a burst sent since the
    last report counts at once, and a request of this front end is never counted twice.

    Invariants: every count is >= 0; `num_waiting` and `num_running` count the requests in each
    state, `waiting_prompt_tokens` their whole prompts while waiting, `outstanding_tokens` the
    prompt plus most new tokens of all (the only count of outstanding tokens: every policy reads
    it here).
    """

    waiting_prefill_tokens: int = 0
    waiting_prompt_tokens: int = 0
    num_waiting: int = 0
    num_running: int = 0
    outstanding_tokens: int = 0
    others_waiting_prefill_tokens: int = 0  # from the last report
    others_running_decodes: int = 0  # likewise

    def add(self, num_prefill_tokens: int, num_prompt_tokens: int, num_tokens: int) -> None:
        self.waiting_prefill_tokens += num_prefill_tokens
        self.waiting_prompt_tokens += num_prompt_tokens
        self.num_waiting += 1
        self.outstanding_tokens += num_tokens

    def start_decoding(self, num_prefill_tokens: int, num_prompt_tokens: int) -> None:
        """The request's first output came: its prefill is done."""
        self.waiting_prefill_tokens -= num_prefill_tokens
        self.waiting_prompt_tokens -= num_prompt_tokens
        self.num_waiting -= 1
        self.num_running += 1

    def remove(
        self, num_prefill_tokens: int, num_prompt_tokens: int, num_tokens: int, is_decoding: bool
    ) -> None:
        """The request ended, in whichever state it was."""
        if is_decoding:
            self.num_running -= 1
        else:
            self.waiting_prefill_tokens -= num_prefill_tokens
            self.waiting_prompt_tokens -= num_prompt_tokens
            self.num_waiting -= 1
        self.outstanding_tokens -= num_tokens

    def own_snapshot(self) -> tuple[int, int]:
        """This front end's share of a report asked now: (whole prompts waiting, running)."""
        return self.waiting_prompt_tokens, self.num_running

    def on_report(
        self, waiting_prefill_tokens: int, running_decodes: int, own_when_asked: tuple[int, int]
    ) -> None:
        """The engine's `get_load`, asked when this front end's share was `own_when_asked`."""
        own_waiting, own_running = own_when_asked
        self.others_waiting_prefill_tokens = max(0, waiting_prefill_tokens - own_waiting)
        self.others_running_decodes = max(0, running_decodes - own_running)

    def forget_report(self) -> None:
        """The engine's work is unknown (it stopped answering, or restarted): own count only."""
        self.others_waiting_prefill_tokens = 0
        self.others_running_decodes = 0

    @property
    def scored_waiting_prefill_tokens(self) -> int:
        return self.waiting_prefill_tokens + self.others_waiting_prefill_tokens

    @property
    def scored_running_decodes(self) -> int:
        return self.num_running + self.others_running_decodes

    def check_invariants(self, engine_idx: int) -> None:
        counts = {
            "waiting_prefill_tokens": self.waiting_prefill_tokens,
            "waiting_prompt_tokens": self.waiting_prompt_tokens,
            "num_waiting": self.num_waiting,
            "num_running": self.num_running,
            "outstanding_tokens": self.outstanding_tokens,
            "others_waiting_prefill_tokens": self.others_waiting_prefill_tokens,
            "others_running_decodes": self.others_running_decodes,
        }
        negative = {name: value for name, value in counts.items() if value < 0}
        assert not negative, f"engine {engine_idx}: negative {negative}"
        assert self.waiting_prefill_tokens <= self.waiting_prompt_tokens, (
            f"engine {engine_idx}: {self.waiting_prefill_tokens} prefill tokens waiting of "
            f"{self.waiting_prompt_tokens} prompt tokens"
        )


@dataclass(frozen=True, slots=True)
class StreamSource:
    """Where one engine publishes its KV events: endpoints to connect to, and the topic."""

    endpoint: str
    replay_endpoint: str | None
    topic: str


@dataclass(slots=True, eq=False)
class KVEventStream:
    """One engine's KV-event stream as the subscriber follows it, and the KV index's slice of it.

    Invariants: `next_seq` is one past the last batch applied (0 before any); `keys` are the
    index keys the engine holds on some medium; `is_silent` is True until the stream first
    answers, and again once it has answered nothing for the subscriber's silent limit; `task`
    follows `source` while it is not None.
    """

    next_seq: int = 0
    keys: set[bytes] = field(default_factory=set)  # index keys held, on any medium
    num_batches: int = 0  # applied
    num_clears: int = 0  # AllBlocksCleared applied, and restarts seen
    num_unknown_removals: int = 0  # BlockRemoved of a key not held
    is_silent: bool = True
    num_silences: int = 0  # times the stream fell silent after answering
    num_replays: int = 0  # replay requests sent
    num_gaps: int = 0  # gaps the live stream showed
    num_lost_batches: int = 0  # gone from the replay buffer for good
    num_restarts: int = 0  # publishers seen starting over
    recent: deque[tuple[int, int]] = field(
        default_factory=lambda: deque(maxlen=RECENT_BATCHES)
    )  # (seq, crc32 of payload) of the batches applied last
    source: StreamSource | None = None  # where `task` follows it
    task: asyncio.Task[None] | None = None

    @property
    def is_following(self) -> bool:
        return self.task is not None


@dataclass(slots=True, eq=False)
class EngineRecord:
    """What the front end knows of engine `engine_idx` (its place in the `--engine` flags).

    Liveness: healthy only after the engine answered check_health, and no longer at its first
    disconnect or unanswered check. Routable when healthy and hashing blocks as the fleet does.
    """

    engine_idx: int
    address: str
    is_healthy: bool = False  # until its first check_health answer
    last_answer_s: float | None = None  # time.monotonic() of its last answer
    routing_info: dict[str, object] | None = None  # get_routing_info, per connection
    hash_params: HashParams | None = None  # announced in routing_info
    hash_mismatch: str | None = None  # why its hashes differ from the pool's: not routed
    reports_load: bool = True  # until it answers get_load as an unknown call (per connection)
    # P/D (api_server/routing/disaggregated.py): its announced role, and why it cannot pair
    # with the prefill engines (its KV layout differs, the field named); None: it can
    kv_role: str = "both"
    kv_layout_mismatch: str | None = None
    load: EngineLoad = field(default_factory=EngineLoad)
    num_decisions: int = 0  # requests the router sent it
    num_predicted: int = 0  # requests whose hit was predicted and measured
    predicted_hit_tokens: int = 0  # summed over those requests
    actual_hit_tokens: int = 0  # the engine's num_cached_tokens, likewise
    kv_events: KVEventStream = field(default_factory=KVEventStream)

    @property
    def is_routable(self) -> bool:
        return self.is_healthy and self.hash_mismatch is None

    @property
    def is_indexed(self) -> bool:
        """Whether its KV-event stream is followed and answering: its cached prefix counts."""
        return self.kv_events.is_following and not self.kv_events.is_silent


def engine_records(addresses: list[str]) -> list[EngineRecord]:
    """One fresh record per address, indexed as the addresses are."""
    if not addresses:
        raise ValueError("0 engine addresses: expected at least one")
    return [EngineRecord(idx, address) for idx, address in enumerate(addresses)]
