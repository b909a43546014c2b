"""The KV layout a P/D pair must agree on names the model's weights, not only its name: a
checkpoint's config and weight files, a built-in model's seed (model_fingerprint). Two engines
serving different weights under one name are refused, the field named."""

from pathlib import Path

from protocol.kv_cache_spec import KVCacheConfig
from protocol.kv_transfer import kv_transfer_layout
from tests.unit.hf_checkpoints import write_checkpoint
from worker.kv_transfer import model_fingerprint
from worker.models.registry import get_model_info


def test_a_built_in_model_is_told_apart_by_its_seed() -> None:
    assert model_fingerprint("tiny-llama", 0) == model_fingerprint("tiny-llama", 0)
    assert model_fingerprint("tiny-llama", 0) != model_fingerprint("tiny-llama", 1)
    assert model_fingerprint("tiny-llama", 0) != model_fingerprint("checksum", 0)


def test_a_checkpoint_is_told_apart_by_its_config_and_weights(tmp_path: Path) -> None:
    folders = {name: tmp_path / name for name in ("first", "copy", "deeper", "tuned")}
    write_checkpoint(folders["first"], "llama")
    write_checkpoint(folders["copy"], "llama")  # another folder, the same files
    write_checkpoint(folders["deeper"], "llama", num_hidden_layers=3)
    write_checkpoint(folders["tuned"], "llama", seed=1)  # the same config, other weights
    prints = {name: model_fingerprint(str(folder), 0) for name, folder in folders.items()}
    assert model_fingerprint(str(folders["first"]), 7) == prints["first"]  # the seed is unused
    assert prints["copy"] == prints["first"]
    assert prints["deeper"] != prints["first"] and prints["tuned"] != prints["first"]


def test_a_pair_serving_different_weights_is_refused_naming_the_field() -> None:
    info = get_model_info("tiny-llama", 16)
    config = KVCacheConfig(8, info.kv_cache_groups)
    mine = kv_transfer_layout(info.name, config, 1, model_fingerprint(info.name, 0))
    theirs = kv_transfer_layout(info.name, config, 1, model_fingerprint(info.name, 1))
    assert mine.mismatch(mine) is None
    mismatch = mine.mismatch(theirs)
    assert mismatch is not None and mismatch.startswith("model_fingerprint: ")
