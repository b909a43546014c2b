"""LLM: the offline entry point. It starts an engine and its worker ranks as child processes
(deploy's Deployment, sockets in a private temporary folder), sends every prompt of a batch at
once through the blocking EngineClient, and turns the outputs into text as the HTTP server does.
It opens the client socket; it stops every child on close(), on leaving a `with`, and at exit.
"""

import atexit
import itertools
import logging
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from api_server.openai.engine_requests import bad_words_token_ids
from api_server.openai.generation_config import load_generation_defaults, log_generation_defaults
from api_server.openai.logprobs import prompt_logprobs_json
from api_server.openai.parallel_sampling import choice_seed
from api_server.openai.serving import ChoiceState
from api_server.openai.stop_strings import StopStringMatcher
from api_server.tokenizer.chat_template import TemplateValue
from api_server.tokenizer.prompt_tokenizer import PromptTokenizer, load_tokenizer
from deploy.commands import with_structured_outputs_vocabulary
from deploy.launch import EXIT_OK, Deployment, check_addresses, worker_configs
from engine_client.errors import EngineDeadError
from engine_client.request import make_request
from engine_client.sync_client import EngineClient
from kvserve.engine_args import offline_configs
from kvserve.outputs import CompletionOutput, Logprob, RequestOutput
from kvserve.progress import BatchProgress
from kvserve.prompts import (
    Message,
    Prompt,
    PromptInput,
    normalize_conversations,
    normalize_prompts,
    params_per_prompt,
)
from kvserve.sampling_params import SamplingParams, engine_params, num_choices
from protocol.bounds import checked_copy
from protocol.client_messages import EngineCoreRequest, FinishReason, TokenLogprobs
from protocol.sampling import SamplingParams as EngineSamplingParams

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0  # for the engine and every rank to be serving (a checkpoint loads)
HEALTH_POLL_S = 1.0  # one check_health try while they start
OUTPUT_TIMEOUT_S = 300.0  # the engine must send something for the batch this often
SUPERVISOR_JOIN_MARGIN_S = 15.0  # beyond the engine's drain: the launcher's own join deadlines


def _request_output(
    tokenizer: PromptTokenizer,
    req_ids: list[str],
    prompt: PromptInput,
    prompt_token_ids: list[int],
    states: dict[str, ChoiceState],
    generated: dict[str, list[int]],
) -> RequestOutput:
    """One finished prompt, shaped as vLLM shapes it: one CompletionOutput per choice, in
    choice order, under the first choice's request id."""
    completions = [
        CompletionOutput(
            states[req_id].index,
            "".join(states[req_id].text),
            generated[req_id],
            states[req_id].finish_reason,
        )
        for req_id in req_ids
    ]
    first = states[req_ids[0]].prompt_logprobs  # the same prompt scored for every choice
    prompt_logprobs = None if first is None else _prompt_logprobs(tokenizer, first)
    return RequestOutput(
        req_ids[0], prompt.text, prompt_token_ids, completions, True, prompt_logprobs
    )


def _prompt_logprobs(
    tokenizer: PromptTokenizer, entries: TokenLogprobs
) -> list[dict[int, Logprob] | None]:
    """The server's prompt_logprobs shape, keyed by int ids with vLLM's Logprob values."""
    shaped: list[dict[int, Logprob] | None] = []
    for entry in prompt_logprobs_json(tokenizer, entries):
        if entry is None:
            shaped.append(None)
            continue
        shaped.append(
            {
                int(token_id): Logprob(
                    float(value["logprob"]),  # type: ignore[arg-type]
                    int(value["rank"]),  # type: ignore[call-overload]
                    str(value["decoded_token"]),
                )
                for token_id, value in entry.items()
            }
        )
    return shaped


