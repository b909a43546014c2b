"""The worker process: one tensor-parallel rank. It joins the TP group, measures its KV capacity,
says hello to the engine, allocates exactly what it is told, then runs every step it is sent.

It owns the DEALER socket, its reader of the engine's step ring (same-host ranks), and the process
lifecycle, never scheduling. On an exception it sends WorkerFailed and exits 1; when the engine
disconnects or goes silent, it exits 1 too.
"""

import gc
import logging
import os
import signal
import socket
import sys
import time

import msgspec
import torch
import zmq
from zmq.utils.monitor import parse_monitor_message

from protocol import PROTOCOL_VERSION
from protocol.codec import engine_to_worker_decoder, make_encoder
from protocol.config import WorkerConfig
from protocol.errors import ProtocolError
from protocol.kv_cache_spec import KVCacheConfig
from protocol.shm_ring import RingAttachError, RingClosedError, read_host_id
from protocol.worker_messages import (
    EngineToWorker,
    ModelInfo,
    SchedulerOutput,
    Shutdown,
    StepGrammarBitmask,
    WorkerHello,
    WorkerReady,
)
from worker.distributed import TPGroup, init_tp_group, resolve_device
from worker.graph_runner import uses_step_buffers
from worker.kv_cache import CudaMemory, memory_at_start
from worker.kv_transfer import model_fingerprint
from worker.model_runner import ModelRunner, build_model_runner
from worker.models.model import Model
from worker.models.registry import (
    build_model,
    get_model_info,
    prompt_logits_refusal,
    resolve_dtypes,
)
from worker.profiling import measure_num_blocks
from worker.reply_queue import POLL_RESOLUTION_S, ReplyQueue, sleep_until
from worker.shm_ring_reader import SHM_FOLDER, ShmRingReader
from worker.step_stream import StepStream

logger = logging.getLogger(__name__)

HEARTBEAT_TTL_FACTOR = 1  # the engine may go this many heartbeat timeouts without a ping
STOP_CHECK_S = 1.0  # an idle wait looks at a pending SIGTERM at least this often
FAILED_LINGER_MS = 1000  # how long a closing socket may still deliver WorkerFailed
EXIT_OK, EXIT_FAILED = 0, 1
GIL_SWITCH_INTERVAL_S = 0.0005
STREAM_CLOSE_TIMEOUT_S = 1.0  # a step stuck past this (a peer gone mid-collective) is abandoned
# libzmq can announce a disconnect on the monitor a moment before the DEALER shows the last frames
# the engine sent (its Shutdown); a disconnect waits this long for such a frame before it counts
DISCONNECT_DRAIN_MS = 200


class EngineGoneError(RuntimeError):
    """The engine disconnected, stopped answering, or told this worker to stop on a failure."""


class StopSignalGraceError(RuntimeError):
    """SIGTERM came, and the engine's Shutdown did not follow within the grace period."""


