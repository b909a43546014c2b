"""StructuredOutputManager: the engine's one owner of grammar state. It compiles each
constrained request's grammar (xgrammar, with a compile cache), keeps a matcher per request,
advances it with each accepted token, and writes each step's token bitmask. It never schedules
and never changes a Request: the Scheduler asks it, by the request's handle.
"""

import contextlib
import logging
import math
import os
import threading
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from engine_core.structured.vocabulary import (
    TOKENIZER_FILE,
    TokenizerVocabulary,
    read_tokenizer_vocabulary,
)
from protocol.buffers import pack_int32
from protocol.sampling import MAX_JSON_SCHEMA_DEPTH, StructuredOutputs, json_nesting_depth
from protocol.worker_messages import GrammarBitmask, ModelInfo

if TYPE_CHECKING:
    import xgrammar

logger = logging.getLogger(__name__)

# A JSON schema's whitespace runs (between the tokens of the JSON text) are at most this long.
# vLLM allows any; a bound keeps a wandering model from filling max_tokens with blanks (a newline
# and an indentation of up to 7 spaces still fit).
MAX_JSON_WHITESPACE = 8
# The character class of xgrammar's length-bounded JSON string, and JSON's own (EBNF text)
_XGRAMMAR_BOUNDED_STRING_CHAR = r"[^\"\\\r\n]"
_JSON_STRING_CHAR = r"[^\"\\\0-\x1f\ud800-\udfff]"
# its unbounded JSON string's character class, which lets the same surrogates through
_XGRAMMAR_STRING_CHAR = r"[^\0-\x1f\"\\\r\n]"
COMPILE_THREADS = 2  # xgrammar's threads per compile (this engine runs beside its ranks)
COMPILE_CACHE_BYTES = 256 * 1024 * 1024  # compiled grammars kept for requests that repeat them
# Token masks are computed when a grammar state is first reached, not all at compile time: the
# step loop pays for the states a request visits (a 770 KB regex compiles in 2 s, not 100 s)
IS_DYNAMIC_COMPILATION = True


