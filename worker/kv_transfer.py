"""KVTransferRank: one rank's side of disaggregated prefill and decode (DESIGN.md §12).

It opens sockets: on a prefill engine's rank, a ROUTER that serves pulls of pinned pages, on a
thread of its own; on a decode engine's rank, one DEALER per prefill rank it pulls from.

- Pins and unpins come from the rank's engine with the steps (`KVTransferOrders`) and are
  applied before the step's forward, under the same lock the server holds while it copies pages
  out. An unpin rides the first step that could reuse the blocks, so a pull is never served
  from a block given to another request. A pull is served only when it names a pinned transfer,
  its secret (compared in constant time) and block ids among that transfer's, with this rank's
  number and this rank's KV layout: anything else is refused with the reason, and counted.
- Pulls are queued by the step that orders them and run on a puller thread beside the steps, as
  copies into the fresh blocks the engine took for them (no step touches those blocks until the
  engine has every rank's report): the pages arrive as one frame per shared KV tensor and land
  in the destination blocks through the same [num_blocks, page_bytes] views the tiers copy
  through (worker/kv_cache.shared_kv_tensors); on CUDA on a stream of the thread's own, waited
  for before the pull is reported. Each ended pull is reported once, with the next step's reply.
  A pull that fails or waits past PULL_TIMEOUT_S is reported failed, and its DEALER is dropped so
  that no late reply is read for a later pull.

A pull names its blocks as a run of the pinned ids or by their positions in them (a hybrid
model's pin holds one run per KV-cache group, with the null block, never served, where a
sliding window dropped one). A decode engine of a TP size k times the prefill's sends each rank's
pull to prefill rank r // k, which serves it the (r % k)-th slice of every page's KV heads.

Transports: `ipc://FOLDER` binds a socket file per rank and generation there (same host);
`tcp://HOST` binds a free port. With the deployment's CURVE keys, the server is a CURVE server
with the worker keypair every rank shares, its ZAP handler admits only that key (decode ranks
of the deployment), and a puller is its CURVE client: the pages are encrypted, and the secret
still decides what an admitted peer may read. With NIXL on both ranks (and one TP size), the
server answers with where the pages lie instead of the pages, and the puller READs them
(worker/kv_transfer_nixl.py): the secret then decides what an honest puller is told, not what
an admitted peer can READ, so the engine gives its ranks NIXL only behind CURVE or ipc.
"""

import functools
import hashlib
import hmac
import itertools
import logging
import os
import queue
import re
import threading
import time
from pathlib import Path

import msgspec
import numpy as np
import torch
import zmq

from protocol import PROTOCOL_VERSION
from protocol.config import CurveKeys
from protocol.kv_cache_spec import (
    NULL_BLOCK_ID,
    FullAttentionSpec,
    KVCacheGroupSpec,
    SlidingWindowSpec,
    dtype_size_bytes,
)
from protocol.kv_transfer import (
    KVPull,
    KVPullDone,
    KVPullReply,
    KVPullRequest,
    KVTransferLayout,
    KVTransferOrders,
    describe_pair_mismatch,
)
from worker.kv_transfer_net import WILDCARD_HOSTS, TransferZap, routed_host
from worker.kv_transfer_nixl import NixlPages, NixlReadError
from worker.kv_transfer_shm import ShmPages, read_pages
from worker.models.hf.checkpoint import weight_files
from worker.models.hf.config import is_checkpoint

logger = logging.getLogger(__name__)

PULL_TIMEOUT_S = 5.0  # a pull's answer from the prefill rank, well inside the step deadline
SERVE_POLL_MS = 100  # how often the server thread checks whether it should stop
NIXL_PROGRESS_MS = 1  # how often it progresses its NIXL agent while READs are out
CLOSE_TIMEOUT_S = 2.0
MALFORMED_VALUE_CHARS = 80  # of a refused field's value, in the reason


