"""The split works on the torch releases pyproject.toml admits, not only the one CI installs.

torch 2.12 gave `split_module` its `tuple_return` flag; on torch 2.11 (the CUDA image of a lent
GPU machine had it) every compile failed with "split_module() got an unexpected keyword
argument 'tuple_return'". `passes.split.split_in_tuples` wraps one-output stages itself where
torch lacks the flag. Here torch 2.11's `split_module` is stood in for by a wrapper with its
exact signature (no `tuple_return`, one-output stages returned bare), and every drawn model and
cut must split into the same stage programs as with the flag, and train like one process.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import torch
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st
from torch.fx.passes.split_module import split_module

import pdcompile.passes.split as split_pass
from pdcompile.passes.split import split
from tests.helpers.random_models import (
    explicit_graph,
    random_cut,
    random_models,
    squared_error,
    trains_in_one_process,
)
from tests.helpers.transparency import check


def split_module_before_2_12(m: Any, root_m: Any, split_callback: Callable[[Any], int],
                             qualname_map: dict[str, str] | None = None,
                             keep_original_order: bool | None = False,
                             keep_original_node_name: bool | None = False,
                             keep_original_input_name: bool = True, *,
                             partition_affix: str | None = None) -> Any:
    """torch 2.11's signature and behaviour: a stage with one output returns it bare."""
    return split_module(m, root_m, split_callback, qualname_map, keep_original_order,
                        keep_original_node_name, keep_original_input_name,
                        partition_affix=partition_affix)


@contextmanager
def torch_2_11_split() -> Iterator[None]:
    with mock.patch.object(split_pass, "split_module", split_module_before_2_12):
        yield


@st.composite
def cases(draw: st.DrawFn) -> dict[str, Any]:
    model, inputs = draw(random_models())
    if not trains_in_one_process(model, inputs):
        reject()
    plan = random_cut(explicit_graph(model, inputs), draw(st.randoms(use_true_random=False)),
                      stages=draw(st.integers(1, 4)), replicas=[1, 1, 1, 1])
    return {"model": model, "inputs": inputs, "plan": plan}


def _programs(model: torch.nn.Module, case: dict[str, Any]) -> list[tuple[Any, ...]]:
    gm = explicit_graph(model, case["inputs"])
    result = split(gm, case["plan"], model=model)
    # tensor constants are numbered by a count that runs across traces: not the split's doing
    return [(re.sub(r"_tensor_constant\d+", "_tensor_constant#", p.module.code), p.inputs, p.outputs, p.receives, p.sends, p.param_names)
            for p in result.stages]


SETTINGS = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}


@settings(max_examples=25, **SETTINGS)
@given(cases())
def test_without_tuple_return_the_same_stages_are_made(case: dict[str, Any]) -> None:
    native = _programs(copy.deepcopy(case["model"]), case)
    with torch_2_11_split():
        older = _programs(copy.deepcopy(case["model"]), case)
    assert older == native


@settings(max_examples=8, **SETTINGS)
@given(cases(), st.sampled_from(["1f1b-flush", "gpipe"]))
def test_without_tuple_return_pipelines_train_like_one_process(case: dict[str, Any],
                                                               schedule: str) -> None:
    target = torch.randn(8, 1, case["inputs"][0].shape[-1], dtype=case["inputs"][0].dtype)
    with torch_2_11_split():
        check((case["model"], case["inputs"], target, squared_error), schedule=schedule,
              micro=2, plan=case["plan"])


def test_the_stand_in_is_what_torch_2_11_rejects() -> None:
    """The stand-in really lacks the flag, so the fallback path is what the tests above run."""
    import inspect

    assert "tuple_return" not in inspect.signature(split_module_before_2_12).parameters
    with torch_2_11_split():
        assert split_pass.split_module is split_module_before_2_12
