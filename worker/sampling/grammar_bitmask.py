"""The rank's side of structured outputs: a step's grammar bitmask applied to its logits before
sampling, so that a constrained request can only sample a token its grammar allows. It keeps no
grammar state (the engine owns that) and leaves the raw logits unchanged for logprobs.
"""

import threading
import time

import numpy as np
import torch

from protocol.worker_messages import GrammarBitmask, StepGrammarBitmask

_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)  # [32] bit i of a word allows id 32*w + i


def apply_grammar_bitmask(
    logits: torch.Tensor, grammar_bitmask: GrammarBitmask | None, logits_reqs: np.ndarray
) -> torch.Tensor:
    """`logits` [S, V] with -inf at every id each constrained row's grammar refuses (a copy where
    any row is constrained; `logits` itself otherwise).

    `logits_reqs` [S]: the step's place (SchedulerOutput order) of each logits row, ascending;
    the bitmask names its rows by those places. Ids past the bitmask's words are refused too.
    """
    if grammar_bitmask is None:
        return logits
    req_idxs = np.frombuffer(grammar_bitmask.req_idxs, dtype="<i4")
    rows = np.searchsorted(logits_reqs, req_idxs)
    is_sampled = rows < len(logits_reqs)
    if not (is_sampled.all() and (logits_reqs[rows[is_sampled]] == req_idxs).all()):
        raise ValueError(
            f"grammar bitmask rows {req_idxs.tolist()} are not all sampled this step "
            f"(sampled: {logits_reqs.tolist()})"
        )
    words = np.frombuffer(grammar_bitmask.bitmask, dtype="<i4")
    if len(req_idxs) == 0 or words.size % len(req_idxs):
        raise ValueError(
            f"grammar bitmask of {words.size} words for {len(req_idxs)} rows: expected a "
            "whole number of words per row"
        )
    vocab_size = logits.shape[1]
    device = logits.device
    # the packed words go to the device (V/8 bytes a row), and are unpacked there
    bitmask = torch.from_numpy(words.reshape(len(req_idxs), -1).copy()).to(device)  # [N, W]
    allowed = (bitmask[:, :, None] >> _BIT_SHIFTS.to(device)) & 1  # [N, W, 32]
    allowed = allowed.reshape(len(req_idxs), -1)[:, :vocab_size].to(torch.bool)  # [N, <=V]
    if allowed.shape[1] < vocab_size:  # a bitmask narrower than the logits allows nothing past
        allowed = torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[1]))
    row_index = torch.from_numpy(rows.astype(np.int64)).to(device)
    masked = logits.clone()
    masked[row_index] = masked[row_index].masked_fill(~allowed, -torch.inf)
    return masked


class FollowingGrammarBitmasks:
    """Bitmasks that come after their step (`SchedulerOutput.grammar_bitmask_follows`): the
    worker's thread puts each as it arrives, and the step thread, having run that step's forward,
    takes it before sampling.

    Invariants: at most one bitmask waits at a time, for the newest step the rank was sent (the
    engine sends it before the next step); a take waits at most `timeout_s`.
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._ready = threading.Condition()
        self._waiting: StepGrammarBitmask | None = None

    def put(self, message: StepGrammarBitmask) -> None:
        with self._ready:
            if self._waiting is not None:
                raise ValueError(
                    f"a grammar bitmask for step {message.step_id} while step "
                    f"{self._waiting.step_id}'s is still unused"
                )
            self._waiting = message
            self._ready.notify()

    def take(self, step_id: int, generation: int) -> GrammarBitmask:
        """Step `step_id`'s bitmask, waiting for it; TimeoutError when it is not in by the
        deadline, ValueError when the one that came names another step or generation."""
        deadline = time.monotonic() + self.timeout_s
        with self._ready:
            while self._waiting is None:
                remaining_s = deadline - time.monotonic()
                if remaining_s <= 0:
                    raise TimeoutError(
                        f"step {step_id}'s grammar bitmask did not come within "
                        f"{self.timeout_s:.0f} s"
                    )
                self._ready.wait(remaining_s)
            message, self._waiting = self._waiting, None
        if message.step_id != step_id or message.generation != generation:
            raise ValueError(
                f"got the grammar bitmask of step {message.step_id} (generation "
                f"{message.generation}) while sampling step {step_id} (generation {generation})"
            )
        return message.grammar_bitmask
