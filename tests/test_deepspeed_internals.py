"""The private DeepSpeed names bert_ds relies on (all in ``bert_ds/deepspeed_internals.py``) exist on the
installed DeepSpeed, read from its class sources without starting ranks; and an unsupported version is refused."""

from __future__ import annotations

import inspect
import re

import deepspeed
import pytest
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

from bert_ds import deepspeed_internals as dsi
from bert_ds.errors import BadInput


def class_source(cls: type) -> str:
    """Source of ``cls`` and its DeepSpeed base classes (attributes may be set in a base ``__init__``)."""
    return "\n".join(inspect.getsource(c) for c in cls.__mro__ if c.__module__.startswith("deepspeed"))


def assigns(source: str, attr: str) -> bool:
    return re.search(rf"\bself\.{attr}\s*(:[^=\n]*)?=(?!=)", source) is not None


@pytest.mark.parametrize("attr", dsi.ZERO_OPTIMIZER_ATTRIBUTES)
def test_zero_optimizer_sets_attribute(attr):
    assert assigns(class_source(DeepSpeedZeroOptimizer), attr), (
        f"DeepSpeedZeroOptimizer of deepspeed {deepspeed.__version__} no longer sets self.{attr}; "
        f"update bert_ds/deepspeed_internals.py")


@pytest.mark.parametrize("attr", dsi.ZERO3_OPTIMIZER_ATTRIBUTES)
def test_zero3_optimizer_sets_attribute(attr):
    assert assigns(class_source(DeepSpeedZeroOptimizer_Stage3), attr)
    assert not assigns(class_source(DeepSpeedZeroOptimizer), attr)  # it tells stage 3 apart from stage 1/2


@pytest.mark.parametrize("name", sorted(dsi.ZERO_OPTIMIZER_METHODS))
def test_zero_optimizer_method_signature(name):
    method = getattr(DeepSpeedZeroOptimizer, name, None)
    assert callable(method), f"DeepSpeedZeroOptimizer of deepspeed {deepspeed.__version__} has no {name}()"
    params = list(inspect.signature(method).parameters.values())[1:]  # after self
    expected = dsi.ZERO_OPTIMIZER_METHODS[name]
    assert tuple(p.name for p in params[:len(expected)]) == expected
    assert all(p.default is not inspect.Parameter.empty for p in params[len(expected):]), (
        f"{name}{inspect.signature(method)} needs more arguments than bert_ds passes")


def test_zero_checkpoint_keys_are_deepspeeds():
    from deepspeed.checkpoint import constants

    assert dsi.ZERO_CHECKPOINT_KEYS == (constants.OPTIMIZER_STATE_DICT, constants.BASE_OPTIMIZER_STATE)


def test_zero_clip_norm_accumulates_in_fp64():
    """Stage parity of the clip (bert_ds/optim/clip.py) relies on ZeRO 1/2 taking gradient norms in fp64 on CPU."""
    import torch
    from deepspeed.runtime.zero.utils import get_norm_dtype

    assert get_norm_dtype() == torch.float64
    assert "get_norm_dtype()" in inspect.getsource(DeepSpeedZeroOptimizer.get_grad_norm_direct)


def test_installed_version_is_supported():
    assert dsi.check_deepspeed_version() == deepspeed.__version__


@pytest.mark.parametrize("version", ["0.18.9", "0.20.0", "1.0.0", "not-a-version"])
def test_unsupported_version_is_refused(monkeypatch, version):
    monkeypatch.setattr(deepspeed, "__version__", version)
    with pytest.raises(BadInput, match=re.escape(f"deepspeed {version} is installed")) as info:
        dsi.check_deepspeed_version()
    assert ">=0.19,<0.20" in str(info.value)


def test_build_engine_checks_the_version_first(monkeypatch):
    from bert_ds.runtime.engine import build_engine

    monkeypatch.setattr(deepspeed, "__version__", "0.16.0")
    with pytest.raises(ValueError, match="deepspeed 0.16.0 is installed"):
        build_engine(recipe=None, phase_index=0, model=None, world_size=1)


def test_the_moot_warnings_are_still_raised_by_deepspeed_and_only_they_are_silenced(caplog):
    """Each silenced message is still in the installed DeepSpeed's source (so the filter is not silently stale), and
    after ``quiet_moot_warnings`` exactly those are dropped: another DeepSpeed warning and another FutureWarning still
    show."""
    import logging
    import warnings

    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.utils import logger

    source = inspect.getsource(DeepSpeedEngine._do_optimizer_sanity_check)
    assert all(text in source for text in dsi.MOOT_LOG_MESSAGES), "DeepSpeed no longer logs it: drop the filter"
    dsi.quiet_moot_warnings()
    dsi.quiet_moot_warnings()  # idempotent: one filter
    assert sum(isinstance(f, dsi._DropMessages) for f in logger.filters) == 1
    logger.propagate, was = True, logger.propagate
    try:
        with caplog.at_level(logging.WARNING, logger=logger.name):
            logger.warning("**** You are using ZeRO with an untested optimizer, proceed with caution *****")
            logger.warning("a DeepSpeed warning that matters")
    finally:
        logger.propagate = was
    assert {r.getMessage() for r in caplog.records} == {"a DeepSpeed warning that matters"}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        dsi.quiet_moot_warnings()
        warnings.warn("`torch.distributed.all_gather_into_tensor` is deprecated. Please use ...", FutureWarning,
                      stacklevel=1)
        warnings.warn("another deprecation", FutureWarning, stacklevel=1)
    assert [str(w.message) for w in seen] == ["another deprecation"]


