"""GraphRunner: CUDA graphs of a checkpoint's decode-only forward, one per bucketed batch size,
captured at start-up over the step buffers' addresses and replayed for each decode step that fits.

A decode step of R requests runs as the smallest bucket B >= R: the step buffers pad it with B - R
requests that own no query, read no context and write to no slot, and the runner drops their
logits rows, so they sample nothing. A replay equals the eager forward of the same padded step bit
for bit (the same kernels on the same shapes and inputs). It never prepares a step or samples.
"""

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from protocol.config import WorkerConfig
from worker.attention import StepLayout
from worker.distributed import TPGroup
from worker.models.hf.config import is_checkpoint
from worker.models.hf.moe_config import is_moe_checkpoint
from worker.step_buffers import StepBuffers, StepShape, is_decode_only

logger = logging.getLogger(__name__)

SMALL_BUCKETS = (1, 2, 4)  # then multiples of BUCKET_STEP
BUCKET_STEP = 8
# A step of no requests: staged with padding only, it is the dummy decode step a graph captures
EMPTY_LAYOUT = StepLayout(*(np.zeros(0, np.int64) for _ in range(6)))
NO_TOKENS = np.zeros(0, np.int64)


def decode_buckets(max_decode_batch: int) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, 8, then steps of 8, and the largest decode batch
    itself, so that every decode step fits one."""
    if max_decode_batch < 1:
        raise ValueError(f"a largest decode batch of {max_decode_batch}: expected at least 1")
    steps = range(BUCKET_STEP, max_decode_batch + 1, BUCKET_STEP)
    buckets = [size for size in (*SMALL_BUCKETS, *steps) if size < max_decode_batch]
    return [*buckets, max_decode_batch]


def bucket_for(num_reqs: int, buckets: list[int]) -> int | None:
    """The smallest bucket that holds `num_reqs` requests; None past the largest."""
    return next((bucket for bucket in sorted(buckets) if bucket >= num_reqs), None)


def uses_step_buffers(config: WorkerConfig, device: torch.device) -> bool:
    """Whether a rank prepares its steps into StepBuffers: a checkpoint whose attention runs on
    the Triton kernels, which read them, on CUDA."""
    is_triton = config.attention_backend == "triton"
    return device.type == "cuda" and is_triton and is_checkpoint(config.model)


def graph_refusal(config: WorkerConfig, device: torch.device, tp_group: TPGroup) -> str | None:
    """Why this rank runs its decode steps eagerly; None: they replay graphs."""
    if config.enforce_eager:
        return "--enforce-eager"
    if not uses_step_buffers(config, device):
        return "graphs replay a checkpoint's forward with --attention-backend triton on CUDA only"
    if is_moe_checkpoint(config.model):
        return "a mixture of experts sizes each expert's batch on the host, which graphs cannot"
    if tp_group.tp_size > 1 and dist.get_backend(tp_group.process_group) != "nccl":
        return "a TP group over gloo (ranks sharing a device) all-reduces outside graphs"
    return None


@dataclass(frozen=True, slots=True)
class CapturedStep:
    """One bucket's graph and the tensor its replays write the logits to."""

    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # [bucket, V] float32, overwritten by each replay
    shape: StepShape  # of the padded dummy step it captured


class GraphRunner:
    """The decode graphs of one rank, or (no CUDA) the padded decode steps run eagerly.

    Invariants: every captured graph reads the step buffers at the addresses of a padded decode
    step of its bucket, and is replayed only after such a step was staged; the graphs share one
    memory pool, so only one runs at a time, and its logits are read before the next replay.
    """

    def __init__(
        self,
        buffers: StepBuffers,
        forward: Callable[[StepShape], torch.Tensor],  # logits of the staged step of a shape
        buckets: list[int],
        device: torch.device,
    ) -> None:
        self.buffers = buffers
        self.forward = forward
        self.buckets = sorted(buckets)
        self.device = device
        self.graphs: dict[int, CapturedStep] = {}

    def capture(self) -> None:
        """Capture each bucket's graph (CUDA only), the largest first: the smaller ones reuse its
        pool's memory. Each is warmed up eagerly first, so that Triton compiles its kernels and
        torch sets up its handles outside the capture. The dummy steps write nothing."""
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs are captured on CUDA devices, not on {self.device}")
        with torch.cuda.device(self.device):  # Triton launches on the current device's stream
            pool = torch.cuda.graph_pool_handle()
            stream = torch.cuda.Stream(self.device)  # warm-ups and captures run on it
            for bucket in reversed(self.buckets):
                self.graphs[bucket] = self._capture(bucket, pool, stream)
            torch.cuda.synchronize(self.device)
        logger.info("captured %d decode graphs, batch sizes %s", len(self.graphs), self.buckets)

    def _capture(
        self, bucket: int, pool: tuple[int, int], stream: torch.cuda.Stream
    ) -> CapturedStep:
        """Stage the bucket's dummy step (all padding), warm its forward up, then capture it."""
        shape = self.buffers.stage(EMPTY_LAYOUT, NO_TOKENS, NO_TOKENS, bucket)
        stream.wait_stream(torch.cuda.current_stream(self.device))  # the staged copies
        with torch.cuda.stream(stream):
            self.forward(shape)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            logits = self.forward(shape)
        return CapturedStep(graph, logits, shape)

    def bucket_of(self, layout: StepLayout) -> int | None:
        """The bucket a step runs as; None for a step that is not decode-only or is too large."""
        if not is_decode_only(layout):
            return None
        return bucket_for(len(layout.rows), self.buckets)

    def run(self, shape: StepShape) -> torch.Tensor:
        """Logits [bucket, V] of the staged padded decode step: its graph's replay, or without
        one (no CUDA) the same forward run eagerly."""
        captured = self.graphs.get(shape.num_reqs)
        if captured is None:
            return self.forward(shape)
        assert captured.shape.num_tokens == shape.num_tokens == shape.num_sampled
        with torch.cuda.device(self.device):
            captured.graph.replay()  # on the current stream, after the step's copies
        return captured.logits
