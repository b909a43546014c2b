"""The one Model protocol: what the worker, the profiling step and the ModelRunner ask of a model,
whether built in (worker/models/fake/) or a checkpoint's decoder (worker/models/hf/).
It imports no model, so both folders can be read against it without reading each other.
"""

from typing import Protocol, runtime_checkable

import torch

from worker.attention import KVContext


@runtime_checkable
class Model(Protocol):
    """A model on one TP rank: writes every token's K/V, returns logits of the sampled tokens.

    A model that stands for a device's time (fixed-time) also has `ready_at_s`, the
    time.perf_counter() at which its last forward's output is ready; the ModelRunner reads it
    where a model has it, and takes the output of any other model as ready when forward returns.
    Invariants: each model states its own (its rank's shard of the weights, for one) and walks
    them in check_invariants.
    """

    vocab_size: int  # the logits' width; every sampled id lies below it

    def forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_idx: torch.Tensor,
        kv: KVContext,
    ) -> torch.Tensor:
        """Logits [S, V] of the tokens `logits_idx` among the step's [T] tokens. Each layer
        writes every token's K/V through `kv` before it reads: a same-step neighbour may share
        the blocks."""
        ...

    def check_invariants(self) -> None:
        """Walk the model's state and raise AssertionError naming the offending values."""
        ...
