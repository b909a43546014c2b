"""ModelRunner: applies each SchedulerOutput to the worker's batch, runs the model, and samples.

Order of one step: forget finished requests, park preempted ones (tokens and params kept), add new
ones, update cached ones (append tokens; append block ids, or replace them for resumed requests),
build the flattened batch and slot mappings, run the model over the paged cache, sample.
A checkpoint on Triton's CUDA kernels prepares its steps into step buffers instead of a PagedKV,
and replays its decode steps as CUDA graphs (worker/step_buffers.py, worker/graph_runner.py).
"""

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from protocol.buffers import pack_int32
from protocol.config import WorkerConfig
from protocol.kv_cache_spec import KVCacheConfig
from protocol.kv_transfer import describe_unsupported_groups, kv_transfer_layout
from protocol.worker_messages import (
    CachedRequestData,
    GrammarBitmask,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from worker.attention import PagedKV, StepLayout
from worker.cascade import plan_cascade
from worker.cross_attention import encoder_decoder_kv
from worker.distributed import TPGroup
from worker.encoder_inputs import EncoderInputs
from worker.graph_runner import GraphRunner, decode_buckets, graph_refusal, uses_step_buffers
from worker.input_batch import InputBatch, ParkedRequest
from worker.kv_cache import allocate_kv_caches, check_kv_caches, shared_kv_tensors
from worker.kv_tiers import KVTiers, build_kv_tiers
from worker.kv_transfer import KVTransferRank, kv_head_view, model_fingerprint
from worker.kv_transfer_nixl import NixlPages, nixl_available
from worker.models.hf.config import is_checkpoint
from worker.models.model import Model
from worker.models.registry import build_model, get_model_info, resolve_dtypes
from worker.sampler import SampleBatch, Sampler
from worker.sampling.grammar_bitmask import FollowingGrammarBitmasks, apply_grammar_bitmask
from worker.sampling.logprobs import LogprobColumns, compute_logprobs
from worker.sampling.penalties import TokenHistory
from worker.sampling.prompt_logprobs import PromptLogitRows, prompt_logit_rows
from worker.step_buffers import SampledIdsCopy, StepBuffers, StepLimits, StepShape

logger = logging.getLogger(__name__)

UNSAMPLED_TOKEN_ID = 0  # sent for a partial prefill chunk; the engine ignores it


def _int32_column(data: bytes, name: str) -> np.ndarray:
    if len(data) % 4:
        raise ValueError(f"{name} holds {len(data)} bytes, expected a multiple of 4")
    return np.frombuffer(data, dtype="<i4").astype(np.int64)


@dataclass(slots=True)
class StepTimings:
    """Seconds spent in the parts of the last step."""

    prepare_s: float = 0.0  # applying the SchedulerOutput, batch building, slot mapping
    model_s: float = 0.0  # the model forward, all-reduces included
    sample_s: float = 0.0


@dataclass(frozen=True, slots=True)
class HostStep:
    """The step flattened on the host: every scheduled token, and where each request's sit."""

    layout: StepLayout
    token_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    logits_idx: np.ndarray  # [S] int64 token of each sampled request's last query
    prompt_rows: PromptLogitRows | None = None  # tokens whose logits score a prompt token


@dataclass(frozen=True, slots=True)
class ScheduledRequests:
    """The step's scheduled requests as columns, in the order of their token counts."""

    handles: list[int]
    rows: np.ndarray  # [R] int64 batch row of each
    num_computed_tokens: np.ndarray  # [R] int64
    num_scheduled_tokens: np.ndarray  # [R] int64


class ModelRunner:
    """One rank's runner over its paged KV cache.

    Invariants: the batch rows are compact and hold exactly the running requests (InputBatch and
    its BlockTables hold their own); a parked (preempted) request has no row and 1 to
    max_model_len tokens; there is one block table per KV-cache group, and every block id in them
    is below num_blocks; every layer's cache is [num_blocks, 2, block_size, heads, head_dim], a
    view of the tensor it shares with the layers of its index in the other groups, and its null
    block is all zeros; with step buffers, their device block tables equal the batch's but for
    the entries written since the last step was staged. With `check_each_step` they are walked
    after every step.
    """

    def __init__(
        self,
        model: Model,
        kv_cache_config: KVCacheConfig,
        kv_caches: dict[str, torch.Tensor],
        rank: int,
        max_model_len: int,
        device: torch.device,
        sampling_seed: int = 0,
        check_each_step: bool = False,
        enable_cascade_attention: bool = True,
        eos_token_ids: Sequence[int] = (),  # the model's, held back under min_tokens
        kv_tiers: KVTiers | None = None,  # host and disk slots below the pages; None: no tiers
        # a step's largest sizes: prepare each step into StepBuffers, for a model that reads
        # them (a checkpoint on the Triton backend); None: a PagedKV per step
        step_limits: StepLimits | None = None,
        # moves pages between engines for P/D (worker/kv_transfer.py); None: steps carry no
        # transfer orders
        kv_transfer: KVTransferRank | None = None,
        # bitmasks sent after their steps (asynchronous scheduling); None: every step carries
        # its own, and a step whose bitmask follows is refused
        following_bitmasks: FollowingGrammarBitmasks | None = None,
    ) -> None:
        self.model = model
        self.following_bitmasks = following_bitmasks
        self.kv_tiers = kv_tiers
        self.kv_transfer = kv_transfer
        # Read a prefix all of a step's requests share once per layer (worker/cascade.py); off,
        # each request reads it through its own table. The engine's counts are checked either way.
        self.enable_cascade_attention = enable_cascade_attention
        self.num_cascade_steps = 0  # steps where some group read a shared prefix once
        self.check_each_step = check_each_step  # walk the invariants every step (tests, debugging)
        self.kv_cache_config = kv_cache_config
        self.kv_caches = kv_caches
        self.rank = rank
        self.device = device
        block_sizes = [group.spec.block_size for group in kv_cache_config.kv_cache_groups]
        self.input_batch = InputBatch(max_model_len, block_sizes)
        self.parked: dict[int, ParkedRequest] = {}
        self.encoder_inputs = EncoderInputs(kv_cache_config)  # held by encoder-decoder models only
        self.sampler = Sampler(sampling_seed, eos_token_ids)
        self.sampled_ids_copy = SampledIdsCopy(device)
        self.step_buffers = (
            None
            if step_limits is None
            else StepBuffers(
                self.input_batch.block_table, kv_cache_config, kv_caches, step_limits, device
            )
        )
        self.graph_runner: GraphRunner | None = None  # set by enable_decode_graphs
        self.last_step_id = kv_cache_config.first_step_id - 1  # a later generation starts late
        self.timings = StepTimings()
        # time.perf_counter() when the last step's output is ready: a model standing for a device
        # (fixed-time) says; one computed on the host is ready once it returns
        self.ready_at_s = 0.0

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if scheduler_output.step_id != self.last_step_id + 1:
            raise ValueError(
                f"rank {self.rank} got step {scheduler_output.step_id}, "
                f"expected {self.last_step_id + 1}"
            )
        start = time.perf_counter()
        # copy-outs, then copy-ins, all before the forward (DESIGN.md §3.5)
        failed_disk_slots = pack_int32(self._apply_transfers(scheduler_output))
        self._apply_transfer_orders(scheduler_output)
        kv_transfer = self.kv_transfer
        num_refused_kv_pulls = kv_transfer.take_refused() if kv_transfer is not None else 0
        scheduled = self._update_states(scheduler_output)
        self.last_step_id = scheduler_output.step_id
        handles = pack_int32(scheduled.handles)
        if self.check_each_step:  # the step's deltas are applied; forward and sampling keep them
            self.check_invariants()
        if not scheduled.handles:
            self.timings = StepTimings(prepare_s=time.perf_counter() - start)
            self.ready_at_s = 0.0
            finished_kv_pulls, failed_kv_pulls, kv_pull_bytes = self._take_pull_ends()
            return ModelRunnerOutput(
                scheduler_output.step_id,
                self.rank,
                handles,
                b"",
                scheduler_output.generation,
                failed_disk_slots=failed_disk_slots,
                finished_kv_pulls=finished_kv_pulls,
                failed_kv_pulls=failed_kv_pulls,
                kv_pull_bytes=kv_pull_bytes,
                num_refused_kv_pulls=num_refused_kv_pulls,
            )
        host, sample_reqs, logits_reqs = self._prepare(scheduled)
        prepared = time.perf_counter()
        logits, inputs_s = self._forward(
            host, scheduled.handles, scheduler_output.num_common_prefix_blocks
        )
        modelled = time.perf_counter()
        self.ready_at_s = getattr(self.model, "ready_at_s", modelled)
        sampled = np.full(len(scheduled.handles), UNSAMPLED_TOKEN_ID, dtype=np.int32)  # [R]
        prompt_logprobs = LogprobColumns()
        if host.prompt_rows is not None:  # their rows follow the sampled ones (_forward)
            num_sampled = len(host.logits_idx)
            prompt_logprobs = self._prompt_logprobs(logits[num_sampled:], host.prompt_rows)
            logits = logits[:num_sampled]
        # A constrained request samples only what its grammar allows; logprobs stay the raw ones.
        grammar_bitmask = scheduler_output.grammar_bitmask
        if scheduler_output.grammar_bitmask_follows:  # the forward ran while the engine made it
            grammar_bitmask = self._following_bitmask(scheduler_output)
        allowed_logits = apply_grammar_bitmask(logits, grammar_bitmask, logits_reqs)
        sampled_ids = self.sampler.sample(allowed_logits, sample_reqs)
        self.sampled_ids_copy.start(sampled_ids)
        num_logprobs = sample_reqs.sampling_columns.num_logprobs
        logprobs = (  # of the raw logits: the sampler left them as the model gave them
            LogprobColumns()
            if num_logprobs is None
            else compute_logprobs(logits, sampled_ids, num_logprobs)
        )
        sampled[logits_reqs] = self.sampled_ids_copy.wait()
        if len(sampled) and not (sampled.min() >= 0 and sampled.max() < self.model.vocab_size):
            raise AssertionError(f"sampled ids {sampled.tolist()} leave the vocabulary")
        # Each sampled token joins its sequence here, as the engine appends it: the engine never
        # sends it back, and with asynchronous scheduling the next step computes on it before
        # the engine has seen it.
        self.input_batch.append_sampled(scheduled.rows[logits_reqs], sampled[logits_reqs])
        done = time.perf_counter()
        self.timings = StepTimings(
            prepare_s=prepared - start + inputs_s,
            model_s=modelled - prepared - inputs_s,
            sample_s=done - modelled,
        )
        # last, so that a pull this step ordered and the forward outlasted is reported now and
        # its request admitted with the next step (a decode step less of TTFT)
        finished_kv_pulls, failed_kv_pulls, kv_pull_bytes = self._take_pull_ends()
        return ModelRunnerOutput(
            scheduler_output.step_id,
            self.rank,
            handles,
            pack_int32(sampled),
            scheduler_output.generation,
            logprobs.logprobs,
            logprobs.token_ids,
            logprobs.sampled_token_ranks,
            self.timings.model_s,
            failed_disk_slots,
            prompt_logprobs.logprobs,
            prompt_logprobs.token_ids,
            prompt_logprobs.sampled_token_ranks,
            finished_kv_pulls,
            failed_kv_pulls,
            kv_pull_bytes,
            num_refused_kv_pulls,
        )

    def _following_bitmask(self, scheduler_output: SchedulerOutput) -> GrammarBitmask:
        if self.following_bitmasks is None:
            raise ValueError(
                f"step {scheduler_output.step_id}'s grammar bitmask follows it, but rank "
                f"{self.rank} has no channel for it"
            )
        return self.following_bitmasks.take(scheduler_output.step_id, scheduler_output.generation)

    @staticmethod
    def _prompt_logprobs(logits: torch.Tensor, rows: PromptLogitRows) -> LogprobColumns:
        """The prompt tokens' logprobs, each row's scored token first (the raw distribution)."""
        targets = torch.from_numpy(rows.target_ids).to(logits.device)
        return compute_logprobs(logits, targets, rows.num_logprobs)

    def _apply_transfers(self, scheduler_output: SchedulerOutput) -> list[int]:
        """Run the step's tier copies; the disk slots that hold no valid copy on this rank."""
        transfers = scheduler_output.kv_transfers
        if transfers is None:
            return []
        if self.kv_tiers is None:
            raise ValueError(
                f"step {scheduler_output.step_id} moves blocks between tiers, but rank "
                f"{self.rank} was given none"
            )
        return self.kv_tiers.apply(transfers)

    def _apply_transfer_orders(self, scheduler_output: SchedulerOutput) -> None:
        """P/D (DESIGN.md §12): apply the step's pins and unpins and queue its pulls, before the
        forward (the pulls run beside it)."""
        orders = scheduler_output.kv_transfer_orders
        if self.kv_transfer is None:
            if orders is not None:
                raise ValueError(
                    f"step {scheduler_output.step_id} carries KV transfer orders, but rank "
                    f"{self.rank} has no transfer agent"
                )
            return
        if orders is not None:
            self.kv_transfer.apply(orders)

    def _take_pull_ends(self) -> tuple[list[int], list[int], int]:
        """The pulls that ended since the last step's reply (ids, failed ids, bytes), taken as
        the reply is built."""
        if self.kv_transfer is None:
            return [], [], 0
        return self.kv_transfer.take_finished()

    def _update_states(self, scheduler_output: SchedulerOutput) -> ScheduledRequests:
        """Apply the step's deltas in the contract's order; return the scheduled requests."""
        batch = self.input_batch
        for handle in scheduler_output.finished_handles:
            if handle in batch.handle_to_row:
                batch.remove_request(handle)
            self.parked.pop(handle, None)
            self.encoder_inputs.forget(handle)
        for handle in scheduler_output.preempted_handles:
            if handle in batch.handle_to_row:
                self.parked[handle] = batch.remove_request(handle)
            elif handle not in self.parked:
                raise ValueError(f"preempted request {handle} is unknown to rank {self.rank}")
        counts = _int32_column(scheduler_output.num_scheduled_tokens, "num_scheduled_tokens")
        scheduled = [self._add_new(new) for new in scheduler_output.scheduled_new_reqs]
        scheduled.extend(self._update_cached(scheduler_output.scheduled_cached_reqs))
        if len(counts) != len(scheduled):
            raise ValueError(
                f"step {scheduler_output.step_id} schedules {len(counts)} token counts for "
                f"{len(scheduled)} requests"
            )
        if int(counts.sum()) != scheduler_output.total_num_scheduled_tokens:
            raise ValueError(
                f"step {scheduler_output.step_id} token counts sum to {int(counts.sum())}, "
                f"expected total_num_scheduled_tokens={scheduler_output.total_num_scheduled_tokens}"
            )
        handles, rows, computed = zip(*scheduled, strict=True) if scheduled else ((), (), ())
        return ScheduledRequests(
            list(handles), np.array(rows, np.int64), np.array(computed, np.int64), counts
        )

    def _add_new(self, new: NewRequestData) -> tuple[int, int, int]:
        if new.handle in self.input_batch.handle_to_row or new.handle in self.parked:
            raise ValueError(f"new request {new.handle} is already known to rank {self.rank}")
        prompt = _int32_column(new.prompt_token_ids, "prompt_token_ids")
        if len(prompt) == 0:
            raise ValueError(f"new request {new.handle} has an empty prompt")
        self.encoder_inputs.add(new.handle, new.encoder_token_ids)
        row = self.input_batch.add_request(
            new.handle, prompt, new.sampling_params, new.block_ids, new.num_prompt_tokens
        )
        return new.handle, row, new.num_computed_tokens

    def _update_cached(self, cached: CachedRequestData) -> list[tuple[int, int, int]]:
        handles = _int32_column(cached.handles, "handles")
        num_new = _int32_column(cached.num_new_token_ids, "num_new_token_ids")
        new_tokens = _int32_column(cached.new_token_ids, "new_token_ids")
        computed = _int32_column(cached.num_computed_tokens, "num_computed_tokens").tolist()
        lengths = {len(handles), len(num_new), len(computed), len(cached.new_block_ids)}
        if len(lengths) != 1 or int(num_new.sum()) != len(new_tokens):
            raise ValueError(
                f"cached request columns disagree: {len(handles)} handles, {len(num_new)} counts, "
                f"{len(computed)} num_computed_tokens, {len(cached.new_block_ids)} block lists, "
                f"{len(new_tokens)} new tokens for counts summing to {int(num_new.sum())}"
            )
        resumed, to_row = set(cached.resumed_handles), self.input_batch.handle_to_row
        ends, counts, handle_list = np.cumsum(num_new).tolist(), num_new.tolist(), handles.tolist()
        rows, new_block_ids = [], cached.new_block_ids
        for i, (handle, block_ids) in enumerate(zip(handle_list, new_block_ids, strict=True)):
            if block_ids is None and not counts[i] and handle in to_row and handle not in resumed:
                rows.append(to_row[handle])  # a decode: the rank holds its tokens and blocks
                continue
            tokens = new_tokens[ends[i] - counts[i] : ends[i]]
            update = self._resume if handle in resumed else self._append
            rows.append(update(handle, tokens, block_ids))
        return list(zip(handle_list, rows, computed, strict=True))

    def _resume(
        self, handle: int, tokens: np.ndarray, block_ids: tuple[list[int], ...] | None
    ) -> int:
        """A parked (preempted) request gets a row back, with `block_ids` as its whole table."""
        if block_ids is None:
            raise ValueError(f"resumed request {handle} comes without block ids")
        batch = self.input_batch
        if handle in self.parked:
            parked = self.parked.pop(handle)
            self.encoder_inputs.resume(handle)  # its cross-attention blocks are new: re-encode
            token_ids = np.concatenate((parked.token_ids, tokens))
            return batch.add_request(
                handle, token_ids, parked.sampling_params, block_ids, parked.num_prompt_tokens
            )
        if handle in batch.handle_to_row:
            raise ValueError(
                f"resumed request {handle} is still in the batch of rank {self.rank} at row "
                f"{batch.handle_to_row[handle]}: only a preempted request can resume"
            )
        raise ValueError(f"resumed request {handle} is unknown to rank {self.rank}")

    def _append(
        self, handle: int, tokens: np.ndarray, block_ids: tuple[list[int], ...] | None
    ) -> int:
        batch = self.input_batch
        if handle not in batch.handle_to_row:
            raise ValueError(f"cached request {handle} has no row on rank {self.rank}")
        row = batch.handle_to_row[handle]
        batch.append_token_ids(row, tokens)
        if block_ids is not None:
            batch.block_table.append_row(block_ids, row)
        return row

    def _prepare(self, scheduled: ScheduledRequests) -> tuple[HostStep, SampleBatch, np.ndarray]:
        """Flatten the step on the host: token ids, positions, the sampled requests (and what the
        sampler needs of them), and the indices of those among the scheduled ones."""
        batch = self.input_batch
        rows, first = scheduled.rows, scheduled.num_computed_tokens
        counts, handles = scheduled.num_scheduled_tokens, scheduled.handles
        ends = first + counts
        known = batch.num_tokens[rows].astype(np.int64)
        if (counts < 1).any() or (first < 0).any() or (ends > known).any():
            bad = int(np.argmax((counts < 1) | (first < 0) | (ends > known)))
            raise ValueError(
                f"request {handles[bad]} schedules positions [{first[bad]}, {ends[bad]}) "
                f"but holds {known[bad]} tokens"
            )
        offsets = np.cumsum(counts) - counts
        positions = np.repeat(first - offsets, counts) + np.arange(int(counts.sum()))
        token_ids = batch.token_ids[np.repeat(rows, counts), positions]
        logits_reqs = np.flatnonzero(ends == known)  # the others are partial prefill chunks
        logits_idx = offsets[logits_reqs] + counts[logits_reqs] - 1
        num_prompt_tokens = batch.num_prompt_tokens[rows].astype(np.int64)
        prompt_rows = None
        if batch.sampling.num_prompt_logprob_rows:  # some live request asked for them
            num_prompt_logprobs = batch.sampling.num_prompt_logprobs[rows]
            prompt_rows = prompt_logit_rows(
                batch.token_ids,
                rows,
                num_prompt_logprobs,
                num_prompt_tokens,
                first,
                counts,
                offsets,
            )
        layout = StepLayout(
            rows, first, counts, offsets, logits_reqs, num_prompt_tokens, prompt_rows is not None
        )
        host = HostStep(layout, token_ids.astype(np.int64), positions, logits_idx, prompt_rows)
        sample_reqs = self._sample_requests(handles, rows[logits_reqs], known, logits_reqs)
        return host, sample_reqs, logits_reqs

    def _forward(
        self, host: HostStep, handles: list[int], num_common_prefix_blocks: list[int]
    ) -> tuple[torch.Tensor, float]:
        """The step's logits [S + Q, V] (the sampled rows, then the prompt rows), and the seconds
        of it spent preparing the model's inputs."""
        if self.step_buffers is not None:
            if host.prompt_rows is not None:  # the engine refuses them: see ModelInfo
                raise ValueError(f"rank {self.rank} cannot compute prompt logits on step buffers")
            return self._forward_from_buffers(host, self.step_buffers)
        start = time.perf_counter()
        config, tables, layout = self.kv_cache_config, self.input_batch.block_table, host.layout
        # cascade attention computes the sampled rows only; prompt logits need every row
        cascade_tokens = plan_cascade(
            num_common_prefix_blocks,
            config,
            tables,
            layout,
            self.enable_cascade_attention and host.prompt_rows is None,
        )
        if any(cascade_tokens):
            self.num_cascade_steps += 1
            logger.debug("cascade attention: %s shared prefix tokens per group", cascade_tokens)
        kv = PagedKV(self.kv_caches, config, tables, layout, self.device, cascade_tokens)
        if self.encoder_inputs.is_required:  # its decoder also reads each request's encoder
            kv = encoder_decoder_kv(kv, self.encoder_inputs, handles)
        device = self.device
        token_ids = torch.from_numpy(host.token_ids).to(device)
        positions = torch.from_numpy(host.positions).to(device)
        logits_idx = host.logits_idx
        if host.prompt_rows is not None:
            logits_idx = np.concatenate((logits_idx, host.prompt_rows.token_idx))
        logits_idx = torch.from_numpy(logits_idx).to(device)
        prepared = time.perf_counter()
        logits = self.model.forward(token_ids, positions, logits_idx, kv)
        return logits, prepared - start + kv.build_s

    def _forward_from_buffers(
        self, host: HostStep, buffers: StepBuffers
    ) -> tuple[torch.Tensor, float]:
        """The step staged in the step buffers, then its graph replayed where one fits (its
        padded rows' logits dropped) or the forward run over the buffers eagerly."""
        start = time.perf_counter()
        graphs, num_reqs = self.graph_runner, len(host.layout.rows)
        bucket = None if graphs is None else graphs.bucket_of(host.layout)
        num_padded = 0 if bucket is None else bucket - num_reqs
        shape = buffers.stage(host.layout, host.token_ids, host.positions, num_padded)
        staged = time.perf_counter()
        if graphs is None or bucket is None:
            return self._forward_staged(shape), staged - start
        return graphs.run(shape)[:num_reqs], staged - start

    def _forward_staged(self, shape: StepShape) -> torch.Tensor:
        """Logits of the step staged in the buffers with `shape`: what a decode graph captures."""
        assert self.step_buffers is not None
        step = self.step_buffers.device_step(shape)
        return self.model.forward(step.token_ids, step.positions, step.logits_idx, step)

    def enable_decode_graphs(self, buckets: list[int]) -> None:
        """Run decode-only steps as `buckets` (padded), through graphs captured now on CUDA; on
        the CPU the padded steps run eagerly (tests of the padding)."""
        if self.step_buffers is None:
            raise ValueError("decode graphs replay steps of the step buffers: the runner has none")
        self.graph_runner = GraphRunner(
            self.step_buffers, self._forward_staged, buckets, self.device
        )
        if self.device.type == "cuda":
            self.graph_runner.capture()

    def _sample_requests(
        self, handles: list[int], rows: np.ndarray, known: np.ndarray, logits_reqs: np.ndarray
    ) -> SampleBatch:
        """What the sampler needs of each sampled request (`rows` are theirs, in order)."""
        batch = self.input_batch
        params = batch.sampling_params
        columns = batch.sampling.take(rows)
        history = (
            TokenHistory(batch.token_ids, rows, batch.num_prompt_tokens[rows].astype(np.int64))
            if columns.needs_history
            else None
        )
        return SampleBatch(
            [handles[i] for i in logits_reqs.tolist()],
            [params[row] for row in rows.tolist()],
            known[logits_reqs].tolist(),
            columns,
            history,
        )

    def check_invariants(self) -> None:
        """Walk the batch (and through it every BlockTable), the parked requests and block ids."""
        batch = self.input_batch
        batch.check_invariants()
        overlap = set(self.parked) & set(batch.handle_to_row)
        assert not overlap, f"requests both parked and in the batch: {sorted(overlap)}"
        for handle, parked in self.parked.items():
            assert 0 < len(parked.token_ids) <= batch.max_model_len, (
                f"parked request {handle} holds {len(parked.token_ids)} tokens, expected 1 to "
                f"max_model_len={batch.max_model_len}"
            )
        num_groups = len(self.kv_cache_config.kv_cache_groups)
        assert len(batch.block_table) == num_groups, (
            f"{len(batch.block_table)} block tables for {num_groups} KV-cache groups"
        )
        self.encoder_inputs.check_invariants(set(self.parked) | set(batch.handle_to_row))
        num_blocks = self.kv_cache_config.num_blocks
        for group_idx, table in enumerate(batch.block_table.tables):
            max_id = int(table.block_table.max(initial=0))
            assert max_id < num_blocks, (
                f"group {group_idx} holds block id {max_id}, past num_blocks={num_blocks}"
            )
        check_kv_caches(self.kv_cache_config, self.kv_caches)
        if self.kv_tiers is not None:
            self.kv_tiers.check_invariants()
        if self.step_buffers is not None:
            self.step_buffers.check_invariants()


def build_model_runner(
    config: WorkerConfig,
    kv_cache_config: KVCacheConfig,
    tp_group: TPGroup,
    device: torch.device,
    model: Model | None = None,  # built already (capacity was profiled on it); None builds it
) -> ModelRunner:
    """The model of `config`, its KV tensors of exactly kv_cache_config.num_blocks, and a runner."""
    dtype, kv_dtype = resolve_dtypes(config.model, config.dtype, config.kv_cache_dtype, device)
    if model is None:
        model = build_model(
            config.model,
            tp_group,
            device,
            config.seed,
            config.model_step_ms,
            dtype,
            config.model_prefill_token_us,
            config.attention_backend,
            config.max_model_len,
        )
    kv_caches = allocate_kv_caches(kv_cache_config, tp_group.tp_size, device)
    kv_tiers = build_kv_tiers(kv_cache_config, kv_caches, tp_group.tp_size, config.rank)
    info = get_model_info(config.model, config.block_size, kv_dtype, tp_group.tp_size)
    kv_transfer = build_kv_transfer(config, kv_cache_config, kv_caches, tp_group.tp_size, info.name)
    limits = StepLimits(config.max_num_batched_tokens, config.max_num_seqs)
    runner = ModelRunner(
        model,
        kv_cache_config,
        kv_caches,
        config.rank,
        info.max_model_len,
        device,
        check_each_step=kv_cache_config.check_invariants,  # the engine's --check-invariants
        # a checkpoint's attention reads whole contexts (worker/attention_backends/), which
        # is right for any schedule: planning a shared prefix for it would be wasted work
        enable_cascade_attention=not is_checkpoint(config.model),
        eos_token_ids=info.eos_token_ids,
        kv_tiers=kv_tiers,
        step_limits=limits if uses_step_buffers(config, device) else None,
        kv_transfer=kv_transfer,
        # the engine sends a deferred bitmask right after the step before: a rank waits for it
        # as long as it would for a step
        following_bitmasks=FollowingGrammarBitmasks(config.engine_timeout_s),
    )
    refusal = graph_refusal(config, device, tp_group)
    if refusal is None:  # capture happens now, before the first step; its memory was counted
        runner.enable_decode_graphs(decode_buckets(limits.max_decode_batch))
    elif device.type == "cuda":
        logger.info("decode steps run eagerly: %s", refusal)
    return runner


def build_kv_transfer(
    config: WorkerConfig,
    kv_cache_config: KVCacheConfig,
    kv_caches: dict[str, torch.Tensor],
    tp_size: int,
    model_name: str,
) -> KVTransferRank | None:
    """This rank's P/D agent (DESIGN.md §12), serving pulls when the engine named an address;
    None for a model whose KV cannot move yet (protocol/kv_transfer.describe_unsupported_groups)."""
    if describe_unsupported_groups(kv_cache_config.kv_cache_groups) is not None:
        return None  # the engine refuses --kv-role prefill or decode for such a model
    fingerprint = model_fingerprint(config.model, config.seed)
    layout = kv_transfer_layout(model_name, kv_cache_config, tp_size, fingerprint)
    pages = shared_kv_tensors(kv_cache_config, kv_caches, tp_size)
    transport = kv_cache_config.kv_transport
    nixl = None
    if transport == "nixl" or (transport == "auto" and nixl_available()):
        nixl = NixlPages(config.rank, pages)  # the engine refused nixl where it is missing
    head_view = kv_head_view(kv_cache_config.kv_cache_groups, tp_size)
    kv_transfer = KVTransferRank(config.rank, pages, layout, config.curve, nixl, head_view)
    if kv_cache_config.kv_transfer_address is not None:
        address = kv_cache_config.kv_transfer_address
        kv_transfer.serve(address, kv_cache_config.generation, config.engine_address)
    return kv_transfer
