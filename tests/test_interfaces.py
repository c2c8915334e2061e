"""Both data-parallel strategies provide what the Trainer and the Checkpointer call (engine/interfaces.py):
every method of each Protocol with the same parameters, and its attributes once built."""
import inspect

import pytest

from engine.interfaces import DataParallel, Optimizer
from engine.optim.replicated import MixedPrecisionAdamW
from engine.optim.zero import ZeroAdamW
from parallel.ddp import BucketedDDP
from parallel.fsdp import ShardedDataParallel
from tests.helpers import tiny_trainer


def methods(protocol) -> dict:
    return {name: inspect.signature(f) for name, f in vars(protocol).items()
            if inspect.isfunction(f) and not name.startswith("_")}


@pytest.mark.parametrize("protocol, implementation", [(DataParallel, BucketedDDP),
                                                      (DataParallel, ShardedDataParallel),
                                                      (Optimizer, MixedPrecisionAdamW), (Optimizer, ZeroAdamW)])
def test_implementations_have_every_method_with_its_parameters(protocol, implementation):
    for name, signature in methods(protocol).items():
        assert hasattr(implementation, name), f"{implementation.__name__} lacks {protocol.__name__}.{name}"
        got = list(inspect.signature(getattr(implementation, name)).parameters)
        assert got == list(signature.parameters), f"{implementation.__name__}.{name}{got}"


@pytest.mark.parametrize("stage", [0, 1])
def test_built_optimizers_have_the_protocol_attributes(tmp_path, stage):
    trainer = tiny_trainer(f"run.dir={tmp_path}", "model.num_layers=1", f"parallel.zero_stage={stage}")
    for name in Optimizer.__annotations__:
        assert hasattr(trainer.optimizer, name), f"{type(trainer.optimizer).__name__} lacks {name}"
    trainer.loader.close()
