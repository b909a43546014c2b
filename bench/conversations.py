"""Multi-turn conversations on shared system prompts, the workload of bench/http_engines.py: each
turn resends the conversation so far, so an engine that kept it serves its history from cache.
Standard library only; the same seed gives the same tokens.
"""

import random
from dataclasses import dataclass

SYSTEM_PROMPT_LEN = 256  # tokens of each shared system prompt
SYSTEM_PROMPT_WEIGHTS = (12, 2, 1, 1)  # how often conversations use each: popularity is skewed
USER_TURN_LEN = 48  # tokens a user adds per turn
REPLY_LEN = 16  # tokens of the assistant's answer the client sends back next turn
NUM_TURNS = 4


@dataclass(frozen=True, slots=True)
class Conversation:
    system_idx: int
    user_turns: list[list[int]]
    replies: list[list[int]]

    def prompt(self, systems: list[list[int]], turn: int) -> list[int]:
        """The system prompt, every earlier turn with its reply, then this turn's message."""
        tokens = list(systems[self.system_idx])
        for earlier in range(turn):
            tokens += self.user_turns[earlier] + self.replies[earlier]
        return tokens + self.user_turns[turn]


def workload(seed: int, num_conversations: int) -> tuple[list[list[int]], list[Conversation]]:
    """System prompts, and conversations that pick one by SYSTEM_PROMPT_WEIGHTS."""
    rng = random.Random(seed)
    systems = [
        [rng.randrange(3, 250) for _ in range(SYSTEM_PROMPT_LEN)] for _ in SYSTEM_PROMPT_WEIGHTS
    ]
    indices = range(len(SYSTEM_PROMPT_WEIGHTS))

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, 250) for _ in range(n)]

    conversations = [
        Conversation(
            rng.choices(indices, weights=SYSTEM_PROMPT_WEIGHTS)[0],
            [tokens(USER_TURN_LEN) for _ in range(NUM_TURNS)],
            [tokens(REPLY_LEN) for _ in range(NUM_TURNS)],
        )
        for _ in range(num_conversations)
    ]
    return systems, conversations
