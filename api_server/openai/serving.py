"""Serving: runs a response's EngineJobs on the pool and shapes OpenAI completion and chat
responses (text, stop strings, logprobs, usage), whole or as server-sent events. Leaving a stream
early, or a stop string ending a choice, aborts its engine requests.
"""

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec

from api_server.openai.chat_output import ChatOutputParser
from api_server.openai.engine_requests import EngineJob, engine_refusal
from api_server.openai.errors import ApiError
from api_server.openai.generation_config import NO_DEFAULTS, GenerationDefaults
from api_server.openai.logprobs import ChoiceLogprobs, prompt_logprobs_json
from api_server.openai.stop_strings import StopStringMatcher
from api_server.openai.token_latency import TokenLatency
from api_server.routing import EnginePool
from api_server.tokenizer.prompt_tokenizer import PromptTokenizer, TextDetokenizer
from engine_client.errors import EngineConnectionLost, EngineDeadError, FrameTooLargeError
from protocol.client_messages import EngineCoreOutput, FinishReason, TokenLogprobs

SSE_DONE = b"data: [DONE]\n\n"
JSON = msgspec.json.Encoder()
# Each started job, its outputs, and its first output (None when it ended without one)
Started = list[tuple[EngineJob, AsyncIterator[EngineCoreOutput], EngineCoreOutput | None]]


@dataclass(slots=True)
class ChoicePiece:
    """What one engine output adds to a choice: text, logprobs and, on the last, why it ended."""

    text: str
    logprobs: dict | None
    finish_reason: str | None