FINGERPRINT_SAMPLE_BYTES = 1 << 20  # read from each end of each weight file


@functools.cache  # the hello and the transfer agent each ask, once per process
def model_fingerprint(model: str, seed: int) -> str:
    """What tells one model's weights from another's beyond `--model`, for the P/D layout: a
    checkpoint's config.json bytes and, per file its weights load from (checkpoint.weight_files:
    no other file beside them), its name, size and first and last MiB (headers and weights: a
    fine-tune of the same architecture differs there; the files are not read whole, so a
    checkpoint costs 2 MiB a file, against the whole files the load reads next), or the same of
    a GGUF file; for a built-in model its name and the seed that draws its weights. 16 hex
    digits, equal for copies of one checkpoint in any folder. A sample: weights that differ only
    inside every file's middle (an edit of one inner layer) agree."""
    digest = hashlib.sha256()
    if not is_checkpoint(model):
        digest.update(f"{model}:seed={seed}".encode())
        return digest.hexdigest()[:16]
    path = os.path.abspath(model)
    if not os.path.isfile(path):  # a folder, not a GGUF file
        with open(os.path.join(path, "config.json"), "rb") as file:
            digest.update(file.read())
    # the files the weights load from, not every weight-like file beside them (another export,
    # training_args.bin): hosts holding one checkpoint with different leftovers still pair
    for file_path in map(str, weight_files(Path(path))):
        size = os.path.getsize(file_path)
        digest.update(f"{os.path.basename(file_path)}:{size};".encode())
        with open(file_path, "rb") as file:
            digest.update(file.read(FINGERPRINT_SAMPLE_BYTES))
            file.seek(max(0, size - FINGERPRINT_SAMPLE_BYTES))
            digest.update(file.read(FINGERPRINT_SAMPLE_BYTES))
    return digest.hexdigest()[:16]


def kv_head_view(groups: list[KVCacheGroupSpec], tp_size: int) -> tuple[int, int, int] | None:
    """(rows, KV heads per rank, bytes per head) of every group's page on one rank, when all
    groups' pages have that one shape (the only kind a head slice can be cut from); else None."""
    shapes = set()
    for group in groups:
        spec = group.spec
        if not isinstance(spec, FullAttentionSpec | SlidingWindowSpec):
            return None
        head_bytes = spec.head_dim * dtype_size_bytes(spec.dtype)
        shapes.add((2 * spec.block_size, spec.num_kv_heads_per_rank(tp_size), head_bytes))
    return shapes.pop() if len(shapes) == 1 else None


class KVPullError(RuntimeError):
    """A pull that did not complete; the engine computes the prompt instead."""


