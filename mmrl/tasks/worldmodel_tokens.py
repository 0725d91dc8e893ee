"""Token world-model GRPO: predict the next frame(s) from K context frames and actions.

The starting model comes from ``mmrl pretrain-worldmodel`` (data, VQ tokenizer, MLE
pretraining), run by :meth:`WorldModelTokensTask.initial_model` and cached by its
config. Prompts are held-out-disjoint windows of the generated trajectories; the
reward is computed by verifiers on the decoded frames (``reward.verifiers``, see
``mmrl/configs/task/worldmodel_tokens.yaml``). After RL, :meth:`on_fit_end` evaluates the
pretrained start and the RL-tuned model on held-out windows with greedy and sampled
decoding and writes the report.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import OmegaConf

from mmrl.tasks.base import Task, TaskData, register_task, task_config

if TYPE_CHECKING:
    from mmrl.config import RunConfig
    from mmrl.processors.worldmodel import WorldModelPromptProcessor
    from mmrl.worldmodel.pretrain_config import PretrainConfig

log = logging.getLogger(__name__)
# Settings that say where or how loudly pretraining runs, not what it makes.
_NOT_IN_KEY = ("output_dir", "progress_bar")


@dataclass
class HeldOutEval:
    windows: int = 64  # test windows of the final comparison (fixed draw from the test split)
    samples: int = 4  # sampled predictions per window (greedy uses one)
    temperature: float = 1.0
    # A predicted frame that moves less than this (mean |pixel change| in [0, 1]) while the
    # true frame moves more counts as repeated (mmrl.verifiers.repetition).
    repetition_tau: float = 0.01


@dataclass
class WorldModelTokensConfig:
    name: str = "worldmodel_tokens"
    # Overrides of mmrl/configs/worldmodel/pretrain.yaml (nested), e.g. {train: {steps: 800}}.
    pretrain: dict[str, Any] = field(default_factory=dict)
    cache_dir: str = "outputs/worldmodel/cache"  # pretraining runs land in <cache_dir>/<env>-<hash>
    train_windows: int | None = None  # RL prompts drawn from the training trajectories; None: all
    val_windows: int = 64  # held-out prompts for validation during RL
    eval: HeldOutEval = field(default_factory=HeldOutEval)
    report: bool = True


@register_task("worldmodel_videos")
@register_task("worldmodel_tokens")
class WorldModelTokensTask(Task):
    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg: WorldModelTokensConfig = task_config(WorldModelTokensConfig, cfg)
        self.name = self.cfg.name
        self.pretrain_cfg = pretrain_config(self.cfg.pretrain, self.cfg.cache_dir)
        if self.name == "worldmodel_videos" and not self.pretrain_cfg.data.videos:
            raise ValueError(
                "task=worldmodel_videos trains on your recordings: pass "
                "task.pretrain.data.videos=DIR (a folder of mp4 + action files)"
            )

    # --- the starting model -----------------------------------------------------------

    def initial_model(self, cfg: RunConfig) -> tuple[Path, dict[str, float]]:
        """Run MLE pretraining, or reuse a finished run with the same config."""
        summary = cached_pretraining(self.pretrain_cfg)
        if summary is None:
            from mmrl.worldmodel.pretrain import pretrain_token_world_model

            summary = pretrain_token_world_model(self.pretrain_cfg).summary
        else:
            log.info("reusing pretrained world model in %s", self.pretrain_cfg.output_dir)
        from mmrl.worldmodel.pretrain import below_copying

        warning = below_copying(summary, self.pretrain_cfg.train.lr, "task.pretrain.")
        if warning is not None:
            log.warning(warning)
        best = Path(self.pretrain_cfg.output_dir) / "token_wm" / "best"
        attach_tokenizer(best, Path(self.pretrain_cfg.tokenizer.dir))
        keys = (
            "best_val_loss",
            "steps_run",
            "tokenizer_psnr",
            "val/psnr_greedy",
            "val/psnr_copy_last_frame",
            "val/psnr_tokenizer_ceiling",
            "val/state_match_greedy",
            "val/state_match_copy_last_frame",
        )
        return best, {f"pretrain/{k.removeprefix('val/')}": float(summary[k]) for k in keys}

    # --- data and processor -----------------------------------------------------------

    def build_data(self, seed: int) -> TaskData:
        """Training windows from the training trajectories; held-out windows from trajectories
        with other env seeds (never trained on, in pretraining or RL)."""
        from mmrl.processors.worldmodel import load_windows
        from mmrl.worldmodel.data import TrajectoryDataset
        from mmrl.worldmodel.pretrain import prepare_data

        train_dir, val_dir, test_dir = prepare_data(self.pretrain_cfg)
        k, f = self.pretrain_cfg.data.context, self.pretrain_cfg.data.future
        train = load_windows(TrajectoryDataset(train_dir), k, f, self.cfg.train_windows, seed)
        val = load_windows(TrajectoryDataset(val_dir), k, f, self.cfg.val_windows, seed=0)
        test = load_windows(TrajectoryDataset(test_dir), k, f, self.cfg.eval.windows, seed=0)
        return TaskData(train=train, val=val, test=test)

    def build_prompt_processor(self, model_path: Path, cfg: RunConfig) -> WorldModelPromptProcessor:
        from mmrl.processors.worldmodel import WorldModelPromptProcessor
        from mmrl.tasks.worldmodel_eval import TOKENIZER_SUBDIR
        from mmrl.worldmodel.token_lm import PROCESSOR_FILE, TokenWorldModelProcessor
        from mmrl.worldmodel.tokenizer import VQTokenizer

        if cfg.reward.overlong_reward != "keep":
            raise ValueError(
                "world-model responses always have exactly tokens_per_frame x F tokens and no EOS, "
                "so "
                f"reward.overlong_reward={cfg.reward.overlong_reward!r} would zero every reward; "
                "set it to 'keep'"
            )
        if self.pretrain_cfg.data.videos:
            from mmrl.worldmodel.video_import import refuse_state_verifiers

            refuse_state_verifiers(
                cfg.reward.verifiers, "use task=worldmodel_videos or remove them"
            )
        model_path = Path(model_path)
        tokens = TokenWorldModelProcessor.from_json(
            json.loads((model_path / PROCESSOR_FILE).read_text())
        )
        tok_dir = model_path / TOKENIZER_SUBDIR
        tokenizer = VQTokenizer.from_pretrained(
            tok_dir if tok_dir.exists() else self.pretrain_cfg.tokenizer.dir
        )
        if cfg.data.max_response_length != tokens.response_length:
            raise ValueError(
                f"data.max_response_length={cfg.data.max_response_length}, but every response is "
                f"{tokens.future} frame(s) x {tokens.layout.tokens_per_frame} tokens"
                + (" + the interleaved actions" if tokens.interleaved else "")
                + f" = {tokens.response_length}: set data.max_response_length="
                f"{tokens.response_length}"
            )
        return WorldModelPromptProcessor(tokens, tokenizer, cfg.data.max_prompt_length)

    # --- after RL: held-out evaluation and report --------------------------------------

    def complete_checkpoint(self, base_dir: Path, actor_dir: Path) -> None:
        """The world-model layout, processor and VQ tokenizer, so ``mmrl eval`` reads it."""
        complete_checkpoint(Path(base_dir), Path(actor_dir))

    def on_fit_end(
        self, cfg: RunConfig, base_dir: Path, actor_dir: Path, history: list[dict]
    ) -> dict[str, Any]:
        """Make the actor a complete world-model checkpoint, compare it with the base, report."""
        from mmrl.tasks.worldmodel_eval import compare_base_and_rl

        complete_checkpoint(Path(base_dir), Path(actor_dir))
        data = self.build_data(cfg.trainer.seed)
        # Final claims come from the test split: pretraining's checkpoint choice, validation
        # and tuning read only the val split.
        held_out = data.test
        result = compare_base_and_rl(
            Path(base_dir),
            Path(actor_dir),
            held_out,
            self.cfg.eval,
            cfg.trainer.seed,
            progress=cfg.trainer.progress_bar,
        )
        (cfg.output_dir / "worldmodel_eval.json").write_text(json.dumps(result["table"], indent=1))
        # Each window's scores, so two runs (or base and RL) compare paired, window by window.
        per_window = {
            model: {dec: {k: [None if v != v else float(v) for v in arr] for k, arr in m.items()}
                    for dec, m in by_decoding.items()}
            for model, by_decoding in result["per_window"].items()
        }  # fmt: skip
        (cfg.output_dir / "worldmodel_eval_windows.json").write_text(json.dumps(per_window))
        if self.cfg.report:  # frame strips and a GIF, shown in the run's report.html
            from mmrl.tasks.worldmodel_report import write_report

            write_report(cfg.output_dir / "report", result, held_out)
        return {"worldmodel_eval": result["table"]}


def pretrain_config(overrides: dict[str, Any], cache_dir: str) -> PretrainConfig:
    """``mmrl/configs/worldmodel/pretrain.yaml`` with ``overrides``; without an explicit
    ``output_dir`` it goes to ``<cache_dir>/<env>-<hash of the settings>``."""
    from mmrl.config import compose
    from mmrl.worldmodel.pretrain_config import PretrainConfig

    raw = compose([], config_name="worldmodel/pretrain")
    OmegaConf.set_struct(
        raw, False
    )  # free-form dicts (env_config) take new keys; the dataclass checks the rest
    raw = OmegaConf.merge(raw, overrides)
    if "output_dir" not in overrides:
        settings = {
            k: v
            for k, v in OmegaConf.to_container(raw, resolve=False).items()
            if k not in _NOT_IN_KEY
        }
        digest = hashlib.sha256(
            json.dumps(settings, sort_keys=True, default=str).encode()
        ).hexdigest()[:10]
        name = "videos" if raw.data.get("videos") else raw.data.env
        raw.output_dir = f"{cache_dir}/{name}-{digest}"
    OmegaConf.resolve(raw)
    return task_config(PretrainConfig, raw, prefix="task.pretrain")


def cached_pretraining(cfg: PretrainConfig) -> dict[str, Any] | None:
    """The summary of a finished pretraining run in ``cfg.output_dir`` with the same
    settings; None when there is none. A finished run with other settings is an error."""
    path = Path(cfg.output_dir) / "pretrain_summary.json"
    if not path.exists():
        return None
    summary = json.loads(path.read_text())
    want = {k: v for k, v in asdict(cfg).items() if k not in _NOT_IN_KEY}
    found = {k: v for k, v in summary["config"].items() if k not in _NOT_IN_KEY}
    if json.loads(json.dumps(want)) != found:
        diff = sorted(
            k for k in set(want) | set(found) if json.loads(json.dumps(want.get(k))) != found.get(k)
        )
        raise ValueError(
            f"{path} was made with other pretraining settings (differ: {diff}); "
            "choose another task.pretrain.output_dir or delete that folder"
        )
    from mmrl.worldmodel.pretrain_data import video_keys

    if summary.get("video_keys", {}) != video_keys(cfg):
        log.info("the videos changed since %s was pretrained: pretraining again", path.parent)
        return None
    return summary


def attach_tokenizer(model_dir: Path, tokenizer_dir: Path) -> None:
    """Copy the VQ tokenizer into ``model_dir/vq_tokenizer`` so the checkpoint stands alone."""
    from mmrl.tasks.worldmodel_eval import TOKENIZER_SUBDIR

    dest = model_dir / TOKENIZER_SUBDIR
    if not (dest / "config.json").exists():
        shutil.copytree(tokenizer_dir, dest, dirs_exist_ok=True)


def complete_checkpoint(base_dir: Path, actor_dir: Path) -> None:
    """Give the RL actor (saved by the worker with ``save_pretrained``) the base's layout,
    processor and tokenizer files, so ``load_checkpoint``/``mmrl eval`` read it like the base."""
    from mmrl.tasks.worldmodel_eval import TOKENIZER_SUBDIR
    from mmrl.worldmodel.token_lm import PROCESSOR_FILE
    from mmrl.worldmodel.vocab import LAYOUT_FILE

    for name in (PROCESSOR_FILE, LAYOUT_FILE):
        shutil.copy2(base_dir / name, actor_dir / name)
    attach_tokenizer(actor_dir, base_dir / TOKENIZER_SUBDIR)