@dataclass(slots=True)
class ChoiceState:
    """What one choice has produced so far, and the detokenizer, stop matcher and logprobs
    shaper that turn its engine outputs into text."""

    index: int
    num_prompt_tokens: int
    detokenizer: TextDetokenizer
    stopper: StopStringMatcher
    min_tokens: int = 0  # stop strings are looked for only past this many tokens, as vLLM does
    logprobs: ChoiceLogprobs | None = None
    text: list[str] = field(default_factory=list)
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    chat_output: ChatOutputParser | None = None  # reasoning and tool calls parsed from the text
    # usage counts a prompt once, however many choices (n) it has: false for all but the first
    is_prompt_counted: bool = True
    prompt_logprobs: TokenLogprobs | None = None  # the engine's, from the first output
    # echo with logprobs: the prompt's ids, whose logprobs lead the output's; None otherwise
    echo_prompt_ids: list[int] | None = None

    def absorb(self, output: EngineCoreOutput) -> ChoicePiece:
        """The piece this output adds; a stop string found in it ends the choice ("stop")."""
        self.num_output_tokens += len(output.new_token_ids)
        self.num_cached_tokens = max(self.num_cached_tokens, output.num_cached_tokens)
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = output.prompt_logprobs
        text = self.detokenizer.push(_visible_ids(output))
        if output.finish_reason is not None:
            text += self.detokenizer.finish()
        can_stop = self.num_output_tokens > self.min_tokens
        match = self.stopper.push(text, can_stop)
        text = match.text
        finish_reason = "stop" if match.is_stopped else None
        if output.finish_reason is not None and not match.is_stopped:
            text += self.stopper.finish()
            finish_reason = str(output.finish_reason)
        fragment = None
        if self.logprobs is not None and output.new_logprobs is not None:
            fragment = self.logprobs.push(output.new_logprobs)
        self.text.append(text)
        if finish_reason is not None:
            self.finish_reason = finish_reason
        return ChoicePiece(text, fragment, finish_reason)

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class ResponseShape:
    """The fixed fields of one response and how its choices look."""

    response_id: str
    model: str
    is_chat: bool
    created: int = field(default_factory=lambda: int(time.time()))
    has_usage_per_chunk: bool = False  # vLLM's continuous_usage_stats: usage on every chunk

    @property
    def object_name(self) -> str:
        return "chat.completion" if self.is_chat else "text_completion"

    def envelope(self, choices: list[dict], is_chunk: bool) -> dict:
        name = "chat.completion.chunk" if self.is_chat and is_chunk else self.object_name
        return {
            "id": self.response_id,
            "object": name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def choice(
        self,
        index: int,
        text: str,
        finish_reason: str | None,
        is_chunk: bool,
        logprobs: dict | None = None,
        message: dict | None = None,
    ) -> dict:
        """One choice; a chat's `message` (or delta), when given, replaces the plain text's."""
        if not self.is_chat:
            return {
                "index": index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
        key = "delta" if is_chunk else "message"
        if message is None:
            message = {"role": "assistant", "content": text} if not is_chunk or text else {}
        return {"index": index, key: message, "logprobs": logprobs, "finish_reason": finish_reason}


def _whole_choice(shape: ResponseShape, state: ChoiceState) -> dict:
    text = "".join(state.text)
    logprobs = _whole_logprobs(state)
    parser, finish_reason = state.chat_output, state.finish_reason
    if parser is None:
        return shape.choice(state.index, text, finish_reason, is_chunk=False, logprobs=logprobs)
    message = parser.message(text)
    if finish_reason is not None:
        finish_reason = parser.finish_reason(finish_reason)
    return shape.choice(state.index, text, finish_reason, False, logprobs, message)


def _whole_logprobs(state: ChoiceState) -> dict | None:
    """A choice's logprobs; led by its prompt's when it echoes the prompt with logprobs."""
    if state.logprobs is None:
        return None
    if state.echo_prompt_ids is None or state.prompt_logprobs is None:
        return state.logprobs.whole()
    return state.logprobs.whole_after_prompt(state.echo_prompt_ids, state.prompt_logprobs)


def _chunk_choice(shape: ResponseShape, state: ChoiceState, piece: ChoicePiece) -> dict:
    parser, finish_reason = state.chat_output, piece.finish_reason
    if parser is None:
        return shape.choice(state.index, piece.text, finish_reason, True, piece.logprobs)
    delta = parser.delta(piece.text, is_last=finish_reason is not None)
    if finish_reason is not None:
        finish_reason = parser.finish_reason(finish_reason)
    return shape.choice(state.index, piece.text, finish_reason, True, piece.logprobs, delta)


def usage(states: list[ChoiceState]) -> dict:
    """OpenAI's usage: each prompt counted once, every choice's output; cached_tokens sums what
    each choice read from the prefix cache (with n > 1, the prompt blocks the first computed)."""
    num_prompt = sum(state.num_prompt_tokens for state in states if state.is_prompt_counted)
    num_output = sum(state.num_output_tokens for state in states)
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_output,
        "total_tokens": num_prompt + num_output,
        "prompt_tokens_details": {"cached_tokens": sum(s.num_cached_tokens for s in states)},
    }


def _visible_ids(output: EngineCoreOutput) -> list[int]:
    """The ids whose text a client sees: a stop token (EOS or a stop id) counts, but has none."""
    if output.finish_reason == FinishReason.STOP and output.new_token_ids:
        return output.new_token_ids[:-1]
    return output.new_token_ids


class Serving:
    """Runs responses for the routes: the pool, the tokenizer and the served model's name."""

    def __init__(
        self,
        pool: EnginePool,
        tokenizer: PromptTokenizer,
        model: str,
        token_latency: TokenLatency | None = None,
        generation_defaults: GenerationDefaults = NO_DEFAULTS,  # --generation-config's
    ) -> None:
        self.pool = pool
        self.tokenizer = tokenizer
        self.model = model
        self.token_latency = token_latency  # TTFT and inter-token latency, when metrics are on
        self.generation_defaults = generation_defaults  # for the fields a request leaves unset

    async def _outputs(self, job: EngineJob) -> AsyncIterator[EngineCoreOutput]:
        if not self.pool.has_healthy_engine:
            raise ApiError(503, "no engine is serving: retry later", code="engine_unavailable")
        outputs = self.pool.generate(job.request, job.prompt_token_ids, job.num_tokens, job.group)
        latency, last_s = self.token_latency, time.monotonic()
        is_first = True
        try:
            async with contextlib.aclosing(outputs):
                async for output in outputs:
                    if output.finish_reason == FinishReason.ERROR:
                        raise engine_refusal(output.error)
                    if latency is not None and output.new_token_ids:
                        now_s = time.monotonic()
                        (latency.ttft if is_first else latency.itl).observe(now_s - last_s)
                        last_s, is_first = now_s, False
                    yield output
        except FrameTooLargeError as exc:  # the length check let it by: max_model_len unknown
            raise ApiError(400, str(exc), param="prompt") from None
        except EngineConnectionLost as exc:  # this request only: the client reconnects
            raise ApiError(503, str(exc), code="engine_connection_lost") from None
        except EngineDeadError as exc:
            raise ApiError(503, str(exc), code="engine_unavailable") from None
        except TimeoutError as exc:  # the engine sent nothing for this request in its timeout
            raise ApiError(504, str(exc), code="engine_timeout") from None

    def _choice_state(self, job: EngineJob, is_chat: bool) -> ChoiceState:
        logprobs = None
        if job.num_logprobs is not None:
            logprobs = ChoiceLogprobs(self.tokenizer, is_chat, job.num_logprobs)
        state = ChoiceState(
            job.index,
            len(job.prompt_token_ids),
            self.tokenizer.detokenizer(job.skip_special_tokens),
            StopStringMatcher(job.stops, job.is_stop_shown),
            job.request.sampling_params.min_tokens,
            logprobs,
            is_prompt_counted=job.is_prompt_counted,
            echo_prompt_ids=job.prompt_token_ids if job.is_echo_scored else None,
        )
        if job.echo_text:
            state.text.append(job.echo_text)
        if is_chat and job.output_plan is not None:
            state.chat_output = job.output_plan.parser()
        return state

    async def _collect(self, job: EngineJob, is_chat: bool) -> ChoiceState:
        state = self._choice_state(job, is_chat)
        # aclosing: a stop string ends the loop early, and closing the outputs aborts the request
        async with contextlib.aclosing(self._outputs(job)) as outputs:
            async for output in outputs:
                if state.absorb(output).finish_reason is not None:
                    break
        return state

    async def complete(self, jobs: list[EngineJob], shape: ResponseShape) -> dict:
        """The whole response; an error in one choice cancels (and aborts) the others."""
        if len(jobs) == 1:  # the common case, without a task group
            states = [await self._collect(jobs[0], shape.is_chat)]
        else:
            states = await self._collect_all(jobs, shape.is_chat)
        choices = [_whole_choice(shape, s) for s in states]
        response = shape.envelope(choices, is_chunk=False)
        response["usage"] = usage(states)
        if jobs[0].has_prompt_logprobs:  # vLLM's places: per choice, or the chat's response
            shaped = [self._prompt_logprobs(state) for state in states]
            if shape.is_chat:
                response["prompt_logprobs"] = shaped[0]
            else:
                for choice, prompt_logprobs in zip(choices, shaped, strict=True):
                    choice["prompt_logprobs"] = prompt_logprobs
        return response

    def _prompt_logprobs(self, state: ChoiceState) -> list | None:
        """The choice's prompt logprobs in vLLM's shape; None when the engine sent none (the
        choice ended before its first token)."""
        if state.prompt_logprobs is None:
            return None
        return prompt_logprobs_json(self.tokenizer, state.prompt_logprobs)

    async def _collect_all(self, jobs: list[EngineJob], is_chat: bool) -> list[ChoiceState]:
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(self._collect(job, is_chat)) for job in jobs]
        except BaseExceptionGroup as group_error:  # the first choice's error speaks for all
            raise group_error.exceptions[0] from None
        return [task.result() for task in tasks]

    async def first_outputs(self, jobs: list[EngineJob]) -> Started:
        """Start every job and wait for its first output, so a refusal is still an HTTP error
        before the stream's 200 is sent."""
        generators = [self._outputs(job) for job in jobs]
        try:
            firsts = await asyncio.gather(
                *(anext(outputs, None) for outputs in generators), return_exceptions=True
            )
        except BaseException:  # cancelled: the client left before any output
            for outputs in generators:
                await outputs.aclose()
            raise
        errors = [first for first in firsts if isinstance(first, BaseException)]
        if errors:
            for outputs in generators:
                await outputs.aclose()
            raise errors[0]
        return list(zip(jobs, generators, firsts, strict=True))  # type: ignore[arg-type]

    async def stream(
        self,
        started: Started,
        shape: ResponseShape,
        include_usage: bool,
    ) -> AsyncIterator[bytes]:
        """Server-sent events: one chunk per engine output, usage if asked, then [DONE]."""
        states = [self._choice_state(job, shape.is_chat) for job, _, _ in started]
        for job, _, _ in started:
            if job.echo_text:  # the prompt, before the choice's first output
                echoed = shape.choice(job.index, job.echo_text, None, is_chunk=True)
                yield self._event(shape.envelope([echoed], is_chunk=True))
        if shape.is_chat:
            for state in states:
                first = shape.choice(state.index, "", None, is_chunk=True)
                first["delta"] = {"role": "assistant", "content": ""}
                yield self._event(shape.envelope([first], is_chunk=True))
        merged = MergedOutputs(started)
        try:
            async with contextlib.aclosing(merged.outputs()) as outputs:
                async for position, output in outputs:
                    state = states[position]
                    if state.is_finished:
                        continue  # stopped by a stop string: what its engine sent since is unseen
                    piece = state.absorb(output)
                    if piece.finish_reason is not None and output.finish_reason is None:
                        await merged.close_one(position)  # a stop string: abort its request
                    choice = _chunk_choice(shape, state, piece)
                    chunk = shape.envelope([choice], is_chunk=True)
                    if shape.has_usage_per_chunk:
                        chunk["usage"] = usage(states)
                    yield self._event(chunk)
                    if all(state.is_finished for state in states):
                        break
        except ApiError as exc:
            yield self._event(exc.body())
            yield SSE_DONE
            return
        if include_usage:
            final = shape.envelope([], is_chunk=True)
            final["usage"] = usage(states)
            yield self._event(final)
        yield SSE_DONE

    @staticmethod
    def _event(payload: dict) -> bytes:
        return b"data: " + JSON.encode(payload) + b"\n\n"


