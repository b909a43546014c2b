"""Per-layer time of the native CPU decode kernel (`auto` on the CPU) against `blocks`, measured
in the same run: one layer of a 16-row decode step, about 290 tokens of context each, SmolLM2's
9 query and 3 KV heads of 64, block size 16, 2 threads, in bfloat16 and float32.

Rounds interleave the backends (A B A B ...) so a drift of the host lands on both; each figure
is the median over rounds of the mean time of `--calls` consecutive `attend` calls, and each
ratio the median of the per-round ratios. `--old-kernel REV` also times the `auto` backend as of
git revision REV (its native_cpu.py and paged_decode.cpp, built under its own cache key) as a
third backend, for new / old.

    python -m bench.native_attention [--old-kernel REV] [--json FILE]
"""

import importlib.util
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench.report import base_parser, report
from protocol.kv_cache_spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, cdiv
from worker.attention import PagedKV, StepLayout
from worker.attention_backends.block_gather import BlockGatherAttention
from worker.attention_backends.native_build import SOURCE
from worker.attention_backends.native_cpu import NativeCPUAttention
from worker.block_table import MultiGroupBlockTable
from worker.kv_cache import allocate_kv_caches

NUM_ROWS = 16
CONTEXT_TOKENS = (280, 300)  # each row's context, drawn in this range
NUM_HEADS = 9
NUM_KV_HEADS = 3
HEAD_DIM = 64
BLOCK_SIZE = 16
NUM_THREADS = 2
LAYER = "layer.0"
DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32}


def decode_step(dtype: torch.dtype) -> tuple[PagedKV, torch.Tensor]:
    """One layer's paged cache, filled with random context on shuffled blocks, and a decode
    step's queries: every row attends its whole context plus its own new token."""
    rng = random.Random(0)
    contexts = [rng.randint(*CONTEXT_TOKENS) for _ in range(NUM_ROWS)]
    num_blocks = 1 + sum(cdiv(n + 1, BLOCK_SIZE) for n in contexts)
    spec = FullAttentionSpec(BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, "float32")
    config = KVCacheConfig(num_blocks, [KVCacheGroupSpec([LAYER], spec)])
    max_model_len = CONTEXT_TOKENS[1] + BLOCK_SIZE
    tables = MultiGroupBlockTable(NUM_ROWS, max_model_len, [BLOCK_SIZE])
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    for row, context in enumerate(contexts):
        tables.add_row(([free.pop() for _ in range(cdiv(context + 1, BLOCK_SIZE))],), row)
    layout = StepLayout(
        rows=np.arange(NUM_ROWS),
        first_positions=np.array(contexts),
        num_queries=np.ones(NUM_ROWS, dtype=np.int64),
        token_offsets=np.arange(NUM_ROWS),
        logits_reqs=np.arange(NUM_ROWS),
        num_prompt_tokens=np.array(contexts) + 1,
    )
    generator = torch.Generator().manual_seed(0)
    kv_caches = allocate_kv_caches(config, 1, torch.device("cpu"))
    kv_caches = {
        name: torch.randn(cache.shape, generator=generator).to(dtype)
        for name, cache in kv_caches.items()
    }
    paged = PagedKV(kv_caches, config, tables, layout, torch.device("cpu"))
    q = torch.randn(NUM_ROWS, NUM_HEADS, HEAD_DIM, generator=generator).to(dtype)
    return paged, q


def old_kernel(revision: str):
    """NativeCPUAttention as of git `revision`: its native_cpu.py, native_build.py and
    paged_decode.cpp (built under its own cache key), so a change of the kernel's arguments
    compares too."""
    root = Path(__file__).resolve().parents[1]
    directory = Path(tempfile.mkdtemp(prefix="kvserve-old-kernel-"))
    (directory / "native").mkdir()
    backends = SOURCE.parents[1].relative_to(root)  # worker/attention_backends
    native_files = _git(root, "ls-tree", "--name-only", f"{revision}:{backends}/native").split()
    for relative in ("native_build.py", "native_cpu.py", *(f"native/{n}" for n in native_files)):
        (directory / relative).write_text(_git(root, "show", f"{revision}:{backends}/{relative}"))
    build, attention = (
        _module(f"old_{name}", directory / f"{name}.py") for name in ("native_build", "native_cpu")
    )
    if build.load_native() is None:
        raise SystemExit(f"the kernel of {revision} did not build")
    attention.load_native = build.load_native
    return attention.NativeCPUAttention


def _git(root: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], capture_output=True, text=True, check=True, cwd=root
    ).stdout


def _module(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def time_per_call_ms(attention, q: torch.Tensor, calls: int) -> float:
    scale = HEAD_DIM**-0.5
    start = time.perf_counter()
    for _ in range(calls):
        attention.attend(LAYER, q, scale, False)
    return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
    parser = base_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (at least 3)")
    parser.add_argument("--calls", type=int, default=200, help="attend calls timed per figure")
    parser.add_argument("--old-kernel", metavar="REV", help="also time paged_decode.cpp of REV")
    args = parser.parse_args()
    torch.set_num_threads(NUM_THREADS)
    backends = {"native": NativeCPUAttention, "blocks": BlockGatherAttention}
    if args.old_kernel:
        backends["old_native"] = old_kernel(args.old_kernel)
    figures: dict[str, float | int | str | list[float]] = {}
    for dtype_name, dtype in DTYPES.items():
        paged, q = decode_step(dtype)
        attentions = {name: backend(paged) for name, backend in backends.items()}
        scale = HEAD_DIM**-0.5
        outputs = {name: a.attend(LAYER, q, scale, False) for name, a in attentions.items()}
        for name, output in outputs.items():  # a fast wrong kernel is not a result
            torch.testing.assert_close(output, outputs["blocks"], rtol=2e-2, atol=2e-2, msg=name)
        times: dict[str, list[float]] = {name: [] for name in attentions}
        for _ in range(max(args.rounds, 3)):
            for name, attention in attentions.items():
                times[name].append(time_per_call_ms(attention, q, args.calls))
        for name, values in times.items():
            figures[f"{dtype_name}_{name}_ms_per_layer"] = statistics.median(values)
        pairs = [("native", "blocks")] + ([("native", "old_native")] if args.old_kernel else [])
        for new, old in pairs:
            per_round = [a / b for a, b in zip(times[new], times[old], strict=True)]
            figures[f"ratio_{dtype_name}_{new}_to_{old}"] = statistics.median(per_round)
            figures[f"rounds_ratio_{dtype_name}_{new}_to_{old}"] = per_round
    figures["threads"] = NUM_THREADS
    if args.old_kernel:
        figures["old_kernel"] = args.old_kernel
    report("native CPU decode attention, one layer (ms)", figures, args.json)


if __name__ == "__main__":
    main()
