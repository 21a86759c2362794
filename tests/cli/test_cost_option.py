"""`--cost` is one option with one meaning in every subcommand that plans a MODEL: `simulate`
took none (a model was always measured on this machine, where `plan --cost analytic` priced it
on the cluster's device), so the two commands could not be asked about the same plan."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdcompile.cli import build_parser, main


def _cost_option(command: str) -> tuple[object, object, object]:
    commands = next(a for a in build_parser()._actions if a.dest == "command")
    sub = commands.choices[command]  # type: ignore[index]
    option = next(a for a in sub._actions if "--cost" in a.option_strings)
    return option.default, tuple(option.choices or ()), option.help


def test_plan_and_simulate_take_the_same_cost_option() -> None:
    assert _cost_option("simulate") == _cost_option("plan")
    assert _cost_option("plan")[:2] == ("measured", ("measured", "analytic"))


@settings(max_examples=3, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(model=st.sampled_from(["pdcompile.models.democnn:factory",
                              "pdcompile.models.demomlp:factory"]),
       cluster=st.sampled_from(["2@10GB/s:v100", "2x2@10GB/s,1GB/s:v100", "3@1e10:h100"]))
def test_simulate_prices_a_model_analytically_as_plan_does(
        model: str, cluster: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`simulate MODEL --cost analytic` plans what `plan MODEL --cost analytic` plans (same
    configuration, same predicted time per minibatch): the cluster's device, not this CPU."""
    capsys.readouterr()
    assert main(["plan", model, "--cluster", cluster, "--cost", "analytic", "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert main(["simulate", model, "--cluster", cluster, "--cost", "analytic", "--json"]) == 0
    simulated = json.loads(capsys.readouterr().out)
    assert simulated["config"] == planned["config"]
    assert simulated["planner_time_per_minibatch"] == pytest.approx(
        planned["time_per_minibatch"], rel=1e-9)