class MergedOutputs:
    """The (position, output) of every started job as they come. Closing the iterator closes
    (aborts) every job; `close_one` closes one whose choice a stop string ended."""

    def __init__(self, started: Started) -> None:
        self.started = started
        self._tasks: list[asyncio.Future[None]] = []

    async def close_one(self, position: int) -> None:
        if len(self.started) == 1:
            await self.started[0][1].aclose()  # type: ignore[attr-defined]
            return
        task = self._tasks[position]
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    async def outputs(self) -> AsyncIterator[tuple[int, EngineCoreOutput]]:
        if len(self.started) == 1:  # the common case, without a task and a queue per token
            _, outputs, first = self.started[0]
            async with contextlib.aclosing(outputs):  # type: ignore[type-var]
                if first is not None:
                    yield 0, first
                async for output in outputs:
                    yield 0, output
            return
        queue: asyncio.Queue[tuple[int, EngineCoreOutput | BaseException | None]] = asyncio.Queue()

        async def pump(position: int, outputs: AsyncIterator[EngineCoreOutput]) -> None:
            try:
                async with contextlib.aclosing(outputs):  # type: ignore[type-var]
                    async for output in outputs:
                        await queue.put((position, output))
            except ApiError as exc:
                await queue.put((position, exc))
            finally:  # a job closed by close_one ends here too
                queue.put_nowait((position, None))

        for position, (_, _, first) in enumerate(self.started):
            if first is not None:
                queue.put_nowait((position, first))
        self._tasks = [
            asyncio.ensure_future(pump(i, outputs))
            for i, (_, outputs, _) in enumerate(self.started)
        ]
        try:
            num_open = len(self._tasks)
            while num_open:
                position, item = await queue.get()
                if item is None:
                    num_open -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield position, item
        finally:
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
