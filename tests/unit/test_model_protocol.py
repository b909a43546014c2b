"""Every model a rank can run is a Model (worker/models/model.py): each built-in name and a
checkpoint's decoder have what the worker, the profiling step and the ModelRunner read of one.
"""

from pathlib import Path

import pytest
import torch

from tests.unit.hf_checkpoints import write_checkpoint
from worker.distributed import single_rank_group
from worker.models.hf.decoder import HFDecoder
from worker.models.model import Model
from worker.models.names import MODEL_NAMES
from worker.models.registry import build_model, get_model_info

CPU = torch.device("cpu")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_each_built_in_model_is_a_model(name: str) -> None:
    model = build_model(name, single_rank_group(), CPU)
    assert isinstance(model, Model)
    model.check_invariants()
    assert model.vocab_size == get_model_info(name, block_size=4).vocab_size


def test_a_checkpoint_decoder_is_a_model(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, "qwen3")
    model = build_model(str(tmp_path), single_rank_group(), CPU)
    assert isinstance(model, HFDecoder)
    assert isinstance(model, Model)
    model.check_invariants()
    assert model.vocab_size == get_model_info(str(tmp_path), block_size=4).vocab_size


def test_an_object_without_check_invariants_is_not_a_model() -> None:
    """The check above has teeth: a model missing one member of the protocol fails it."""

    class NoInvariants:
        vocab_size = 8

        def forward(self, *args: object) -> torch.Tensor:
            return torch.zeros((1, 8))

    assert not isinstance(NoInvariants(), Model)
