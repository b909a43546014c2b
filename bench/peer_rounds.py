"""Rounds against a peer: each round measures both sides, alternating which goes first.

Owns the rule every peer benchmark follows: at least MIN_ROUNDS rounds (A B, B A, A B, ...), each
round's ratio per figure, and the median of those ratios. It measures nothing itself and imports
neither kvserve nor a peer, so its arithmetic is unit-tested without vLLM.
"""

import argparse
import enum
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

MIN_ROUNDS = 5  # fewer rounds leave the median of per-round ratios at the mercy of one noisy round
PEER_PREFIX = "vllm_"

Figures = dict[str, float | int | str]
Summary = dict[str, float | int | str | list[float]]


class Side(enum.Enum):
    OURS = "kvserve"
    PEER = "peer"


@dataclass(frozen=True, slots=True)
class PeerRatio:
    """One `ratio_*` key: a figure both sides report per round, and which side divides which."""

    key: str  # the JSON key; starts with "ratio_"
    figure: str  # the name both sides' per-round figures give it
    is_ours_over_peer: bool  # True: ours / peer (a rate, or a cost whose target is <= 1)


@dataclass(frozen=True, slots=True)
class PeerRound:
    """The figures each side reported in one round, and the order they were measured in."""

    ours: Figures
    peer: Figures
    order: tuple[Side, Side]


def num_rounds(text: str) -> int:
    """The argparse type of `--rounds`: an integer, at least MIN_ROUNDS."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected an integer number of rounds, got {text!r}"
        ) from None
    if value < MIN_ROUNDS:
        raise argparse.ArgumentTypeError(
            f"{value} rounds: a ratio against a peer needs at least {MIN_ROUNDS} interleaved rounds"
        )
    return value


def add_rounds_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--rounds",
        type=num_rounds,
        default=MIN_ROUNDS,
        help=f"rounds against the peer, alternating who goes first (at least {MIN_ROUNDS}); "
        "each ratio is the median of the per-round ratios",
    )


def round_order(round_idx: int) -> tuple[Side, Side]:
    """Ours first in even rounds, the peer first in odd ones, so neither always goes second."""
    if round_idx % 2 == 0:
        return (Side.OURS, Side.PEER)
    return (Side.PEER, Side.OURS)


def run_rounds(
    rounds: int,
    measure_ours: Callable[[], Figures],
    measure_peer: Callable[[], Figures],
    check_same_work: Callable[[Figures, Figures], None],
) -> list[PeerRound]:
    """Measure both sides `rounds` times in alternating order, checking each round's pair."""
    if rounds < MIN_ROUNDS:
        raise ValueError(f"{rounds} rounds: a peer ratio needs at least {MIN_ROUNDS}")
    measure = {Side.OURS: measure_ours, Side.PEER: measure_peer}
    results = []
    for round_idx in range(rounds):
        order = round_order(round_idx)
        figures = {side: measure[side]() for side in order}
        check_same_work(figures[Side.OURS], figures[Side.PEER])
        results.append(PeerRound(figures[Side.OURS], figures[Side.PEER], order))
    return results


def round_ratio(ours: Figures, peer: Figures, ratio: PeerRatio) -> float:
    """One round's ratio of `ratio.figure`, divided the way `ratio` says."""
    ours_value, peer_value = float(ours[ratio.figure]), float(peer[ratio.figure])
    numerator, denominator = (
        (ours_value, peer_value) if ratio.is_ours_over_peer else (peer_value, ours_value)
    )
    if denominator <= 0:
        raise ValueError(
            f"{ratio.key}: {ratio.figure} is {denominator} on the dividing side, expected > 0"
        )
    return numerator / denominator


def median_figures(rounds_figures: Sequence[Figures]) -> Figures:
    """Each figure's median over the rounds; a figure equal in every round (a count) as is."""
    medians: Figures = {}
    for key in rounds_figures[0]:
        values = [figures[key] for figures in rounds_figures]
        if all(value == values[0] for value in values):
            medians[key] = values[0]
        elif all(isinstance(value, int | float) for value in values):
            medians[key] = statistics.median(values)
        else:
            raise ValueError(f"{key} differs between rounds: {values}")
    return medians


def summarize(
    rounds: Sequence[PeerRound], ratios: Sequence[PeerRatio], peer_keys: Sequence[str]
) -> Summary:
    """Our medians, the peer's medians of `peer_keys` (prefixed), each ratio's median and rounds."""
    summary: Summary = {"num_rounds": len(rounds)}
    summary.update(median_figures([r.ours for r in rounds]))
    peer_medians = median_figures([r.peer for r in rounds])
    summary.update({f"{PEER_PREFIX}{key}": peer_medians[key] for key in peer_keys})
    for ratio in ratios:
        per_round = [round_ratio(r.ours, r.peer, ratio) for r in rounds]
        summary[ratio.key] = statistics.median(per_round)
        summary[f"rounds_{ratio.key}"] = per_round
    return summary
