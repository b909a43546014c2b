"""The vLLM 0.33.0 side of bench/scheduler.py: the same workloads through vLLM's own Scheduler.

Runs under the peer interpreter, never imports kvserve, and prints one JSON object as its last
line: microseconds per schedule() plus update_from_output(), the median of the repeats.
"""

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable

MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 512,
    "max_position_embeddings": 8192,
    "torch_dtype": "float32",
}
SAMPLED_TOKEN_ID = 7  # every step samples this; ignore_eos keeps requests going


class VllmBench:
    """One vLLM Scheduler, fed requests and driven with fake runner outputs."""

    def __init__(self, args: argparse.Namespace, model_dir: str) -> None:
        import torch
        from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
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
        spec = FullAttentionSpec(
            block_size=args.block_size, num_kv_heads=2, head_size=16, dtype=torch.float32
        )
        kv_cache_config = KVCacheConfig(
            num_blocks=args.num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)],
        )
        self.scheduler = Scheduler(
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=args.block_size,
            hash_block_size=args.block_size,
            log_stats=False,
        )
        hash_fn = get_hash_fn_by_name("sha256")
        init_none_hash(hash_fn)
        self.block_hasher = get_request_block_hasher(args.block_size, hash_fn)
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

    def num_decoding(self) -> int:
        return sum(1 for request in self.scheduler.running if request.num_output_tokens > 0)


def decode_workload(bench: VllmBench, num_reqs: int, args: argparse.Namespace) -> float:
    rng = random.Random(num_reqs)
    max_tokens = args.steps * args.repeats + 64
    for _ in range(num_reqs):
        bench.add([rng.randrange(1, 512) for _ in range(args.prompt_len)], max_tokens)
    while bench.num_decoding() < num_reqs:
        bench.step()
    return _median_us(bench, args, lambda: None)


def prefill_mix_workload(bench: VllmBench, args: argparse.Namespace) -> tuple[float, int]:
    """µs per step, and the running requests at the end (equal on both sides when in step)."""
    rng = random.Random(12345)

    def arrive() -> None:
        for _ in range(args.mix_arrivals):
            bench.add([rng.randrange(1, 512) for _ in range(args.mix_prompt_len)], 16)

    for _ in range(args.mix_warmup_steps):
        arrive()
        bench.step()
    return _median_us(bench, args, arrive), len(bench.scheduler.running)


def _median_us(bench: VllmBench, args: argparse.Namespace, arrive: Callable[[], None]) -> float:
    windows = []
    for _ in range(args.repeats):
        total_s = 0.0
        for _ in range(args.steps):
            arrive()
            total_s += bench.step()
        windows.append(total_s / args.steps * 1e6)
    return statistics.median(windows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    for name, default in [
        ("--max-num-seqs", 1024),
        ("--max-num-batched-tokens", 8192),
        ("--max-model-len", 4096),
        ("--block-size", 16),
        ("--num-blocks", 40000),
        ("--prompt-len", 32),
        ("--steps", 50),
        ("--repeats", 5),
        ("--mix-arrivals", 10),
        ("--mix-prompt-len", 768),
        ("--mix-warmup-steps", 30),
    ]:
        parser.add_argument(name, type=int, default=default)
    parser.add_argument("--decode-sizes", default="64,256,1024")
    args = parser.parse_args()
    figures = {}
    with tempfile.TemporaryDirectory() as model_dir:
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(MODEL_CONFIG, f)
        for num_reqs in [int(size) for size in args.decode_sizes.split(",")]:
            bench = VllmBench(args, model_dir)
            figures[f"decode_{num_reqs}_us_per_step"] = decode_workload(bench, num_reqs, args)
        mix_us, mix_running = prefill_mix_workload(VllmBench(args, model_dir), args)
        figures["prefill_mix_us_per_step"] = mix_us
        figures["prefill_mix_num_running_reqs"] = mix_running
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
