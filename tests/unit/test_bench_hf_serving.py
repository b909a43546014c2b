"""The serving benchmark's and the checkpoint maker's choice of architecture and shape: a MoE
architecture gets a shape with experts unless told otherwise, and a shape that does not fit the
architecture is refused before anything is written."""

import pytest

from bench import make_checkpoint
from bench.hf_serving import made_spec, parse_args


def test_the_serving_benchmark_makes_a_bench_shape_of_its_arch() -> None:
    moe = made_spec(parse_args(["--arch", "qwen3-moe"]))
    assert (moe.arch, moe.shape) == ("qwen3-moe", make_checkpoint.SHAPES["bench-moe"])
    dense = made_spec(parse_args([]))
    assert (dense.arch, dense.shape) == ("qwen3", make_checkpoint.SHAPES["bench"])
    tiny = made_spec(parse_args(["--arch", "qwen3-moe", "--shape", "tiny-moe"]))
    assert tiny.shape.num_experts == 8 and tiny.shape.num_experts_per_tok == 2
    with pytest.raises(SystemExit, match="--arch qwen3-moe expects another shape"):
        made_spec(parse_args(["--arch", "qwen3-moe", "--shape", "bench"]))


def test_the_maker_gives_moe_archs_a_shape_with_experts(capsys: pytest.CaptureFixture) -> None:
    _, spec = make_checkpoint.parse_args(["/tmp/unused", "--arch", "mixtral"])
    assert spec.shape == make_checkpoint.SHAPES["tiny-moe"]
    _, spec = make_checkpoint.parse_args(
        ["/tmp/unused", "--arch", "qwen3-moe", "--mlp-only-layers", "0,1"]
    )
    assert spec.mlp_only_layers == (0, 1)
    for argv, reason in [
        (["--arch", "llama", "--shape", "tiny-moe"], "expects a shape without experts"),
        (["--arch", "mixtral", "--shape", "tiny"], "expects a shape with experts"),
        (["--arch", "qwen3-moe", "--mlp-only-layers", "first"], "expected layer numbers"),
    ]:
        with pytest.raises(SystemExit):
            make_checkpoint.parse_args(["/tmp/unused", *argv])
        assert reason in capsys.readouterr().err
