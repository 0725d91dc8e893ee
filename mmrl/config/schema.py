"""Typed run configuration.

Hydra composes YAML from ``mmrl/configs/``; :func:`mmrl.config.load_config` validates
it once against these dataclasses (unknown keys and wrong types are errors) and
the rest of the code only sees typed objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class DataConfig:
    train_batch_size: int = 16
    val_batch_size: int = 64
    max_prompt_length: int = 16
    max_response_length: int = 8
    filter_overlong_prompts: bool = False
    shuffle: bool = True
    # Prompts with images and video (VLM tasks; docs/vlm.md). None keeps the model processor's
    # value.
    min_pixels: int | None = None  # area bounds of resized images
    max_pixels: int | None = None
    video_min_pixels: int | None = None  # the same per video frame
    video_max_pixels: int | None = None
    video_fps: float = (
        2.0  # frames sampled per second of video, clamped to [video_min_frames, video_max_frames]
    )
    video_min_frames: int = 2
    video_max_frames: int = 16
    truncation: str = (
        "error"  # error | left | right: drop text tokens of overlong prompts (never vision tokens)
    )
    keep_raw_media: bool = (
        False  # keep raw media beside the processed pixels (the vLLM engine turns it on)
    )
    cache_size: int = 4096  # processed prompts kept (per-uid cache, LRU); 0 disables
    # Refusals, checked before media is decoded in full (a decompression bomb costs nothing):
    # encoded image size, image width * height (from the header; PIL's own warning level),
    # and frames in a video's container. null turns a check off. max_pixels above only resizes.
    max_image_bytes: int | None = 64 * 2**20
    max_image_pixels: int | None = 89_478_485
    max_video_frames: int | None = 100_000


@dataclass
class ModelConfig:
    path: str | None = None
    dtype: str = "float32"


@dataclass
class ActorConfig:
    lr: float = 3e-4
    # RL steps over which the lr rises linearly to `lr` (verl's optim.lr_warmup_steps). Adam's
    # first steps move every parameter by about lr whatever the gradient's size, which a
    # small, noisy policy gradient turns into a jump in the policy.
    lr_warmup_steps: int = 0
    weight_decay: float = 0.0
    ppo_mini_batch_size: int = 8
    ppo_micro_batch_size: int = 64
    ppo_epochs: int = 1
    policy_loss: str = "vanilla"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.28
    clip_ratio_c: float | None = 3.0
    loss_agg_mode: str = "token-mean"
    entropy_coeff: float = 0.0
    use_kl_loss: bool = True
    kl_loss_coef: float = 0.01
    kl_loss_type: str = "low_var_kl"
    grad_clip: float = 1.0
    # Regexes over parameter names (re.search); matching parameters are frozen before the
    # optimizer is built, e.g. ["visual\\."] freezes a Qwen-VL vision tower (model.visual.*).
    freeze_modules: list[str] = field(default_factory=list)


@dataclass
class ValKwargs:
    n: int = 1
    temperature: float = 1.0
    do_sample: bool = True


@dataclass
class RolloutConfig:
    name: str = "hf"
    n: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    do_sample: bool = True
    log_prob_micro_batch_size: int = 128
    val_kwargs: ValKwargs = field(default_factory=ValKwargs)
    # vLLM engine settings (rollout.name=vllm); the hf engine ignores them.
    dtype: str = "auto"  # auto: the actor's dtype
    kv_cache_memory_gib: float | None = 1.0  # None: size the KV cache by gpu_memory_utilization
    gpu_memory_utilization: float = 0.5
    enforce_eager: bool = True
    enable_prefix_caching: bool = True
    max_num_seqs: int = 256


@dataclass
class RefConfig:
    log_prob_micro_batch_size: int = 128


@dataclass
class ActorRolloutRefConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    ref: RefConfig = field(default_factory=RefConfig)


@dataclass
class CriticConfig:
    lr: float = 1e-3
    ppo_micro_batch_size: int = 64
    ppo_epochs: int = 1
    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"
    grad_clip: float = 1.0


@dataclass
class VerifierSpec:
    """One ``reward.verifiers`` entry; see mmrl/verifiers and docs/verifiers.md."""

    # A registered name, an entry point in group mmrl.verifiers, module:function or
    # file.py:function.
    name: str = "exact_answer"
    weight: float = 1.0
    alias: str | None = None  # metric name (reward/<alias>/...); default: the verifier's name
    mode: str | None = None  # batch | process; None: what the verifier declares (batch by default)
    timeout_s: float | None = None  # per worker call in process mode; None: reward.timeout_s
    chunk_size: int | None = None  # samples per worker call in process mode
    kwargs: dict[str, Any] = field(default_factory=dict)  # passed to the verifier function


@dataclass
class RewardConfig:
    verifiers: list[VerifierSpec] = field(default_factory=lambda: [VerifierSpec()])
    overlong_reward: str = "zero"
    num_workers: int | None = (
        None  # worker processes for process-mode verifiers; None: CPU count (<= 8)
    )
    timeout_s: float = 60.0  # default per-call timeout of process-mode verifiers


@dataclass
class KLControlConfig:
    type: str = "fixed"
    kl_coef: float = 0.001
    target_kl: float = 0.1
    horizon: int = 10000


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "k1"
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    # Truncated importance sampling from the rollout engine's distribution to the
    # trainer's: null (off) | token | sequence, with weights capped at rollout_is_cap.
    rollout_is: str | None = None
    rollout_is_cap: float = 2.0


@dataclass
class TrainerConfig:
    seed: int = 0
    total_steps: int = 60
    test_freq: int = 10
    save_freq: int = 0
    val_before_train: bool = True
    val_greedy: bool = False  # also validate with greedy decoding (metrics val/greedy/*)
    output_dir: str = "outputs/run"
    experiment_name: str = "run"
    loggers: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    progress_bar: bool = True
    # Workers (mmrl/hybrid). One worker and no ray_address is the embedded mode (in-process).
    n_workers_per_node: int = 1
    nnodes: int = 1
    ray_address: str | None = (
        None  # "auto" or "host:port" joins a cluster; null starts a local Ray if needed
    )
    ray_object_store_mb: int = 1024  # object store of a local Ray
    ray_num_cpus_per_worker: float = 1.0
    colocate_critic: bool = True  # critic in the actor workers' processes, or its own workers
    device: str = "auto"  # auto | cpu | cuda
    mixed_precision: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | bf16 | fp32
    dist_timeout_s: float = 90.0  # a collective waiting longer than this fails (e.g. a dead rank)
    # Samples the verifiers could not score (docs/verifiers.md). A step with none valid skips
    # its update. reward/invalid_rate above max_invalid_rate for invalid_rate_patience steps in
    # a row stops the run with a checkpoint; null never stops.
    max_invalid_rate: float | None = 0.99
    invalid_rate_patience: int = 10
    # Leave groups whose valid samples all scored the same out of the update (verl keeps them:
    # their advantages are 0, but the KL loss still applies). docs/algorithms.md.
    skip_zero_variance_updates: bool = False


@dataclass
class RunConfig:
    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    # Task-specific settings; the task named here parses them into its own type.
    task: dict[str, Any] = field(default_factory=dict)

    @property
    def output_dir(self) -> Path:
        return Path(self.trainer.output_dir)