class LLM:
    """An engine and its ranks serving one model for this process.

    Invariants: while `_deployment` is set, `close` is registered with atexit and the
    supervisor thread (once started) joins the processes; after `close`, no child is alive
    and the private folder is gone.
    """

    def __init__(
        self,
        model: str,
        tensor_parallel_size: int = 1,
        dtype: str = "auto",
        max_model_len: int | None = None,
        seed: int = 0,
        tokenizer: str | None = None,
        log_level: str = "WARNING",
        start_timeout_s: float = START_TIMEOUT_S,
        generation_config: str = "auto",
        **overrides: object,
    ) -> None:
        """Args:
        tokenizer: a folder holding tokenizer.json; default the checkpoint's own (the shipped
            byte-level one for a built-in model).
        generation_config: as `kvserve serve --generation-config`: "auto" takes the
            checkpoint's generation_config.json sampling defaults into
            get_default_sampling_params() (what a call without sampling_params uses), "vllm"
            ignores the file, a folder reads its file.
        overrides: engine, cache, scheduler or worker config fields by name
            (`gpu_memory_utilization=0.5`, `max_num_seqs=64`, `device="cpu"`, ...).
        """
        self._deployment: Deployment | None = None
        self._client: EngineClient | None = None
        self._req_ids = itertools.count()
        self.tokenizer = load_tokenizer(model, tokenizer)
        self.generation_defaults = load_generation_defaults(generation_config, model)
        log_generation_defaults(self.generation_defaults, generation_config)
        # /tmp, not $TMPDIR: a Unix socket's path must stay within 107 bytes
        self._folder = tempfile.TemporaryDirectory(prefix="kvserve-llm-", dir="/tmp")
        try:
            folder = Path(self._folder.name)
            engine_config, base_worker = offline_configs(
                model, tensor_parallel_size, dtype, max_model_len, seed, folder, overrides
            )
            base_worker = check_addresses(engine_config, base_worker)
            engine_config = with_structured_outputs_vocabulary(engine_config, tokenizer, model)
        except BaseException:
            self._folder.cleanup()
            raise
        self.engine_config = engine_config
        self._deployment = Deployment(
            engine_config, worker_configs(engine_config, base_worker), log_level
        )
        self._outcome: list[int] = []  # the supervisor's exit code, once the deployment ended
        self._supervisor = threading.Thread(
            target=self._supervise, name="kvserve-supervisor", daemon=True
        )
        atexit.register(self.close)
        try:
            self._deployment.start()
            self._supervisor.start()
            self._client = EngineClient(engine_config.client_address, OUTPUT_TIMEOUT_S)
            self._wait_until_serving(start_timeout_s)
        except BaseException:
            self.close()
            raise

    def _supervise(self) -> None:
        """As `kvserve launch` does: a failed rank is replaced while restarts remain, and a
        failed engine takes the ranks down (the client then sees EngineDeadError)."""
        assert self._deployment is not None
        self._outcome.append(self._deployment.supervise())

    def _wait_until_serving(self, timeout_s: float) -> None:
        """Until the engine answers check_health; RuntimeError at once when the deployment
        ended instead."""
        assert self._client is not None
        deadline = time.monotonic() + timeout_s
        while True:
            if self._outcome:
                raise RuntimeError(
                    f"the engine or a rank exited while starting (exit code {self._outcome[0]}): "
                    "expected them to serve; their logs are on stderr"
                )
            try:
                if self._client.call_utility("check_health", timeout_s=HEALTH_POLL_S) is True:
                    return
            except TimeoutError:
                pass  # not serving yet
            if time.monotonic() > deadline:
                raise TimeoutError(f"the engine was not serving after {timeout_s} s")

    def get_default_sampling_params(self) -> SamplingParams:
        """The SamplingParams a call without any uses: kvserve's defaults, with the
        generation config's (temperature, top_p, top_k, min_p, repetition_penalty,
        max_new_tokens as max_tokens) over them, as vLLM's LLM gives them."""
        return SamplingParams(**self.generation_defaults.applied())  # type: ignore[arg-type]

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: EngineSamplingParams | Sequence[EngineSamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in prompt order. The prompts are all sent at once,
        so the engine batches them."""
        inputs = normalize_prompts(prompts)
        params = params_per_prompt(self._params_or_default(sampling_params), len(inputs))
        token_ids = [
            self.tokenizer.encode(one.text) if one.token_ids is None else one.token_ids
            for one in inputs
        ]
        return self._run(inputs, token_ids, params, use_tqdm)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: EngineSamplingParams | Sequence[EngineSamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, TemplateValue] | None = None,
    ) -> list[RequestOutput]:
        """Render each conversation with the checkpoint's chat template, then generate; a
        single conversation gives a list of one."""
        conversations = normalize_conversations(messages)
        token_ids = [
            self.tokenizer.render_chat(
                conversation,  # type: ignore[arg-type]
                add_generation_prompt,
                None,
                chat_template_kwargs,
            )
            for conversation in conversations
        ]
        inputs = [
            PromptInput(self.tokenizer.decode(ids, skip_special_tokens=False), None)
            for ids in token_ids
        ]
        params = params_per_prompt(self._params_or_default(sampling_params), len(inputs))
        return self._run(inputs, token_ids, params, use_tqdm)

    def _params_or_default(
        self, params: EngineSamplingParams | Sequence[EngineSamplingParams] | None
    ) -> EngineSamplingParams | Sequence[EngineSamplingParams]:
        return self.get_default_sampling_params() if params is None else params

    def _run(
        self,
        inputs: list[PromptInput],
        token_ids: list[list[int]],
        params: list[EngineSamplingParams],
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        if self._client is None:
            raise RuntimeError("this LLM is closed: expected a new one")
        # a prompt's n choices are n requests sent together (api_server/openai/parallel_sampling.py)
        choices = [
            self._choices(ids, one, idx)
            for idx, (ids, one) in enumerate(zip(token_ids, params, strict=True))
        ]
        requests = [request for prompt_choices in choices for request in prompt_choices]
        states = {
            request.req_id: self._choice_state(ids, one, index)
            for prompt_choices, ids, one in zip(choices, token_ids, params, strict=True)
            for index, request in enumerate(prompt_choices)
        }
        generated: dict[str, list[int]] = {request.req_id: [] for request in requests}
        for request in requests:
            self._client.send(request)  # not add_request: the client need keep no result
        try:
            with BatchProgress(len(requests), use_tqdm) as progress:
                self._collect(states, generated, progress)
        except EngineDeadError:
            raise  # no engine left to abort anything in
        except BaseException:  # an engine error, a timeout, Ctrl-C: the rest of the batch stops
            unfinished = [req_id for req_id, state in states.items() if not state.is_finished]
            if unfinished:
                self._client.abort(unfinished)
            raise
        return [
            _request_output(
                self.tokenizer, [r.req_id for r in prompt_choices], one, ids, states, generated
            )
            for prompt_choices, one, ids in zip(choices, inputs, token_ids, strict=True)
        ]

    def _choices(
        self, token_ids: list[int], params: EngineSamplingParams, idx: int
    ) -> list[EngineCoreRequest]:
        """The requests of prompt `idx`, one per choice, every bound checked before anything
        is sent."""
        if not token_ids:
            raise ValueError(f"prompt {idx}: no tokens: expected at least one")
        overrides: dict[str, object] = {}
        if isinstance(params, SamplingParams) and params.bad_words:
            overrides["bad_words_token_ids"] = bad_words_token_ids(params.bad_words, self.tokenizer)
        try:
            return [
                checked_copy(
                    make_request(
                        str(next(self._req_ids)),
                        token_ids,
                        engine_params(params, seed=choice_seed(params.seed, index), **overrides),
                    )
                )
                for index in range(num_choices(params))
            ]
        except ValueError as exc:  # msgspec.ValidationError is one
            raise ValueError(f"prompt {idx}: {exc}") from None

    def _choice_state(
        self, token_ids: list[int], params: EngineSamplingParams, index: int
    ) -> ChoiceState:
        """What the HTTP server keeps per choice: detokenizer, stop strings, min_tokens."""
        is_offline = isinstance(params, SamplingParams)
        stops = params.stop_strings if is_offline else []
        is_stop_shown = params.include_stop_str_in_output if is_offline else False
        skip_special_tokens = params.skip_special_tokens if is_offline else True
        return ChoiceState(
            index,
            len(token_ids),
            self.tokenizer.detokenizer(skip_special_tokens),
            StopStringMatcher(stops, is_stop_shown),
            params.min_tokens,
        )

    def _collect(
        self,
        states: dict[str, ChoiceState],
        generated: dict[str, list[int]],
        progress: BatchProgress,
    ) -> None:
        """Feed outputs to their choices until every one has finished; a stop string ending a
        choice aborts its request, and an engine error fails the batch."""
        assert self._client is not None
        num_unfinished = len(states)
        while num_unfinished:
            for output in self._client.get_outputs(OUTPUT_TIMEOUT_S):
                state = states.get(output.req_id)
                if state is None or state.is_finished:
                    continue  # an earlier batch's, or past a stop string
                if output.finish_reason == FinishReason.ERROR:
                    raise RuntimeError(f"request {output.req_id} failed: {output.error}")
                generated[output.req_id].extend(output.new_token_ids)
                if state.absorb(output).finish_reason is None:
                    continue
                num_unfinished -= 1
                progress.advance(state.num_output_tokens)
                if output.finish_reason is None:  # a stop string, which the engine cannot see
                    self._client.abort([output.req_id])

    def close(self) -> None:
        """Stop the engine and its ranks (the engine drains, then stops the workers), then
        join, terminate or kill whatever remains. Safe to call twice."""
        if self._deployment is None:
            return
        atexit.unregister(self.close)
        if self._client is not None:
            try:
                self._client.close()
            except EngineDeadError as exc:  # the engine went first: nothing to deliver
                logger.debug("closing the client: %s", exc)
            self._client = None
        deployment, self._deployment = self._deployment, None
        shutdown_s = deployment.engine_config.shutdown_timeout_s + SUPERVISOR_JOIN_MARGIN_S
        if self._supervisor.is_alive():
            if deployment.engine.is_alive():
                deployment.engine.terminate()  # it drains, then stops the ranks
            self._supervisor.join(shutdown_s)
            if self._supervisor.is_alive():
                logger.error("the engine and its ranks did not stop in %.0f s", shutdown_s)
        elif not self._outcome:  # a failed start: stop what did start
            deployment.processes = [p for p in deployment.processes if p.pid is not None]
            deployment.stop()
        self._folder.cleanup()
        if self._outcome and self._outcome[0] != EXIT_OK:
            logger.warning("the engine or a rank exited with code %d", self._outcome[0])

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
