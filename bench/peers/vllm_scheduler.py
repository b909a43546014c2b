"""The vLLM 0.33.0 side of bench/scheduler.py: the same workloads through vLLM's own Scheduler.

Runs under the peer interpreter and never imports kvserve; the workloads come from the stdlib-only
bench/scheduler_workloads.py, as on kvserve's side. Prints one JSON object as its last line:
microseconds per schedule() plus update_from_output(), the median of the repeats.
"""

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

# importable thanks to the path above:
from bench.peers.vllm_kv_cache import one_group_kv_cache_config, sha256_request_block_hasher
from bench.scheduler_workloads import (
    SAMPLED_TOKEN_ID,
    VOCAB_SIZE,
    add_workload_arguments,
    measure_workloads,
)

MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": 8192,
    "torch_dtype": "float32",
}


class VllmBench:
    """One vLLM Scheduler, fed requests and driven with fake runner outputs."""

    def __init__(self, args: argparse.Namespace, model_dir: str) -> None:
        from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        model_config = ModelConfig(
            model=model_dir, skip_tokenizer_init=True, max_model_len=args.max_model_len
        )
        scheduler_config = SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        )
        cache_config = CacheConfig(block_size=args.block_size, enable_prefix_caching=True)
        cache_config.num_gpu_blocks = args.num_blocks  # what profiling would have set
        vllm_config = VllmConfig(
            model_config=model_config, scheduler_config=scheduler_config, cache_config=cache_config
        )
        self.scheduler = Scheduler(
            vllm_config=vllm_config,
            kv_cache_config=one_group_kv_cache_config(args.block_size, args.num_blocks),
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=args.block_size,
            hash_block_size=args.block_size,
            log_stats=False,
        )
        self.block_hasher = sha256_request_block_hasher(args.block_size)
        self.num_added = 0

    def add(self, prompt: list[int], max_tokens: int) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        request = Request(
            request_id=f"req-{self.num_added}",
            prompt_token_ids=prompt,
            sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            pooling_params=None,
            arrival_time=float(self.num_added),
            block_hasher=self.block_hasher,
        )
        self.num_added += 1
        self.scheduler.add_request(request)

    def step(self) -> float:
        """Seconds of schedule() plus update_from_output(); the runner output is not timed."""
        from vllm.v1.outputs import ModelRunnerOutput

        start = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        scheduled_s = time.perf_counter() - start
        requests = self.scheduler.requests
        req_ids = list(scheduler_output.num_scheduled_tokens)
        sampled = [
            [SAMPLED_TOKEN_ID]
            if requests[req_id].num_computed_tokens >= requests[req_id].num_tokens
            else []
            for req_id in req_ids
        ]
        runner_output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={req_id: idx for idx, req_id in enumerate(req_ids)},
            sampled_token_ids=sampled,
        )
        start = time.perf_counter()
        self.scheduler.update_from_output(scheduler_output, runner_output)
        return scheduled_s + time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    add_workload_arguments(parser)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as model_dir:
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(MODEL_CONFIG, f)
        figures = measure_workloads(lambda: VllmBench(args, model_dir), args)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
