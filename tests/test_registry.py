"""The one registry type behind every named, pluggable thing."""

from __future__ import annotations

import sys

import pytest

from mmrl import algos
from mmrl.errors import ConfigError
from mmrl.utils.registry import Registry


def test_decorator_add_traits_and_names():
    reg: Registry = Registry("widget", "model.widget")

    @reg.register("round", needs_space=True)
    def round_widget():
        return "round"

    reg.add("square", lambda: "square")
    assert reg.get("round") is round_widget and reg["square"]() == "square"
    assert reg.traits("round") == {"needs_space": True}
    assert reg.trait("square", "needs_space", False) is False
    assert reg.names() == ["round", "square"] and "round" in reg and len(reg) == 2
    reg.add("round", round_widget)  # the same object again (a module imported twice) is fine
    with pytest.raises(ValueError, match="already registered"):
        reg.add("round", lambda: "other")


def test_unknown_names_list_the_known_ones_and_the_closest():
    reg: Registry = Registry("widget", "model.widget")
    reg.add("round", object())
    reg.add("square", object())
    with pytest.raises(ConfigError) as err:
        reg.get("sqare")
    assert str(err.value) == (
        "model.widget: unknown widget 'sqare'; known: round, square; did you mean 'square'?"
    )
    with pytest.raises(ConfigError, match="unknown widget 'x'"):
        reg.traits("x")


def test_lazy_entries_import_on_first_use(tmp_path, monkeypatch):
    (tmp_path / "costly_engine_for_test.py").write_text("class Engine:\n    kind = 'costly'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    reg: Registry = Registry("engine")
    reg.add("costly", "costly_engine_for_test:Engine", streams=True)
    assert "costly_engine_for_test" not in sys.modules
    assert reg.traits("costly") == {"streams": True}  # traits without the import
    assert reg.lazy_targets() == {"costly": "costly_engine_for_test:Engine"}
    assert reg.get("costly").kind == "costly"
    assert "costly_engine_for_test" in sys.modules and reg.lazy_targets() == {}


def test_vllm_is_registered_but_not_imported_until_asked_for():
    from mmrl.rollout import ROLLOUT_ENGINES

    assert {"hf", "vllm", "latent"} <= set(ROLLOUT_ENGINES)
    assert ROLLOUT_ENGINES.lazy_targets().get("vllm", "mmrl.rollout.vllm:VLLMRollout") == (
        "mmrl.rollout.vllm:VLLMRollout"
    )


def test_estimator_traits_say_what_the_fit_loop_builds():
    groups = {n for n in algos.ADV_ESTIMATORS if algos.ADV_ESTIMATORS.trait(n, "needs_groups")}
    critic = {n for n in algos.ADV_ESTIMATORS if algos.ADV_ESTIMATORS.trait(n, "needs_critic")}
    baselines = {
        n for n in algos.ADV_ESTIMATORS if algos.ADV_ESTIMATORS.trait(n, "needs_baselines")
    }
    components = {
        n for n in algos.ADV_ESTIMATORS if algos.ADV_ESTIMATORS.trait(n, "needs_components")
    }
    assert groups == {"grpo", "gdpo", "rloo", "reinforce_plus_plus_baseline"}
    assert critic == {"gae"} and baselines == {"remax"} and components == {"gdpo"}


def test_gspo_declares_its_own_aggregation():
    from mmrl.config import ActorConfig, PolicyLossConfig

    gspo = ActorConfig(
        policy_loss=PolicyLossConfig("gspo", gspo_loss_agg_mode="seq-mean-token-sum")
    )
    assert algos.pg_loss_agg_mode(gspo) == "seq-mean-token-sum"
    assert algos.pg_loss_agg_mode(ActorConfig(loss_agg_mode="seq-mean-token-mean")) == (
        "seq-mean-token-mean"
    )
