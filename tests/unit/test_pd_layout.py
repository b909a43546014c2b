"""The KV layout a P/D pair must agree on names the model's weights, not only its name: a
checkpoint's config and weight files, a built-in model's seed (model_fingerprint). Two engines
serving different weights under one name are refused, the field named."""

import shutil
from pathlib import Path

from protocol.kv_cache_spec import KVCacheConfig
from protocol.kv_transfer import kv_transfer_layout
from tests.unit.hf_checkpoints import write_checkpoint
from worker.kv_transfer import model_fingerprint
from worker.models.hf.checkpoint import INDEX_FILE
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


def test_a_checkpoint_is_fingerprinted_by_the_files_its_weights_load_from(tmp_path: Path) -> None:
    """Files the loader never reads (a training_args.bin, another export beside
    model.safetensors, a shard the index does not name) do not tell two hosts' copies of one
    checkpoint apart: a pair serving the same weights is never refused over them."""
    plain, extra = tmp_path / "plain", tmp_path / "extra"
    write_checkpoint(plain, "llama")
    shutil.copytree(plain, extra)
    (extra / "training_args.bin").write_bytes(b"not weights")
    shutil.copy(extra / "model.safetensors", extra / "consolidated.safetensors")
    assert model_fingerprint(str(extra), 0) == model_fingerprint(str(plain), 0)
    sharded, stray = tmp_path / "sharded", tmp_path / "stray"
    write_checkpoint(sharded, "llama", max_shard_size="20KB")
    assert (sharded / INDEX_FILE).is_file()
    shutil.copytree(sharded, stray)
    (stray / "model-99999-of-99999.safetensors").write_bytes(b"an unindexed leftover")
    assert model_fingerprint(str(stray), 0) == model_fingerprint(str(sharded), 0)


def test_copies_of_one_checkpoint_under_other_paths_pair(tmp_path: Path) -> None:
    """The layout names a checkpoint by its folder's name, not its path: hosts that mount one
    checkpoint at different paths pair (the fingerprint tells weights apart)."""
    write_checkpoint(tmp_path / "a" / "llama", "llama")
    shutil.copytree(tmp_path / "a" / "llama", tmp_path / "b" / "llama")
    layouts = []
    for path in (str(tmp_path / "a" / "llama"), str(tmp_path / "b" / "llama") + "/"):
        info = get_model_info(path, 16)
        config = KVCacheConfig(8, info.kv_cache_groups)
        layouts.append(kv_transfer_layout(info.name, config, 1, model_fingerprint(path, 0)))
    assert layouts[0].mismatch(layouts[1]) is None
    assert layouts[0].model == "llama"


def test_a_pair_serving_different_weights_is_refused_naming_the_field() -> None:
    info = get_model_info("tiny-llama", 16)
    config = KVCacheConfig(8, info.kv_cache_groups)
    mine = kv_transfer_layout(info.name, config, 1, model_fingerprint(info.name, 0))
    theirs = kv_transfer_layout(info.name, config, 1, model_fingerprint(info.name, 1))
    assert mine.mismatch(mine) is None
    mismatch = mine.mismatch(theirs)
    assert mismatch is not None and mismatch.startswith("model_fingerprint: ")