class KVTransferRank:
    """One rank's transfer server (prefill) and puller (decode).

    Invariants: `_pins` maps each transfer id the engine pinned and has not unpinned to its
    secret and block ids; pages are read or written only under `_lock` on the server side.
    """

    def __init__(
        self,
        rank: int,
        device_pages: list[torch.Tensor],
        layout: KVTransferLayout,
        curve: CurveKeys | None = None,
        nixl: NixlPages | None = None,
        head_view: tuple[int, int, int] | None = None,
    ) -> None:
        self.rank = rank
        self.device_pages = device_pages  # per shared tensor: [num_blocks, page_bytes] uint8
        self.num_blocks = device_pages[0].shape[0] if device_pages else 0
        self._is_cuda = bool(device_pages) and device_pages[0].device.type == "cuda"
        self.layout = layout
        self.curve = curve
        # with NIXL, pages are READ from the peer's registered tensors (kv_transfer_nixl.py)
        self.nixl = nixl
        # every page's front as [rows (K and V of each token), KV heads here, bytes per head],
        # when every group's pages are so (kv_head_view): a decode engine of a larger TP size
        # is served slices of the heads; None: it is refused
        self.head_view = head_view
        self._ctx: zmq.Context | None = None  # made on first use: most ranks never need one
        self.endpoint: str | None = None  # where this rank serves pulls; None: it serves none
        self._pins: dict[int, tuple[str, list[int]]] = {}  # secret, block ids in order
        # NIXL READs authorised and not yet confirmed, by transfer id: until when to progress
        self._nixl_reads: dict[int, float] = {}
        # prefill ranks whose NIXL READ failed (a network UCX cannot cross, say): pulled from
        # the built-in way since; puller thread only
        self._nixl_failed: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._server: zmq.Socket | None = None
        self._zap: TransferZap | None = None  # with CURVE: admits the worker key alone
        self._shm = ShmPages(rank)  # pages for same-host pullers
        self._threads: list[threading.Thread] = []  # the server's
        self._pullers: dict[str, zmq.Socket] = {}  # by prefill rank endpoint; puller thread only
        # (pull, on CUDA the event after the ordering step's tier copies), None to stop
        self._pull_queue: queue.SimpleQueue[tuple[KVPull, object] | None] = queue.SimpleQueue()
        self._pull_thread: threading.Thread | None = None  # started by the first pull
        self._done_lock = threading.Lock()
        # pulls ended since the last take_finished: (pull id, whether it completed, bytes)
        self._done: list[tuple[int, bool, int]] = []
        self._encoder = msgspec.msgpack.Encoder()
        self._request_decoder = msgspec.msgpack.Decoder(KVPullRequest | KVPullDone)
        self._reply_decoder = msgspec.msgpack.Decoder(KVPullReply)
        self.num_served = 0  # pulls served
        self.num_refused = 0  # pulls refused: unknown or stale transfer, wrong secret or blocks
        self._num_refused_reported = 0  # of num_refused, those take_refused already reported

    @property
    def ctx(self) -> zmq.Context:
        if self._ctx is None:
            self._ctx = zmq.Context()
        return self._ctx

    # -- the prefill side ----------------------------------------------------------------------

    def serve(self, address: str, generation: int, peer_address: str | None = None) -> str:
        """Bind under `address` and serve pulls on a thread; the endpoint to announce. A
        wildcard tcp host (`tcp://*`, `tcp://0.0.0.0`) binds every interface and announces the
        one that routes to `peer_address` (the engine's worker address)."""
        if self.curve is not None:  # before the server binds, so no peer slips in unchecked
            self._zap = TransferZap(self.ctx, self.curve.public_key, self._on_zap_refusal)
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        if self.curve is not None:
            sock.setsockopt(zmq.CURVE_SERVER, 1)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, self.curve.public_key.encode())
            sock.setsockopt(zmq.CURVE_SECRETKEY, self.curve.secret_key.encode())
        if address.startswith("ipc://"):
            name = f"rank{self.rank}-gen{generation}-{os.getpid()}.sock"
            endpoint = f"{address.rstrip('/')}/{name}"
            sock.bind(endpoint)
        elif address.startswith("tcp://"):
            port = sock.bind_to_random_port(address)
            host = address.removeprefix("tcp://")
            if host in WILDCARD_HOSTS:
                host = routed_host(peer_address)
            endpoint = f"tcp://{host}:{port}"
        else:
            sock.close()
            raise ValueError(
                f"kv_transfer_address {address!r}: expected ipc://FOLDER or tcp://HOST"
            )
        self._server, self.endpoint = sock, endpoint
        thread = threading.Thread(target=self._serve, name="kv-transfer", daemon=True)
        thread.start()
        self._threads.append(thread)
        logger.info("serving KV transfers at %s", endpoint)
        return endpoint

    def _on_zap_refusal(self) -> None:
        self.num_refused += 1

    def _serve(self) -> None:
        sock = self._server
        assert sock is not None
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while not self._stop.is_set():
            is_reading = self._is_nixl_read_out()
            if self.nixl is not None:
                # every poll, not only while READs are authorised: one that outlived its
                # authorisation (a puller waits out a READ NIXL could not cancel) still ends
                self.nixl.progress()
            if not poller.poll(NIXL_PROGRESS_MS if is_reading else SERVE_POLL_MS):
                continue
            try:
                identity, frame = sock.recv_multipart(zmq.NOBLOCK)
            except (zmq.Again, ValueError):  # a peer that sent other than two frames
                continue
            except zmq.ZMQError:
                return  # closed under us: the rank is stopping
            try:  # a bug in answering one pull refuses it; the thread goes on serving the rest
                reply = self.answer(frame)
            except Exception as exc:
                logger.exception("answering a KV pull failed")
                reply = self._refuse(f"the prefill rank failed answering it: {exc}")
            try:
                sock.send_multipart([identity, *reply])
            except zmq.ZMQError as exc:
                logger.warning("could not answer a KV pull: %s", exc)

    def _is_nixl_read_out(self) -> bool:
        """Whether READs authorised here may still be running (forgets the expired ones)."""
        if self.nixl is None or not self._nixl_reads:
            return False
        now = time.monotonic()
        with self._lock:
            for transfer_id, until in list(self._nixl_reads.items()):
                if until < now:
                    del self._nixl_reads[transfer_id]
            return bool(self._nixl_reads)

    def answer(self, frame: bytes) -> list[bytes]:
        """The reply frames to one pull request: refused with the reason, or the pages."""
        try:
            request = self._request_decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return self._refuse(f"malformed pull: {_describe_malformed(frame, exc)}")
        if isinstance(request, KVPullDone):
            return self._answer_done(request)
        if request.protocol_version != PROTOCOL_VERSION:
            return self._refuse(
                f"protocol version {request.protocol_version}, expected {PROTOCOL_VERSION}"
            )
        mismatch = describe_pair_mismatch(self.layout, request.layout)
        if mismatch is not None:
            return self._refuse(f"KV layouts differ: {mismatch}")
        # with a decode TP size k times ours, k decode ranks pull from this one, a slice each
        num_slices = request.layout.tp_size // self.layout.tp_size
        if request.rank // num_slices != self.rank:
            return self._refuse(f"rank {request.rank} pulled from rank {self.rank}")
        if num_slices > 1 and self.head_view is None:
            return self._refuse("this model's KV-cache groups differ in head layout: no slices")
        with self._lock:
            pin = self._pins.get(request.transfer_id)
            if pin is None or not _same_secret(pin[0], request.secret):
                return self._refuse(f"no pinned transfer {request.transfer_id} with that secret")
            num_blocks = len(request.block_ids)
            if not _are_pinned(
                pin[1], request.first_block_idx, request.block_ids, request.block_idxs
            ):
                where = request.block_idxs or f"from index {request.first_block_idx}"
                return self._refuse(
                    f"blocks {request.block_ids} at {where} are not transfer "
                    f"{request.transfer_id}'s"
                )
            if request.via_nixl and self.nixl is not None and num_slices == 1:
                # the puller READs these pages itself and confirms with a KVPullDone
                self.num_served += 1
                self._nixl_reads[request.transfer_id] = time.monotonic() + PULL_TIMEOUT_S
                reply = KVPullReply(
                    True,
                    None,
                    num_blocks * sum(pages.shape[1] for pages in self.device_pages),
                    nixl_agent=self.nixl.name,
                    nixl_metadata=self.nixl.metadata,
                    nixl_addresses=self.nixl.addresses(request.block_ids),
                    nixl_device_id=self.nixl.device_id,
                )
                return [self._encoder.encode(reply)]
            index = torch.tensor(request.block_ids, dtype=torch.long)
            pages = [
                pages.index_select(0, index.to(pages.device)).cpu().numpy()
                for pages in self.device_pages
            ]
        if num_slices > 1:
            slice_idx = request.rank % num_slices
            pages = [self._head_slice(page, slice_idx, num_slices) for page in pages]
        self.num_served += 1
        num_bytes = sum(page.nbytes for page in pages)
        if request.via_shm:
            name = self._shm.put(pages)
            return [self._encoder.encode(KVPullReply(True, None, num_bytes, name))]
        head = self._encoder.encode(KVPullReply(True, None, num_bytes))
        return [head, *(page.tobytes() for page in pages)]

    def _head_slice(self, pages: np.ndarray, slice_idx: int, num_slices: int) -> np.ndarray:
        """Slice `slice_idx` of `num_slices` of the KV heads of each page in `pages` ([blocks,
        page bytes]), as a decode rank of a TP size num_slices times ours holds it."""
        assert self.head_view is not None
        rows, heads, head_bytes = self.head_view
        num_heads = heads // num_slices
        first = slice_idx * num_heads
        view = pages[:, : rows * heads * head_bytes].reshape(len(pages), rows, heads, head_bytes)
        sliced = view[:, :, first : first + num_heads, :]
        return np.ascontiguousarray(sliced).reshape(len(pages), -1)

    def _answer_done(self, done: KVPullDone) -> list[bytes]:
        """ok while the transfer still pins the blocks a NIXL READ just read: no step has
        reused them (an unpin comes before the forward that could)."""
        if done.protocol_version != PROTOCOL_VERSION or done.rank != self.rank:  # NIXL: same TP
            version = done.protocol_version
            return self._refuse(f"a pull's end from rank {done.rank}, version {version}")
        with self._lock:
            pin = self._pins.get(done.transfer_id)
            if pin is None or _same_secret(pin[0], done.secret):  # the READ's own puller
                self._nixl_reads.pop(done.transfer_id, None)  # its READ has ended
            if (
                pin is None
                or not _same_secret(pin[0], done.secret)
                or not _are_pinned(pin[1], done.first_block_idx, done.block_ids, done.block_idxs)
            ):
                return self._refuse(
                    f"transfer {done.transfer_id} no longer pins the blocks its READ read"
                )
        return [self._encoder.encode(KVPullReply(True))]

    def _refuse(self, reason: str) -> list[bytes]:
        self.num_refused += 1
        logger.warning("refused a KV pull: %s", reason)
        return [self._encoder.encode(KVPullReply(False, reason))]

    # -- the engine's orders, each step --------------------------------------------------------

    def apply(self, orders: KVTransferOrders) -> None:
        """Pins and unpins at once (the step thread, before the forward); pulls are queued for
        the puller thread."""
        if orders.pins or orders.unpins:
            with self._lock:
                for transfer_id in orders.unpins:
                    self._pins.pop(transfer_id, None)
                for pin in orders.pins:
                    self._pins[pin.transfer_id] = (pin.secret, list(pin.block_ids))
        if not orders.pulls:
            return
        if self._pull_thread is None:
            self._pull_thread = threading.Thread(
                target=self._run_pulls, name="kv-pull", daemon=True
            )
            self._pull_thread.start()
        # On CUDA the step's tier copies run on a side stream that the current one waits for: a
        # fresh block may be a page the tiers are still copying out, so the pull waits for them.
        copied = None
        if self._is_cuda:
            copied = torch.cuda.Event()
            copied.record(torch.cuda.current_stream(self.device_pages[0].device))
        for pull in orders.pulls:
            self._pull_queue.put((pull, copied))

    def take_finished(self) -> tuple[list[int], list[int], int]:
        """The pulls ended since the last call: (their ids, the failed ones, bytes moved)."""
        with self._done_lock:
            done, self._done = self._done, []
        finished = [pull_id for pull_id, _, _ in done]
        failed = [pull_id for pull_id, is_done, _ in done if not is_done]
        return finished, failed, sum(num_bytes for _, _, num_bytes in done)

    def take_refused(self) -> int:
        """Pulls this rank refused since the last call (the server and ZAP threads count)."""
        num_refused = self.num_refused
        delta, self._num_refused_reported = num_refused - self._num_refused_reported, num_refused
        return delta

    def _run_pulls(self) -> None:
        stream = torch.cuda.Stream(self.device_pages[0].device) if self._is_cuda else None
        while (item := self._pull_queue.get()) is not None:
            pull, copied = item
            try:
                if self.nixl is not None and copied is not None:
                    copied.synchronize()  # type: ignore[attr-defined]  # NIXL writes off-stream
                if stream is None:
                    num_bytes = self.pull(pull)
                else:
                    with torch.cuda.stream(stream):
                        stream.wait_event(copied)  # type: ignore[arg-type]
                        num_bytes = self.pull(pull)
                    stream.synchronize()  # the pages are in place before the pull is reported
                outcome = (pull.pull_id, True, num_bytes)
            except KVPullError as exc:
                logger.warning(
                    "KV pull %d (transfer %d) failed: %s", pull.pull_id, pull.transfer_id, exc
                )
                outcome = (pull.pull_id, False, 0)
            except Exception:  # a bug here costs the pull, reported like any failure
                logger.exception("KV pull %d failed", pull.pull_id)
                outcome = (pull.pull_id, False, 0)
            with self._done_lock:
                self._done.append(outcome)

    # -- the decode side -----------------------------------------------------------------------

    def pull(self, pull: KVPull) -> int:
        """Copy the pages of `pull.src_block_ids` from the peer rank into `dst_block_ids`;
        the bytes moved, or KVPullError."""
        if len(pull.src_block_ids) != len(pull.dst_block_ids):
            raise KVPullError(
                f"src_block_ids {pull.src_block_ids} for dst_block_ids {pull.dst_block_ids}: "
                "expected as many"
            )
        num_slices = self.layout.tp_size // max(1, len(pull.endpoints))
        if not pull.endpoints or num_slices * len(pull.endpoints) != self.layout.tp_size:
            raise KVPullError(
                f"endpoints {pull.endpoints}: {len(pull.endpoints)} ranks do not divide this "
                f"engine's tp_size {self.layout.tp_size}"
            )
        dst = np.asarray(pull.dst_block_ids, dtype=np.int64)
        if len(dst) and not (dst.min() > 0 and dst.max() < self.num_blocks):
            raise KVPullError(
                f"dst_block_ids {dst.tolist()}: expected each in 1..{self.num_blocks - 1}"
            )
        endpoint = pull.endpoints[self.rank // num_slices]  # slice rank % num_slices of its heads
        request = KVPullRequest(
            PROTOCOL_VERSION,
            self.rank,
            pull.transfer_id,
            pull.secret,
            pull.first_block_idx,
            pull.src_block_ids,
            pull.layout,
            via_shm=endpoint.startswith("ipc://"),
            via_nixl=self.nixl is not None and endpoint not in self._nixl_failed,
            block_idxs=pull.src_block_idxs,
        )
        deadline = time.monotonic() + PULL_TIMEOUT_S
        frames = self.exchange(endpoint, self._encoder.encode(request))
        reply = self._decode_reply(frames[0])
        if reply.ok and reply.nixl_agent is not None:
            return self._read_nixl(endpoint, pull, reply, deadline)
        return self._write(reply, frames, dst)

    def _decode_reply(self, frame: bytes) -> KVPullReply:
        try:
            return self._reply_decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise KVPullError(f"malformed reply: {exc}") from None

    def _read_nixl(self, endpoint: str, pull: KVPull, reply: KVPullReply, deadline: float) -> int:
        """READ the pages the reply locates, then have the prefill rank confirm it still pins
        them; the bytes moved, or KVPullError."""
        nixl, remote_name = self.nixl, reply.nixl_agent
        assert remote_name is not None
        if nixl is None:
            raise KVPullError("the prefill rank answered with NIXL descriptors: no NIXL here")
        try:
            num_bytes = nixl.read(
                remote_name,
                reply.nixl_metadata,
                reply.nixl_addresses,
                reply.nixl_device_id,
                pull.dst_block_ids,
                max(0.0, deadline - time.monotonic()),
            )
        except Exception as exc:  # NixlReadError, or NIXL's own (a bad descriptor, a lost peer)
            nixl.forget(remote_name)
            self._nixl_failed.add(endpoint)
            logger.warning(
                "a NIXL READ from %s failed; pulls from it go the built-in way from now on",
                endpoint,
            )
            reason = str(exc) if isinstance(exc, NixlReadError) else f"{type(exc).__name__}: {exc}"
            raise KVPullError(f"NIXL: {reason}") from None
        done = KVPullDone(
            PROTOCOL_VERSION,
            self.rank,
            pull.transfer_id,
            pull.secret,
            pull.first_block_idx,
            pull.src_block_ids,
            pull.src_block_idxs,
        )
        confirm = self._decode_reply(self.exchange(endpoint, self._encoder.encode(done))[0])
        if not confirm.ok:
            raise KVPullError(f"refused after the READ: {confirm.error}")
        if nixl.num_reads == 1:
            logger.info("KV pages move through NIXL: read from agent %s", remote_name)
        return num_bytes

    def exchange(self, endpoint: str, frame: bytes) -> list[bytes]:
        """Send one pull request to the server at `endpoint`; its reply frames, or KVPullError.
        The transport's one seam (tests join two ranks in one process through it)."""
        sock = self._puller(endpoint)
        try:
            return self._request(sock, frame)
        except KVPullError:
            self._drop_puller(endpoint)  # a late reply must never answer a later pull
            raise

    def _request(self, sock: zmq.Socket, frame: bytes) -> list[bytes]:
        deadline = time.monotonic() + PULL_TIMEOUT_S
        try:  # queued until the connection is up; a peer that never answers times out below
            sock.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            raise KVPullError("the queue to the prefill rank is full") from None
        remaining_ms = int((deadline - time.monotonic()) * 1000)
        if remaining_ms <= 0 or not sock.poll(remaining_ms, zmq.POLLIN):
            raise KVPullError(f"no answer within {PULL_TIMEOUT_S} s")
        return sock.recv_multipart()

    def _write(self, reply: KVPullReply, frames: list[bytes], dst: np.ndarray) -> int:
        if not reply.ok:
            raise KVPullError(f"refused: {reply.error}")
        sizes = [len(dst) * device_pages.shape[1] for device_pages in self.device_pages]
        if reply.shm_name is None:
            pages = frames[1:]
            if [len(page) for page in pages] != sizes:
                raise KVPullError(
                    f"page frames of {[len(p) for p in pages]} bytes, expected {sizes}"
                )
            self._copy_in([np.frombuffer(page, dtype=np.uint8) for page in pages], dst)
            return sum(sizes)
        try:
            data = np.frombuffer(read_pages(reply.shm_name, sum(sizes)), dtype=np.uint8)
        except ValueError as exc:
            raise KVPullError(str(exc)) from None
        offsets = np.cumsum([0, *sizes])
        self._copy_in([data[start:end] for start, end in itertools.pairwise(offsets)], dst)
        return sum(sizes)

    def _copy_in(self, runs: list[np.ndarray], dst: np.ndarray) -> None:
        """Each shared tensor's run of pages into the destination blocks."""
        index = torch.from_numpy(dst)
        for run, device_pages in zip(runs, self.device_pages, strict=True):
            # a writable copy of a read-only frame's bytes
            src = torch.from_numpy(run.copy()).view(len(dst), device_pages.shape[1])
            device_pages.index_copy_(0, index.to(device_pages.device), src.to(device_pages.device))

    def _puller(self, endpoint: str) -> zmq.Socket:
        sock = self._pullers.get(endpoint)
        if sock is None:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            if self.curve is not None:  # the prefill rank holds the worker keypair we share
                sock.setsockopt(zmq.CURVE_SERVERKEY, self.curve.public_key.encode())
                sock.setsockopt(zmq.CURVE_PUBLICKEY, self.curve.public_key.encode())
                sock.setsockopt(zmq.CURVE_SECRETKEY, self.curve.secret_key.encode())
            sock.connect(endpoint)
            self._pullers[endpoint] = sock
        return sock

    def _drop_puller(self, endpoint: str) -> None:
        sock = self._pullers.pop(endpoint, None)
        if sock is not None:
            sock.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        if self._pull_thread is not None:
            self._pull_queue.put(None)  # after the pulls queued before it
            self._pull_thread.join(PULL_TIMEOUT_S + CLOSE_TIMEOUT_S)
        for thread in self._threads:
            thread.join(CLOSE_TIMEOUT_S)
        if self._server is not None:
            self._server.close(linger=0)
        if self._zap is not None:
            self._zap.close()
        self._shm.close()
        if self.nixl is not None:
            self.nixl.close()
        for endpoint in list(self._pullers):
            self._drop_puller(endpoint)
        if self._ctx is not None:
            self._ctx.term()

    def check_invariants(self) -> None:
        with self._lock:
            for transfer_id, (_, block_ids) in self._pins.items():
                # NULL_BLOCK_ID stands where a sliding window dropped a block: never served
                assert all(0 <= block_id < self.num_blocks for block_id in block_ids), (
                    f"transfer {transfer_id} pins blocks {sorted(block_ids)} outside the pool"
                )


def _are_pinned(pinned: list[int], first: int, block_ids: list[int], block_idxs: list[int]) -> bool:
    """Whether `block_ids` are pinned exactly where a pull says: at `block_idxs` in the pinned
    ids when given, else as the run from `first`. The null block is never served."""
    if NULL_BLOCK_ID in block_ids:
        return False
    if not block_idxs:
        return first >= 0 and pinned[first : first + len(block_ids)] == block_ids
    return len(block_idxs) == len(block_ids) and all(
        0 <= idx < len(pinned) and pinned[idx] == block_id
        for idx, block_id in zip(block_idxs, block_ids, strict=True)
    )


def _describe_malformed(frame: bytes, exc: Exception) -> str:
    """msgspec's reason for a malformed pull, the array position it names (`$[4]`, `$[6][1]`)
    spelled as the field (`secret`, `block_ids[1]`), with the value found there."""
    reason = str(exc)
    path = re.search(r"`\$((?:\[\d+\])+)`", reason)
    try:
        value = msgspec.msgpack.decode(frame)
    except (msgspec.DecodeError, ValueError, RecursionError):
        return reason
    if path is None or not isinstance(value, list) or not value or not isinstance(value[0], str):
        return reason
    message = {"KVPullRequest": KVPullRequest, "KVPullDone": KVPullDone}.get(value[0])
    if message is None:  # an unknown tag: msgspec's reason says so
        return reason
    fields: tuple[str, ...] = ("tag", *message.__struct_fields__)
    names = []
    for idx in map(int, re.findall(r"\d+", path.group(1))):
        if idx < len(fields):
            names.append(("." if names else "") + fields[idx])
        else:
            names.append(f"[{idx}]")
        fields = KVTransferLayout.__struct_fields__ if names[-1] == "layout" else ()
        value = value[idx] if isinstance(value, list) and idx < len(value) else None
    shown = repr(value)
    if len(shown) > MALFORMED_VALUE_CHARS:
        shown = shown[:MALFORMED_VALUE_CHARS] + "..."
    return reason.replace(path.group(0), f"`{''.join(names)}` = {shown}")


def _same_secret(expected: str, given: str) -> bool:
    return hmac.compare_digest(expected.encode(), given.encode())