def test_the_file_names_class_names_and_modules_are_deepspeeds():
    """Each DeepSpeed fact other bert_ds modules take from here is what the installed DeepSpeed has."""
    import importlib.util
    from pathlib import Path

    from deepspeed.runtime.engine import DeepSpeedEngine

    from bert_ds.safe_load import _resolve_global

    names = inspect.getsource(DeepSpeedEngine._get_ckpt_name)
    assert '"mp_rank_" + mp_rank_str + "_model_states.pt"' in names
    assert dsi.MODEL_STATES_NAME == "mp_rank_00_model_states.pt"
    zero = inspect.getsource(DeepSpeedEngine._get_zero_ckpt_prefix) + inspect.getsource(
        DeepSpeedEngine._get_rank_zero_ckpt_name)
    assert "bf16_" in zero and "zero_pp_rank_" in zero and "_optim_states.pt" in zero
    assert dsi.ZERO_PARTITION_FILE.match("bf16_zero_pp_rank_3_mp_rank_00_optim_states.pt").group(1) == "3"
    assert dsi.ZERO_PARTITION_FILE.match("zero_pp_rank_0_mp_rank_00_optim_states.pt")
    assert not dsi.ZERO_PARTITION_FILE.match("mp_rank_00_model_states.pt")
    assert dsi.ZERO_OPTIMIZER_CLASS == DeepSpeedZeroOptimizer.__name__
    assert isinstance(getattr(DeepSpeedZeroOptimizer, dsi.LOSS_SCALE_ATTRIBUTE), property)
    for name in dsi.PICKLED_CLASSES:
        assert _resolve_global(name).__name__ == name.rsplit(".", 1)[1], name
    assert importlib.util.find_spec(dsi.LAUNCH_MODULE) is not None
    shm = Path(deepspeed.__file__).parent / "ops" / "csrc" / "cpu" / "comm" / "shm.cpp"
    assert f'#define SHM_BUFFER_NAME "{dsi.SHM_BUFFER_GLOB.split("_*")[0]}"' in shm.read_text()
    from deepspeed.accelerator import get_accelerator

    assert get_accelerator().create_op_builder(dsi.SHM_COMM_BUILDER) is not None



def _fake_engine(stage: int):
    """What ``DeepSpeedEngine._do_optimizer_sanity_check`` reads of an engine: bf16 model, fp32 accumulation."""
    from types import SimpleNamespace

    import torch

    return SimpleNamespace(get_data_types=lambda: (torch.bfloat16, torch.float32), zero_optimization=lambda: True,
                           zero_allow_untested_optimizer=lambda: True, global_rank=1,
                           zero_optimization_stage=lambda: stage, zero_cpu_offload=lambda: False,
                           zero_compute_grad_norm=lambda: True, pipeline_parallelism=False)


def test_zero1_keeps_zero_optimizer_overrides_only_deepspeeds_bf16_zero1_choice(monkeypatch):
    """DeepSpeed 0.19 gives bf16 ZeRO-1 with fp32 accumulation to BF16_Optimizer and ZeRO-2 to DeepSpeedZeroOptimizer
    (the fact the override exists for); inside the context ZeRO-1 gets DeepSpeedZeroOptimizer too, and the engine's
    method is DeepSpeed's own again after it."""
    import deepspeed.runtime.engine
    import torch
    from deepspeed.runtime.engine import DeepSpeedEngine

    # the supported-optimizer lookup logs through deepspeed.comm, which needs a process group; Adam is on the list
    monkeypatch.setattr(deepspeed.runtime.engine, "is_zero_supported_optimizer", lambda optimizer: True)
    choose = getattr(DeepSpeedEngine, dsi.ENGINE_WRAPPER_CHOICE)
    assert list(inspect.signature(choose).parameters) == ["self", "basic_optimizer"]
    adam = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))])
    assert [choose(_fake_engine(s), adam) for s in (1, 2)] == ["bf16", "zero_optimization"]
    with dsi.zero1_keeps_zero_optimizer():
        routed = getattr(DeepSpeedEngine, dsi.ENGINE_WRAPPER_CHOICE)
        assert [routed(_fake_engine(s), adam) for s in (1, 2)] == ["zero_optimization", "zero_optimization"]
    assert getattr(DeepSpeedEngine, dsi.ENGINE_WRAPPER_CHOICE) is choose