class StructuredOutputManager:
    """Compiles grammars against one tokenizer's vocabulary and holds one matcher per request.

    The bitmask is `bitmask_width` int32 words per row: bit i of word w allows token 32*w + i,
    over the model's `vocab_size` (the logits' width), which may exceed the tokenizer's own
    vocabulary; ids past the tokenizer's are never allowed.

    Invariants: `matchers` holds exactly the live constrained requests, by handle; a matcher has
    accepted exactly its request's output tokens, so it never needs rolling back (a token
    sampled past a request's end is dropped before it reaches the matcher, and preemption keeps
    its tokens).
    """

    def __init__(
        self, vocabulary: TokenizerVocabulary, vocab_size: int, stop_token_ids: Sequence[int]
    ) -> None:
        # imported here: xgrammar loads torch, which only an engine that constrains needs
        import xgrammar

        if vocabulary.num_tokens > vocab_size:
            raise ValueError(
                f"the tokenizer has {vocabulary.num_tokens} tokens, more than the model's "
                f"vocab_size {vocab_size}"
            )
        self._xgrammar = xgrammar
        self.vocab_size = vocab_size
        self.bitmask_width = math.ceil(vocab_size / 32)
        tokenizer_info = xgrammar.TokenizerInfo(
            vocabulary.encoded_vocab,
            xgrammar.VocabType[vocabulary.vocab_type.name],  # the same three names
            vocab_size=vocab_size,
            stop_token_ids=list(stop_token_ids),
            add_prefix_space=vocabulary.add_prefix_space,
        )
        self._compiler = xgrammar.GrammarCompiler(
            tokenizer_info,
            max_threads=COMPILE_THREADS,
            cache_enabled=True,
            cache_limit_bytes=COMPILE_CACHE_BYTES,
            enable_dynamic_compilation=IS_DYNAMIC_COMPILATION,
        )
        self.matchers: dict[int, xgrammar.GrammarMatcher] = {}  # by request handle
        self._bitmask = np.zeros((0, self.bitmask_width), dtype=np.int32)  # grown on demand
        # Background compiles (start_compile): one at a time, beside the step loop, which a new
        # schema would otherwise stall (xgrammar releases the GIL while it compiles)
        self._compiler_thread: ThreadPoolExecutor | None = None
        self.compiling: dict[str, Future] = {}  # by key, started and not yet taken
        # (key, compile) of each compile that ended, appended by the thread: the compile is named
        # too, since a key cancelled and started again has a second compile under it
        self._compiled: deque[tuple[str, Future]] = deque()
        self._wake_read, self._wake_write = os.pipe()  # a byte per compile ended
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        self._wake_lock = threading.Lock()

    def compile(self, spec: StructuredOutputs) -> "xgrammar.CompiledGrammar":
        """The compiled grammar of `spec`; ValueError naming the kind and xgrammar's reason."""
        compiler = self._compiler
        if spec.json is not None:  # checked before xgrammar spends minutes on a deep one
            depth = json_nesting_depth(spec.json, MAX_JSON_SCHEMA_DEPTH)
            if depth > MAX_JSON_SCHEMA_DEPTH:
                raise ValueError(
                    f"structured outputs: json does not compile: nested more than "
                    f"{MAX_JSON_SCHEMA_DEPTH} levels deep"
                )
        try:
            if spec.json is not None or spec.json_object:
                return compiler.compile_grammar(self._json_grammar(spec))
            if spec.regex is not None:
                return compiler.compile_regex(spec.regex)
            if spec.choice is not None:
                return compiler.compile_grammar(choice_grammar(spec.choice))
            assert spec.grammar is not None  # StructuredOutputs holds exactly one kind
            return compiler.compile_grammar(spec.grammar)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ValueError(f"structured outputs: {_kind(spec)} does not compile: {exc}") from None

    def _json_grammar(self, spec: StructuredOutputs) -> str:
        """The EBNF of a json or json_object spec, its bounded strings kept to valid JSON.

        xgrammar writes a string with maxLength or minLength as a run of any character but a
        quote, a backslash, CR or LF: other control characters (U+0000-U+001F), which JSON
        forbids unescaped, would pass, and so would the UTF-8 bytes of a lone surrogate, which
        no decoder accepts (each of its bytes becomes a U+FFFD, breaking maxLength too); a
        random-weight model writes both. The rule's character class is narrowed to refuse them, and
        so is that of an unbounded string, which lets the surrogates through.
        """
        grammar = self._xgrammar.Grammar.from_json_schema(
            '{"type": "object"}' if spec.json is None else spec.json,
            any_whitespace=not spec.disable_any_whitespace,
            max_whitespace_cnt=MAX_JSON_WHITESPACE,
        )
        ebnf = str(grammar).replace(_XGRAMMAR_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR)
        return ebnf.replace(_XGRAMMAR_STRING_CHAR, _JSON_STRING_CHAR)

    def add_request(
        self,
        handle: int,
        spec: StructuredOutputs,
        compiled: "xgrammar.CompiledGrammar | None" = None,
    ) -> None:
        """Start a matcher for the request over `compiled`, or over `spec` compiled now when
        that is None; ValueError when it cannot compile."""
        if handle in self.matchers:
            raise ValueError(f"request {handle} already has a grammar")
        if compiled is None:
            compiled = self.compile(spec)
        self.matchers[handle] = self._xgrammar.GrammarMatcher(compiled)

    # -- compiles off the step loop -------------------------------------------------------------

    def start_compile(self, key: str, spec: StructuredOutputs) -> None:
        """Compile `spec` on the compile thread; `take_compiled` hands over the result, and
        `fileno` turns readable when one is ready. `key` names it (a request's scoped id)."""
        if key in self.compiling:
            raise ValueError(f"a grammar for {key!r} is compiling already")
        if self._wake_read < 0:
            raise RuntimeError("the grammar compiler is closed")
        if self._compiler_thread is None:
            self._compiler_thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        future = self._compiler_thread.submit(self.compile, spec)
        self.compiling[key] = future
        future.add_done_callback(lambda done: self._on_compiled(key, done))

    def _on_compiled(self, key: str, future: Future) -> None:
        """On the compile thread, or at once on the caller's when it is cancelled or done."""
        # under the lock: close() may not release the pipe under this write, and take_compiled
        # takes each end with its byte
        with self._wake_lock:
            if self._wake_write < 0:
                return
            self._compiled.append((key, future))
            with contextlib.suppress(BlockingIOError):  # a full pipe wakes the loop already
                os.write(self._wake_write, b"\1")

    def fileno(self) -> int:
        """Readable once a compile started by `start_compile` ended; -1 once closed."""
        return self._wake_read

    def has_compiled(self) -> bool:
        """Whether a compile ended whose result `take_compiled` has not handed over yet."""
        return bool(self._compiled)

    def take_compiled(self) -> list[tuple[str, "xgrammar.CompiledGrammar | str"]]:
        """The compiles that ended since the last call, oldest first: (key, the compiled
        grammar, or the error that names why it does not compile). Cancelled ones are left out.

        The ends are taken and the wake pipe emptied under the lock the compile thread queues an
        end and writes its byte under: a byte left for an end already taken would keep the
        pipe readable, and the server's poll awake, until the next compile."""
        ended = []
        with self._wake_lock:
            if self._wake_read >= 0:
                with contextlib.suppress(BlockingIOError):
                    while os.read(self._wake_read, 4096):
                        pass
            while self._compiled:
                ended.append(self._compiled.popleft())
        results: list[tuple[str, xgrammar.CompiledGrammar | str]] = []
        for key, future in ended:
            if self.compiling.get(key) is not future:  # cancelled; its key may compile anew
                continue
            del self.compiling[key]
            exc = future.exception()
            if exc is None:
                results.append((key, future.result()))
            elif isinstance(exc, ValueError):
                results.append((key, str(exc)))
            else:  # a bug in xgrammar or here: the request fails, the engine goes on
                logger.error("compiling the grammar of %r failed", key, exc_info=exc)
                results.append((key, f"structured outputs: compiling failed: {exc!r}"))
        return results

    def cancel_compile(self, key: str) -> bool:
        """Forget a compile whose request ended; False when none is running for `key`."""
        future = self.compiling.pop(key, None)
        if future is None:
            return False
        future.cancel()  # a queued compile never runs; a running one finishes unread
        return True

    def close(self) -> None:
        """Stop the compile thread (queued compiles are dropped) and release the wake pipe."""
        if self._compiler_thread is not None:
            self._compiler_thread.shutdown(wait=False, cancel_futures=True)
            self._compiler_thread = None
        with self._wake_lock:
            if self._wake_read >= 0:
                os.close(self._wake_read)
                os.close(self._wake_write)
                self._wake_read = self._wake_write = -1
        self.compiling.clear()
        self._compiled.clear()

    def remove_request(self, handle: int) -> None:
        """Forget a finished request's matcher; a request without one is ignored."""
        self.matchers.pop(handle, None)

    def accept_token(self, handle: int, token_id: int) -> bool:
        """Advance the request's matcher by its sampled token; False when the grammar refuses it
        (the bitmask should have made that impossible)."""
        matcher = self.matchers[handle]
        if matcher.is_terminated():
            return False
        return bool(matcher.accept_token(token_id))

    def is_terminated(self, handle: int) -> bool:
        """The grammar is complete and has accepted its stop token: the request is done."""
        return bool(self.matchers[handle].is_terminated())

    def grammar_bitmask(self, handles: Sequence[int], req_idxs: Sequence[int]) -> GrammarBitmask:
        """The allowed next tokens of each request in `handles`, for the step rows `req_idxs`
        (their places in SchedulerOutput order). Reads the matchers; changes none.

        A handle with no matcher is a request that finished after its step was scheduled (a
        deferred bitmask, asynchronous scheduling): whatever its row samples is dropped, so the
        row allows every token."""
        num_rows = len(handles)
        if self._bitmask.shape[0] < num_rows:
            self._bitmask = np.zeros((num_rows, self.bitmask_width), dtype=np.int32)
        bitmask = self._bitmask[:num_rows]  # [num_rows, bitmask_width]
        bitmask.fill(-1)  # every bit set: fill_next_token_bitmask clears the refused ones
        matchers = self.matchers
        for row, handle in enumerate(handles):
            matcher = matchers.get(handle)
            if matcher is not None:
                matcher.fill_next_token_bitmask(bitmask, row)
        return GrammarBitmask(pack_int32(list(req_idxs)), bitmask.tobytes())

    def check_invariants(self, constrained_handles: set[int]) -> None:
        """`constrained_handles`: the live constrained requests, each of which has a matcher."""
        matchers = set(self.matchers)
        assert matchers == constrained_handles, (
            f"grammar matchers for {sorted(matchers)}, constrained requests "
            f"{sorted(constrained_handles)}"
        )


def choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar whose only sentences are `choices`, each exactly; ValueError for a choice
    holding NUL, which xgrammar's strings cannot (it ends them there)."""
    if any("\0" in choice for choice in choices):
        raise ValueError("a choice holds a NUL character, which no grammar string can")
    return "root ::= " + " | ".join(_ebnf_string(choice) for choice in choices)


def _ebnf_string(text: str) -> str:
    """`text` as an EBNF string literal: quote and backslash escaped, and control characters as
    \\uXXXX (xgrammar's \\x takes every hex digit that follows, so "\\x01a" would be 0x1a)."""
    pieces = []
    for char in text:
        if char in '"\\':
            pieces.append("\\" + char)
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            pieces.append(f"\\u{ord(char):04x}")
        else:
            pieces.append(char)
    return '"' + "".join(pieces) + '"'


def _kind(spec: StructuredOutputs) -> str:
    """The one kind `spec` sets, by its field name."""
    if spec.json is not None:
        return "json"
    if spec.regex is not None:
        return "regex"
    if spec.choice is not None:
        return "choice"
    if spec.grammar is not None:
        return "grammar"
    return "json_object"


def build_structured_output_manager(
    tokenizer_folder: str | None, model_info: ModelInfo
) -> StructuredOutputManager | None:
    """The engine's grammar owner over `tokenizer_folder`'s vocabulary or, when that is None,
    the checkpoint folder's (the model's name); None when neither holds a tokenizer.json, and
    constrained requests are refused. ValueError when a named folder cannot be read."""
    folder = tokenizer_folder
    if folder is None:
        if not (Path(model_info.name) / TOKENIZER_FILE).is_file():
            logger.info("no tokenizer.json for %s: structured outputs are off", model_info.name)
            return None
        folder = model_info.name
    vocabulary = read_tokenizer_vocabulary(folder)
    manager = StructuredOutputManager(vocabulary, model_info.vocab_size, model_info.eos_token_ids)
    logger.info(
        "structured outputs: %d tokenizer tokens of %d in the vocabulary, from %s",
        vocabulary.num_tokens,
        model_info.vocab_size,
        folder,
    )
    return manager