class Worker:
    """One rank's connection to the engine and its step loop.

    Invariants: `last_step_id` is the id of the last step executed (0 before the first), and the
    next accepted step is `last_step_id + 1`; `runner` is set once the KV cache is allocated, and
    only then are steps accepted; `ring` is attached only from then on, and registered in `poller`.
    """

    def __init__(self, config: WorkerConfig, sock: zmq.Socket, monitor: zmq.Socket) -> None:
        self.config = config
        self.sock = sock
        self.monitor = monitor
        self.poller = zmq.Poller()
        self.poller.register(sock, zmq.POLLIN)
        self.poller.register(monitor, zmq.POLLIN)
        self.encoder = make_encoder()
        self.decoder = engine_to_worker_decoder()
        self.last_step_id = 0
        self.generation: int | None = None  # named by the engine's KVCacheConfig (DESIGN.md §8)
        self.tp_group: TPGroup | None = None
        self.model: Model | None = None  # built before WorkerHello, so capacity is measured on it
        self.runner: ModelRunner | None = None
        self.stop_signal_time: float | None = None  # time.monotonic() of a SIGTERM while serving
        self.ring: ShmRingReader | None = None  # the engine's step ring, when this rank reads it
        self.ring_closed_deadline: float | None = None  # for the Shutdown once the ring closed
        self.replies = ReplyQueue()  # step replies held until the model's output is ready
        self.stream: StepStream | None = None  # runs the steps, once the KV cache exists

    def run(self) -> int:
        """Join the TP group, handshake, then serve steps until Shutdown; the exit code."""
        config = self.config
        device = resolve_device(config.device, config.device_index, config.local_rank)
        model_info = self.say_hello(device)
        deadline = time.monotonic() + config.engine_timeout_s
        match self.recv(deadline, "a KVCacheConfig"):
            case KVCacheConfig() as kv_cache_config:
                self.allocate(kv_cache_config, model_info, device)
            case Shutdown() as shutdown:
                return self.stop(shutdown)
            case other:
                raise ProtocolError(f"expected KVCacheConfig, got {type(other).__name__}")
        return self.serve()

    def say_hello(self, device: torch.device) -> ModelInfo:
        """Form the TP group, build the model, measure capacity, send WorkerHello; the model's
        info."""
        config = self.config
        # what others hold is read before this rank allocates anything on the device
        start = memory_at_start(CudaMemory(device)) if device.type == "cuda" else None
        # the TP group forms before WorkerHello (DESIGN.md §6), so a missing peer fails here
        self.tp_group = init_tp_group(
            config.rank,
            config.tp_size,
            config.master_addr,
            config.master_port,
            config.dist_timeout_s,
            device,
            config.distributed_backend,
        )
        dtype, kv_dtype = resolve_dtypes(config.model, config.dtype, config.kv_cache_dtype, device)
        model_info = get_model_info(config.model, config.block_size, kv_dtype, config.tp_size)
        refusal = prompt_logits_refusal(config.model, uses_step_buffers(config, device))
        fingerprint = model_fingerprint(config.model, config.seed)
        model_info = msgspec.structs.replace(
            model_info, prompt_logits_refusal=refusal, fingerprint=fingerprint
        )
        self.model = build_model(
            config.model,
            self.tp_group,
            device,
            config.seed,
            config.model_step_ms,
            dtype,
            config.model_prefill_token_us,
            config.attention_backend,
            config.max_model_len,
        )
        num_blocks = measure_num_blocks(
            config, model_info, device, start, self.model, self.tp_group
        )
        hello = WorkerHello(
            PROTOCOL_VERSION,
            config.rank,
            config.tp_size,
            os.getpid(),
            socket.gethostname(),
            str(device),
            model_info,
            num_blocks,
            host_id=read_host_id(),
            is_shm_ring_capable=os.access(SHM_FOLDER, os.R_OK | os.W_OK),
        )
        self.sock.send(self.encoder.encode(hello))
        return model_info

    def allocate(
        self, kv_cache_config: KVCacheConfig, model_info: ModelInfo, device: torch.device
    ) -> None:
        """Allocate exactly the agreed num_blocks, build the runner, say WorkerReady."""
        if kv_cache_config.kv_cache_groups != model_info.kv_cache_groups:
            raise ProtocolError(
                f"rank {self.config.rank} got KV-cache groups that differ "
                f"from its model {self.config.model}'s"
            )
        assert self.tp_group is not None, "allocate before the TP group formed"
        self.runner = build_model_runner(
            self.config, kv_cache_config, self.tp_group, device, self.model
        )
        self.generation = kv_cache_config.generation
        self.last_step_id = kv_cache_config.first_step_id - 1
        self.stream = StepStream(self.runner)
        self.poller.register(self.stream.fileno(), zmq.POLLIN)
        # this thread must get the GIL back soon after a reply comes due, even while the step
        # thread runs Python: 0.5 ms rather than the default 5 ms between forced switches
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        is_attached = self.attach_ring(kv_cache_config)
        # torch, the model and the runner live as long as the rank: left to the collector, a
        # full collection walks them all (about 0.1 s on a CPU rank) and stalls every rank's step
        gc.collect()
        gc.freeze()
        kv_transfer = self.runner.kv_transfer
        ready = WorkerReady(
            self.config.rank,
            kv_cache_config.num_blocks,
            self.generation,
            is_attached,
            kv_transfer.endpoint if kv_transfer is not None else None,
        )
        self.sock.send(self.encoder.encode(ready))
        logger.info(
            "ready: %d blocks per layer, worker generation %d",
            kv_cache_config.num_blocks,
            self.generation,
        )

    def attach_ring(self, kv_cache_config: KVCacheConfig) -> bool:
        """Read steps off the engine's ring when the config names this rank one of its readers;
        a rank that cannot (another /dev/shm or network namespace) says so and keeps ZMQ."""
        name, reader_ranks = kv_cache_config.shm_ring_name, kv_cache_config.shm_ring_reader_ranks
        if name is None or self.config.rank not in reader_ranks:
            return False
        try:
            self.ring = ShmRingReader(name, reader_ranks.index(self.config.rank))
        except (RingAttachError, OSError) as exc:
            logger.warning("cannot read steps off ring %s, taking them over ZMQ: %s", name, exc)
            return False
        self.poller.register(self.ring.fileno(), zmq.POLLIN)
        logger.info("steps come over ring %s", name)
        return True

    def serve(self) -> int:
        """Run steps until Shutdown. SIGTERM (a container stop reaches every process at once)
        does not end the rank: the engine drains its requests and then sends Shutdown, which
        the rank awaits for shutdown_grace_s before it gives up and exits. While a reply waits
        for its model output, the next step is taken and run (worker/reply_queue.py)."""
        signal.signal(signal.SIGTERM, self._note_stop_signal)
        while True:
            message = self.recv(None, "a step", self.replies.next_ready_at())
            self.send_due_replies()
            match message:
                case None:  # a step finished, or a held reply came due
                    continue
                case SchedulerOutput() as step:
                    self.execute(step)
                case StepGrammarBitmask() as bitmask:
                    self.take_grammar_bitmask(bitmask)
                case Shutdown() as shutdown:
                    if dropped := self.replies.drop():
                        logger.debug("dropped %d step replies the engine no longer awaits", dropped)
                    return self.stop(shutdown)
                case other:
                    raise ProtocolError(f"got {type(other).__name__} after startup")

    def execute(self, step: SchedulerOutput) -> None:
        """Queue the step on the step thread; its reply is sent once it is ready."""
        if step.step_id != self.last_step_id + 1 or step.generation != self.generation:
            raise ProtocolError(
                f"rank {self.config.rank} got step {step.step_id} of generation "
                f"{step.generation}, expected step {self.last_step_id + 1} of {self.generation}"
            )
        self.last_step_id = step.step_id
        assert self.stream is not None, "a step arrived before the KV cache was allocated"
        self.stream.submit(step)

    def take_grammar_bitmask(self, message: StepGrammarBitmask) -> None:
        """Hand the step thread the bitmask of the step it runs or will run next: the last one
        this rank was sent, which said its bitmask follows."""
        if message.step_id != self.last_step_id or message.generation != self.generation:
            raise ProtocolError(
                f"rank {self.config.rank} got the grammar bitmask of step {message.step_id} of "
                f"generation {message.generation}, expected step {self.last_step_id} of "
                f"{self.generation}"
            )
        assert self.runner is not None and self.runner.following_bitmasks is not None
        self.runner.following_bitmasks.put(message)

    def send_due_replies(self) -> None:
        """Take the step thread's finished replies (raising what failed a step), then send those
        whose model output is ready, in step order."""
        if self.stream is not None:
            for ready_at_s, frame in self.stream.take_results():
                self.replies.put(ready_at_s, frame)
        for frame in self.replies.pop_due(time.perf_counter()):
            self.reply(frame)

    def reply(self, frame: bytes) -> None:
        """In this rank's lane of the engine's ring when it reads one, else over the DEALER."""
        ring = self.ring
        if ring is None or not ring.has_reply_lane:
            self.sock.send(frame)
            return
        try:
            ring.write_reply(frame, self.config.engine_timeout_s)
        except RingClosedError as exc:  # the generation was retired under this step: no reply
            self.on_ring_closed(exc)

    def _note_stop_signal(self, signum: int, frame: object) -> None:
        if self.stop_signal_time is None:
            self.stop_signal_time = time.monotonic()
            logger.info(
                "signal %d: waiting up to %.0f s for the engine's Shutdown",
                signum,
                self.config.shutdown_grace_s,
            )

    def stop(self, shutdown: Shutdown) -> int:
        if shutdown.is_failure:
            logger.error("stopping: %s", shutdown.reason)
            return EXIT_FAILED
        logger.info("stopping: %s", shutdown.reason)
        return EXIT_OK

    def recv(
        self, deadline: float | None, awaited: str, wake_at_s: float | None = None
    ) -> EngineToWorker | None:
        """The next message; EngineGoneError on a disconnect or once `deadline` passes; None
        once time.perf_counter() reaches `wake_at_s` first.

        Steps come off the ring when this rank reads one (first, so a step written before a
        Shutdown still runs; spun for briefly, then slept on), everything else over the DEALER.
        Without a deadline (an idle engine sends nothing) the ZMQ heartbeats watch the engine.
        """
        while True:
            wait_ms = self._wait_ms(deadline, awaited)
            if wake_at_s is not None:
                wake_in_s = wake_at_s - time.perf_counter()
                if wake_in_s < POLL_RESOLUTION_S:  # too soon for a poll's whole milliseconds
                    sleep_until(wake_at_s)
                    return None
                wait_ms = min(wait_ms, int(wake_in_s * 1000))
            ring, is_asleep = self.ring, False
            if ring is not None:
                # spin for the next step only when nothing else is under way: a spinning worker
                # thread takes the CPU (and the GIL) the step thread and the engine need
                is_idle = wake_at_s is None and not (self.stream and self.stream.is_busy)
                frame, is_asleep = self._take_or_sleep(ring, is_idle)
                if frame is not None:
                    return self.decoder.decode(frame)
                if not is_asleep:
                    continue  # a frame came in meanwhile, or the ring closed
            try:
                events = dict(self.poller.poll(wait_ms))
            finally:
                if ring is not None and is_asleep:
                    ring.end_sleep()
            if self.sock in events:  # before the monitor: a Shutdown precedes the disconnect
                return self.decoder.decode(self.sock.recv())
            if self.monitor in events:
                event = parse_monitor_message(self.monitor.recv_multipart())
                if self.sock.poll(DISCONNECT_DRAIN_MS, zmq.POLLIN):  # sent before it closed
                    return self.decoder.decode(self.sock.recv())
                raise EngineGoneError(f"the engine at {event['endpoint']!r} disconnected")
            if self.stream is not None and self.stream.fileno() in events:
                return None  # a step finished: its reply may be due already

    def _wait_ms(self, deadline: float | None, awaited: str) -> int:
        """How long the next poll may block; raises once `deadline` or the grace after SIGTERM
        passed."""
        now = time.monotonic()
        if self.ring_closed_deadline is not None:  # the Shutdown that retired the ring is due
            deadline = min(deadline or self.ring_closed_deadline, self.ring_closed_deadline)
        if deadline is not None and now >= deadline:
            raise EngineGoneError(
                f"no {awaited} from the engine at {self.config.engine_address} "
                f"in {self.config.engine_timeout_s} s"
            )
        wait_until = now + self.config.engine_timeout_s if deadline is None else deadline
        if self.stop_signal_time is not None:
            wait_until = min(wait_until, self.stop_signal_time + self.config.shutdown_grace_s)
            if now >= wait_until:
                raise StopSignalGraceError(
                    f"no Shutdown from the engine within shutdown_grace_s="
                    f"{self.config.shutdown_grace_s} s of SIGTERM"
                )
        return max(1, int(min(wait_until - now, STOP_CHECK_S) * 1000))

    def _take_or_sleep(
        self, ring: ShmRingReader, may_spin: bool
    ) -> tuple[bytes | bytearray | None, bool]:
        """The ring's next frame, spun for briefly when `may_spin`, or else (None, whether the
        reader is now asleep on its doorbell); a closed ring is dropped."""
        timeout_s = self.config.engine_timeout_s
        try:
            frame = ring.read_if_ready(timeout_s)
            if frame is None and may_spin and ring.spin():
                frame = ring.read_if_ready(timeout_s)
            return frame, frame is None and ring.begin_sleep()
        except RingClosedError as exc:
            self.on_ring_closed(exc)
            return None, False

    def on_ring_closed(self, exc: RingClosedError) -> None:
        """The engine retired this generation or is exiting, and says so on the DEALER."""
        logger.info("%s: awaiting the engine's word on the DEALER", exc)
        self.close_ring()
        self.ring_closed_deadline = time.monotonic() + self.config.engine_timeout_s

    def failing_step_id(self) -> int | None:
        """The step a failure belongs to: the one the step thread failed in, else the last one
        taken; None before the KV cache exists."""
        if self.stream is not None and self.stream.failed_step_id is not None:
            return self.stream.failed_step_id
        return self.last_step_id if self.runner is not None else None

    def close_stream(self) -> None:
        """Let a running step end (briefly) and stop the step thread."""
        if self.stream is not None:
            self.stream.close(STREAM_CLOSE_TIMEOUT_S)
            self.stream = None

    def close_tiers(self) -> None:
        """Remove this rank's disk tier file: no later generation reads it."""
        if self.runner is not None and self.runner.kv_tiers is not None:
            self.runner.kv_tiers.close()

    def close_kv_transfer(self) -> None:
        """Stop serving and pulling KV transfers (P/D): the rank is leaving."""
        if self.runner is not None and self.runner.kv_transfer is not None:
            self.runner.kv_transfer.close()

    def close_ring(self) -> None:
        if self.ring is not None:
            self.poller.unregister(self.ring.fileno())
            self.ring.close()
            self.ring = None

    def check_invariants(self) -> None:
        assert self.last_step_id >= 0, f"last_step_id={self.last_step_id}"
        assert self.last_step_id == 0 or self.runner is not None, "steps ran without a KV cache"
        assert self.ring is None or self.runner is not None, "a ring before the KV cache"
        if self.ring is not None:
            self.ring.check_invariants()
