"""Serving: runs a response's EngineJobs on the pool and shapes OpenAI completion and chat
responses, whole or as server-sent events. Leaving a stream early aborts its engine requests.
"""

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec

from api_server.engine_pool import EnginePool
from api_server.engine_requests import EngineJob, engine_refusal
from api_server.errors import ApiError
from api_server.metrics import TokenLatency
from api_server.tokenizer import ByteTokenizer
from engine_core.client import EngineDeadError
from protocol.client_messages import EngineCoreOutput, FinishReason

SSE_DONE = b"data: [DONE]\n\n"
JSON = msgspec.json.Encoder()


@dataclass(slots=True)
class ChoiceState:
    """What one choice has produced so far."""

    index: int
    num_prompt_tokens: int
    text: list[str] = field(default_factory=list)
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None


@dataclass(slots=True)
class ResponseShape:
    """The fixed fields of one response and how its choices look."""

    response_id: str
    model: str
    is_chat: bool
    created: int = field(default_factory=lambda: int(time.time()))

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

    def choice(self, index: int, text: str, finish_reason: str | None, is_chunk: bool) -> dict:
        if not self.is_chat:
            return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
        key = "delta" if is_chunk else "message"
        message = {"role": "assistant", "content": text} if not is_chunk or text else {}
        return {"index": index, key: message, "logprobs": None, "finish_reason": finish_reason}


def usage(states: list[ChoiceState]) -> dict:
    num_prompt = sum(state.num_prompt_tokens for state in states)
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
        tokenizer: ByteTokenizer,
        model: str,
        token_latency: TokenLatency | None = None,
    ) -> None:
        self.pool = pool
        self.tokenizer = tokenizer
        self.model = model
        self.token_latency = token_latency  # TTFT and inter-token latency, when metrics are on

    async def _outputs(self, job: EngineJob) -> AsyncIterator[EngineCoreOutput]:
        if not self.pool.has_healthy_engine:
            raise ApiError(503, "no engine is serving: retry later", code="engine_unavailable")
        outputs = self.pool.generate(job.request, job.prompt_token_ids, job.num_tokens)
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
        except EngineDeadError as exc:
            raise ApiError(503, str(exc), code="engine_unavailable") from None
        except TimeoutError as exc:  # the engine sent nothing for this request in its timeout
            raise ApiError(504, str(exc), code="engine_timeout") from None

    async def _collect(self, job: EngineJob) -> ChoiceState:
        state = ChoiceState(job.index, len(job.prompt_token_ids))
        detokenizer = self.tokenizer.detokenizer()
        async for output in self._outputs(job):
            state.num_output_tokens += len(output.new_token_ids)
            state.num_cached_tokens = max(state.num_cached_tokens, output.num_cached_tokens)
            state.text.append(detokenizer.push(_visible_ids(output)))
            if output.finish_reason is not None:
                state.finish_reason = str(output.finish_reason)
        state.text.append(detokenizer.finish())
        return state

    async def complete(self, jobs: list[EngineJob], shape: ResponseShape) -> dict:
        """The whole response; an error in one choice cancels (and aborts) the others."""
        if len(jobs) == 1:  # the common case, without a task group
            states = [await self._collect(jobs[0])]
        else:
            states = await self._collect_all(jobs)
        choices = [
            shape.choice(s.index, "".join(s.text), s.finish_reason, is_chunk=False) for s in states
        ]
        response = shape.envelope(choices, is_chunk=False)
        response["usage"] = usage(states)
        return response

    async def _collect_all(self, jobs: list[EngineJob]) -> list[ChoiceState]:
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(self._collect(job)) for job in jobs]
        except BaseExceptionGroup as group_error:  # the first choice's error speaks for all
            raise group_error.exceptions[0] from None
        return [task.result() for task in tasks]

    async def first_outputs(
        self, jobs: list[EngineJob]
    ) -> list[tuple[EngineJob, AsyncIterator[EngineCoreOutput], EngineCoreOutput | None]]:
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
        started: list[tuple[EngineJob, AsyncIterator[EngineCoreOutput], EngineCoreOutput | None]],
        shape: ResponseShape,
        include_usage: bool,
    ) -> AsyncIterator[bytes]:
        """Server-sent events: one chunk per engine output, usage if asked, then [DONE]."""
        states = [ChoiceState(job.index, len(job.prompt_token_ids)) for job, _, _ in started]
        detokenizers = [self.tokenizer.detokenizer() for _ in started]
        if shape.is_chat:
            for state in states:
                first = shape.choice(state.index, "", None, is_chunk=True)
                first["delta"] = {"role": "assistant", "content": ""}
                yield self._event(shape.envelope([first], is_chunk=True))
        try:
            async for position, output in _merged(started):
                state, detokenizer = states[position], detokenizers[position]
                state.num_output_tokens += len(output.new_token_ids)
                state.num_cached_tokens = max(state.num_cached_tokens, output.num_cached_tokens)
                text = detokenizer.push(_visible_ids(output))
                finish_reason = None
                if output.finish_reason is not None:
                    text += detokenizer.finish()
                    finish_reason = str(output.finish_reason)
                choice = shape.choice(state.index, text, finish_reason, is_chunk=True)
                yield self._event(shape.envelope([choice], is_chunk=True))
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


async def _merged(
    started: list[tuple[EngineJob, AsyncIterator[EngineCoreOutput], EngineCoreOutput | None]],
) -> AsyncIterator[tuple[int, EngineCoreOutput]]:
    """(position, output) of every job as they come; leaving early closes (aborts) them all."""
    if len(started) == 1:  # the common case, without a task and a queue per token
        _, outputs, first = started[0]
        async with contextlib.aclosing(outputs):
            if first is not None:
                yield 0, first
            async for output in outputs:
                yield 0, output
        return
    queue: asyncio.Queue[tuple[int, EngineCoreOutput | BaseException | None]] = asyncio.Queue()

    async def pump(position: int, outputs: AsyncIterator[EngineCoreOutput]) -> None:
        try:
            async with contextlib.aclosing(outputs):
                async for output in outputs:
                    await queue.put((position, output))
        except ApiError as exc:
            await queue.put((position, exc))
        await queue.put((position, None))

    for position, (_, _, first) in enumerate(started):
        if first is not None:
            queue.put_nowait((position, first))
    tasks = [asyncio.ensure_future(pump(i, outputs)) for i, (_, outputs, _) in enumerate(started)]
    try:
        num_open = len(tasks)
        while num_open:
            position, item = await queue.get()
            if item is None:
                num_open -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield position, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
