"""Bad input to zeroshard.shard gets an error that names the value and the fix."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zeroshard
from zeroshard.testing import run_ranks


def test_shard_before_init_process_group() -> None:
    with pytest.raises(RuntimeError, match="init_process_group"):
        zeroshard.shard(nn.Linear(2, 2), torch.optim.AdamW, stage=1)


class _Lamb(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-3) -> None:
        super().__init__(params, {"lr": lr})


def _case(name: str):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    if name == "stage_5":
        return zeroshard.shard(model, torch.optim.AdamW, stage=5)
    if name == "stage_str":
        return zeroshard.shard(model, torch.optim.AdamW, stage="2")
    if name == "mixed_precision":
        return zeroshard.shard(model, torch.optim.AdamW, mixed_precision="int8")
    if name == "misspelled":
        return zeroshard.shard(model, torch.optim.AdamW, stgae=2)
    if name == "misspelled_option":
        return zeroshard.shard(model, torch.optim.AdamW, mixed_precison="bf16")
    if name == "no_trainable":
        model.requires_grad_(False)
        return zeroshard.shard(model, torch.optim.AdamW)
    if name == "devices":
        model[1].to("meta")
        return zeroshard.shard(model, torch.optim.AdamW)
    if name == "not_elementwise":
        return zeroshard.shard(model, _Lamb, stage=1)
    if name == "lbfgs":
        return zeroshard.shard(model, torch.optim.LBFGS, stage=1)
    if name == "units_stage2":
        return zeroshard.shard(model, torch.optim.AdamW, stage=2, units=[model[0]])
    if name == "units_overlap":
        outer = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), nn.Linear(4, 1))
        return zeroshard.shard(outer, torch.optim.AdamW, stage=3, units=[outer[0], outer[0][1]])
    if name == "units_foreign":
        return zeroshard.shard(model, torch.optim.AdamW, stage=3, units=[nn.Linear(1, 1)])
    if name == "twice":
        zeroshard.shard(model, torch.optim.AdamW)
        return zeroshard.shard(model, torch.optim.AdamW)
    if name in ("deepcopy_s0", "deepcopy_s3"):
        import copy

        sharded, _ = zeroshard.shard(model, torch.optim.AdamW, stage=int(name[-1]))
        return copy.deepcopy(sharded)
    if name == "replaced_param":
        model, _ = zeroshard.shard(model, torch.optim.AdamW, stage=2)
        model[0].weight = nn.Parameter(torch.zeros(4, 4))
        return model(torch.zeros(1, 4))
    if name in ("data_assigned_s0", "data_assigned_s1"):
        # p.data = t: the optimizer went on stepping the old storage, the forward used the
        # new one, silently. (At stage 3 the parameters are DTensors, whose .data setter
        # torch itself ignores, as under FSDP2.)
        model, _ = zeroshard.shard(model, torch.optim.AdamW, stage=int(name[-1]))
        p = model[0].weight
        p.data = torch.zeros_like(p)
        return model(torch.zeros(1, 4))
    if name == "converted_s0":  # a dtype conversion after shard(): not a move
        model, _ = zeroshard.shard(model, torch.optim.AdamW, stage=0)
        model.double()
        return model(torch.zeros(1, 4, dtype=torch.float64))
    if name == "optimizer_foreign":
        other = nn.Linear(4, 4)
        return zeroshard.shard(model, torch.optim.AdamW(other.parameters()), stage=2)
    if name == "scalar_param":
        model.register_parameter("temperature", nn.Parameter(torch.tensor(1.0)))
        return zeroshard.shard(model, torch.optim.AdamW, stage=2)
    if name == "add_param_group":
        _, optim = zeroshard.shard(model, torch.optim.AdamW, stage=1)
        return optim.add_param_group({"params": [nn.Parameter(torch.ones(2))]})
    if name == "assign_load":
        model, _ = zeroshard.shard(model, torch.optim.AdamW, stage=1)
        return model.load_state_dict(model.state_dict(), assign=True)
    if name == "no_optimizer":
        return zeroshard.shard(model, stage=2)
    if name == "instance_typo":
        return zeroshard.shard(model, torch.optim.AdamW(model.parameters()), stgae=2)
    if name == "ddp_option":
        return zeroshard.shard(model, torch.optim.AdamW(model.parameters()), stage=2,
                               find_unused_parameters=True)
    if name == "ddp_option_class":
        return zeroshard.shard(model, torch.optim.AdamW, stage=2, bucket_cap_mb=25)
    if name == "optimizer_string":
        return zeroshard.shard(model, "adamw", stage=2)
    if name == "optimizer_instance_kwargs":
        return zeroshard.shard(model, torch.optim.AdamW(model.parameters()), stage=2, lr=1.0)
    if name == "optimizer_instance_groups":
        return zeroshard.shard(model, torch.optim.AdamW(model.parameters()), stage=2,
                               param_groups=[{"params": [model[0].bias]}])
    if name == "misspelled_optimizer_kwarg":
        return zeroshard.shard(model, torch.optim.AdamW, stage=1, lrr=1e-3)
    if name == "bucket_bytes":
        return zeroshard.shard(model, torch.optim.AdamW, bucket_bytes=0)
    if name == "offload_unknown":
        return zeroshard.shard(model, torch.optim.AdamW, stage=3, offload="params")
    if name == "offload_params_stage2":
        return zeroshard.shard(model, torch.optim.AdamW, stage=2, offload="optimizer+params")
    if name == "offload_stage0":
        return zeroshard.shard(model, torch.optim.AdamW, stage=0, offload="optimizer")
    if name == "meta_custom":
        model.to("meta")
        return zeroshard.shard(model, torch.optim.AdamW, stage=3)
    if name == "meta_stage1":
        model.to("meta")
        return zeroshard.shard(model, torch.optim.AdamW, stage=1)
    raise AssertionError(name)


EXPECT = {
    "stage_5": (ValueError, "stage=5 is not a ZeRO stage"),
    "stage_str": (TypeError, "stage='2' must be an int"),
    "mixed_precision": (ValueError, "mixed_precision='int8'.*'bf16'"),
    "misspelled": (TypeError, "unknown option 'stgae'.*did you mean 'stage'"),
    "misspelled_option": (TypeError, "did you mean 'mixed_precision'"),
    "no_trainable": (ValueError, "no trainable parameters"),
    "devices": (ValueError, "several devices.*model.to"),
    "not_elementwise": (ValueError, "_Lamb looks not elementwise"),
    "lbfgs": (ValueError, "LBFGS cannot be sharded: it re-evaluates the closure"),
    "units_stage2": (ValueError, "units= applies to stage 3 only"),
    "units_overlap": (ValueError, "units= overlap: '0.1' is inside '0'"),
    "units_foreign": (ValueError, "not a submodule"),
    "twice": (ValueError, "already sharded"),
    "replaced_param": (RuntimeError, "parameter '0.weight' was replaced"),
    "data_assigned_s0": (RuntimeError, "'0.weight' was given new storage.*p.copy_\\(tensor\\)"),
    "data_assigned_s1": (RuntimeError, "'0.weight' was given new storage.*p.copy_\\(tensor\\)"),
    "converted_s0": (RuntimeError, "'0.weight' was given new storage.*now \\(4, 4\\) "
                     "torch.float64 on cpu, sharded as \\(4, 4\\) torch.float32.*mixed_precision"),
    "deepcopy_s0": (TypeError, "deepcopy of a sharded Sequential.*Copy the model before "
                    r"shard\(\).*full_state_dict\(model\)"),
    "deepcopy_s3": (TypeError, "deepcopy of a sharded Sequential.*shard_for_inference"),
    "bucket_bytes": (ValueError, "bucket_bytes=0 must be a positive int"),
    "optimizer_foreign": (ValueError, "not a parameter of the Sequential.*model.parameters"),
    "scalar_param": (ValueError, "'temperature' is 0-dimensional.*shape \\(1,\\)"),
    "add_param_group": (NotImplementedError, "groups are fixed when the model is sharded"),
    "assign_load": (NotImplementedError, "without assign"),
    "no_optimizer": (TypeError, "shard\\(\\) needs the optimizer: build it on model.parameters"),
    "instance_typo": (TypeError, "unknown option 'stgae'; did you mean 'stage'"),
    "ddp_option": (TypeError, "'find_unused_parameters' is a DistributedDataParallel option"),
    "ddp_option_class": (TypeError, "'bucket_cap_mb' is a Distributed.*use bucket_bytes="),
    "optimizer_string": (TypeError, "optimizer='adamw' is not an optimizer: pass a torch"),
    "optimizer_instance_kwargs": (TypeError, r"keywords \['lr'\] were given with a AdamW"),
    "optimizer_instance_groups": (TypeError, "param_groups= goes with an optimizer class"),
    "misspelled_optimizer_kwarg": (TypeError, "unknown option 'lrr'.*did you mean 'lr'"),
    "offload_unknown": (ValueError, "offload='params' is not supported.*'optimizer\\+params'"),
    "offload_params_stage2": (ValueError, "'optimizer\\+params' needs stage=3.*use stage=3"),
    "offload_stage0": (ValueError, "offload='optimizer' needs stage 1, 2 or 3"),
    "meta_custom": (ValueError, "pass param_init="),
    "meta_stage1": (ValueError, "meta device; stages 0-2 need real weights"),
}


def _all_cases(rank: int, world: int) -> dict:
    out = {}
    for name in EXPECT:
        try:
            _case(name)
            out[name] = None
        except Exception as e:  # noqa: BLE001 - we report every error type
            out[name] = (type(e).__name__, str(e))
    return out


def test_bad_input_messages() -> None:
    import re

    got = run_ranks(_all_cases, 1, timeout=120)[0]
    for name, (etype, pattern) in EXPECT.items():
        assert got[name] is not None, f"{name}: no error raised"
        assert got[name][0] == etype.__name__, (name, got[name])
        assert re.search(pattern, got[name][1]), (name, got[name][1])


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[1](self.layers[0](x))


def _warnings_of(rank: int, world: int, cases: list[dict]) -> list[list[str]]:
    import warnings

    out = []
    for options in cases:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            zeroshard.shard(_Stack(), torch.optim.AdamW, **options)
        out.append([str(w.message) for w in caught if issubclass(w.category, UserWarning)])
    return out


IGNORED = [
    ({"stage": 3, "bucket_bytes": 2**20}, ["bucket_bytes=1048576 has no effect with stage=3: "
                                           "stage 3 reduces each unit's gradients"]),
    ({"stage": 2, "bucket_bytes": 2**20}, []),
    ({"stage": 1, "reshard_after_forward": False, "prefetch": 2},
     ["reshard_after_forward=False has no effect with stage=1", "prefetch=2 has no effect"]),
    ({"stage": 3, "reshard_after_forward": False, "prefetch": 2}, []),
    ({"stage": 0, "prefetch": 1, "bucket_bytes": None}, []),  # defaults passed: no effect lost
    ({"stage": 2, "mixed_precision": "bf16", "init_scale": 1024.0},
     ["init_scale=1024.0 has no effect with mixed_precision='bf16': loss scaling runs "
      "under mixed_precision='fp16' only"]),
    ({"stage": 2, "mixed_precision": "fp16", "init_scale": 1024.0}, []),
]


def test_options_without_effect_warn() -> None:
    """Nothing ignored silently: an option set where it does nothing warns, naming it,
    why, and what to do (docs/stages.md lists them)."""
    got = run_ranks(_warnings_of, 1, [c for c, _ in IGNORED], timeout=60)[0]
    for (options, expected), messages in zip(IGNORED, got):
        assert len(messages) == len(expected), (options, messages)
        for want, message in zip(expected, messages):
            assert message.startswith(want), (options, message)
