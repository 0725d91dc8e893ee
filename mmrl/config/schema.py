"""Typed run configuration: every key ``mmrl train`` accepts, its default and its meaning.

Hydra composes ``mmrl/configs/train.yaml`` (and a task file) over these dataclasses;
:func:`mmrl.config.load_config` checks every key and value and returns a :class:`RunConfig`.
The code reads these objects as they are: the algorithm functions take the section they
need (``ActorConfig``, ``AlgorithmConfig``), never a copy. Each field is documented once, by
the string under it; ``docs/config.md`` is generated from them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mmrl.config.doctor import DoctorConfig
from mmrl.config.fields import AGG_MODES, each_one_of, one_of, ranged, registry_name

DTYPE_NAMES = ("float32", "bfloat16", "float16")
OLD_LOG_PROB_SOURCES = ("auto", "recompute", "update", "rollout")


@dataclass
class DataConfig:
    train_batch_size: int = ranged(16, ge=1)
    """Prompts per RL step, before each is repeated ``rollout.n`` times."""
    val_batch_size: int = ranged(64, ge=1)
    """Prompts per validation generate call."""
    max_prompt_length: int = ranged(16, ge=1)
    """Prompt tokens; a longer prompt is an error, or dropped with filter_overlong_prompts."""
    max_response_length: int = ranged(8, ge=1)
    """Tokens generated per response."""
    filter_overlong_prompts: bool = False
    """Drop prompts longer than max_prompt_length instead of failing."""
    shuffle: bool = True
    """Shuffle the training prompts on every pass."""
    min_pixels: int | None = ranged(None, ge=1)
    """VLM tasks: lower area bound of resized images, in pixels; null keeps the model
    processor's value (docs/vlm.md)."""
    max_pixels: int | None = ranged(None, ge=1)
    """VLM tasks: upper area bound of resized images (a resize bound, not a refusal)."""
    video_min_pixels: int | None = ranged(None, ge=1)
    """As min_pixels, per video frame."""
    video_max_pixels: int | None = ranged(None, ge=1)
    """As max_pixels, per video frame."""
    video_fps: float = ranged(2.0, gt=0)
    """Frames sampled per second of video, clamped to [video_min_frames, video_max_frames]."""
    video_min_frames: int = ranged(2, ge=1)
    """Fewest frames sampled from a video."""
    video_max_frames: int = ranged(16, ge=1)
    """Most frames sampled from a video."""
    truncation: str = one_of("error", ("error", "left", "right"))
    """Overlong prompts: error, or drop text tokens from the left or right (never vision
    tokens)."""
    keep_raw_media: bool = False
    """Keep raw media beside the processed pixels (rollout.name=vllm turns it on)."""
    cache_size: int = ranged(4096, ge=0)
    """Processed prompts kept in the per-uid LRU cache; 0 disables it."""
    max_image_bytes: int | None = ranged(64 * 2**20, ge=1)
    """Refuse an image whose encoded size is larger (checked before decoding, so a
    decompression bomb costs nothing); null: no check. max_pixels only resizes."""
    max_image_pixels: int | None = ranged(89_478_485, ge=1)
    """Refuse an image with more pixels (width x height, from its header; PIL's own warning
    level); null: no check."""
    max_video_frames: int | None = ranged(100_000, ge=1)
    """Refuse a video with more frames in its container; null: no check."""


@dataclass
class ModelConfig:
    path: str | None = None
    """A local save_pretrained folder to start RL from; null lets the task build (and warm up)
    its own model. Models are never downloaded."""
    dtype: str = one_of("float32", DTYPE_NAMES)
    """Parameter dtype the actor loads in."""
    trim_padding: bool = True
    """Run each micro-batch of log-probs and updates at its own longest prompt and response,
    not at max_prompt_length + max_response_length (exact: the dropped columns are padding in
    every row; docs/scaling.md)."""
    remove_padding: bool = True
    """With trim_padding, a text LM runs each micro-batch's rows end to end in bins of its
    longest row, without padding (verl's use_remove_padding; exact: each token attends to its
    own sequence only, and the head runs on response positions alone; docs/scaling.md).
    Families that cannot pack (VLMs, latent policies) trim columns instead."""
    share_prompts: bool = True
    """With remove_padding, rows that share a prompt (a GRPO group's) run it once in the
    forward pass: one sequence holds the prompt, then each response, each response attending
    to the prompt and to itself (exact). Used where it at least halves the tokens: long
    prompts, short responses (world-model contexts; docs/scaling.md)."""


@dataclass
class PolicyLossConfig:
    loss_mode: str = registry_name("vanilla", "policy_loss")
    """The policy loss: vanilla (PPO clip, asymmetric ratios, dual clip), gspo, cispo, or a
    registered one."""
    cispo_clip_ratio_low: float | None = ranged(None, ge=0)
    """CISPO: the importance weight's lower bound is 1 - this; null: no lower bound (as in the
    MiniMax-M1 paper)."""
    cispo_clip_ratio_high: float | None = ranged(None, ge=0)
    """CISPO: the importance weight's upper bound is 1 + this; null: actor.clip_ratio_high."""
    gspo_clip_ratio_low: float = ranged(3e-4, ge=0, lt=1)
    """GSPO: the sequence ratio is clipped below at 1 - this (the GSPO paper's value)."""
    gspo_clip_ratio_high: float = ranged(4e-4, ge=0)
    """GSPO: the sequence ratio is clipped above at 1 + this (the GSPO paper's value)."""
    gspo_loss_agg_mode: str = one_of("seq-mean-token-mean", AGG_MODES)
    """GSPO: how its per-token loss is aggregated (actor.loss_agg_mode still applies to the
    entropy and KL terms)."""


@dataclass
class ActorConfig:
    lr: float = ranged(3e-4, gt=0)
    """Adam learning rate."""
    lr_warmup_steps: int = ranged(0, ge=0)
    """RL steps over which the lr rises linearly to lr (verl's optim.lr_warmup_steps). Adam's
    first steps move every parameter by about lr whatever the gradient's size."""
    weight_decay: float = ranged(0.0, ge=0)
    """AdamW weight decay."""
    fused_optimizer: bool = True
    """AdamW's fused kernel: one pass over all parameters instead of a loop of small ops per
    parameter (torch's CPU default), several times faster for the optimizer step on CPU."""
    ppo_mini_batch_size: int = ranged(8, ge=1)
    """Prompts per optimizer step (each with its rollout.n samples)."""
    ppo_micro_batch_size: int = ranged(64, ge=1)
    """Samples per forward/backward; gradients accumulate over a mini-batch."""
    ppo_epochs: int = ranged(1, ge=1)
    """Passes over each step's samples."""
    use_dynamic_bsz: bool = False
    """Build micro-batches by a token budget instead of ppo_micro_batch_size rows: rows sorted
    by length, each micro-batch as many as fit ppo_max_token_len_per_gpu padded tokens (with
    model.trim_padding, a micro-batch costs about its real tokens; docs/scaling.md)."""
    math_attention_max_len: int = ranged(128, ge=0)
    """On CPU the update's attention runs torch's math kernel when a micro-batch's sequences
    are at most this long: its backward is 2-3x faster there than the flash kernel's
    (docs/scaling.md); 0: torch's own choice always."""
    ppo_max_token_len_per_gpu: int = ranged(4096, ge=1)
    """use_dynamic_bsz: padded tokens (rows x (longest prompt + longest response)) per
    micro-batch of the update and of the log-prob passes, per worker."""
    old_log_prob: str = one_of("auto", OLD_LOG_PROB_SOURCES)
    """Where old_log_probs come from: recompute (a forward pass before the update), update (the
    update's own forward pass, detached; exact only on-policy: ppo_epochs=1, one mini-batch,
    no algorithm.use_kl_in_reward), rollout (the engine's own log-probs; check
    rollout/logprob_diff_max first), or auto (update where exact, else recompute)."""
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    """The policy loss and its own settings."""
    clip_ratio_low: float = ranged(0.2, ge=0, lt=1)
    """PPO clip range lower side: the ratio is clipped at 1 - this."""
    clip_ratio_high: float = ranged(0.28, ge=0)
    """PPO clip range upper side: the ratio is clipped at 1 + this."""
    clip_ratio_c: float | None = ranged(3.0, gt=1)
    """Dual clip: the loss of a negative advantage is capped at -A * this; null disables."""
    loss_agg_mode: str = one_of("token-mean", AGG_MODES)
    """How per-token losses become one number (docs/algorithms.md)."""
    entropy_coeff: float = 0.0
    """Weight of the entropy bonus (subtracted from the loss)."""
    use_kl_loss: bool = True
    """Add a KL(actor || reference) term to the loss."""
    kl_loss_coef: float = ranged(0.01, ge=0)
    """Weight of the KL loss."""
    kl_loss_type: str = registry_name("low_var_kl", "kl_penalty")
    """KL estimator of the KL loss: k1/kl, abs, k2/mse, k3/low_var_kl."""
    grad_clip: float = ranged(1.0, gt=0)
    """Gradient norm clip."""
    freeze_modules: list[str] = field(default_factory=list)
    """Regexes over parameter names (re.search), frozen before the optimizer is built, e.g.
    ['visual\\.'] freezes a Qwen-VL vision tower."""


@dataclass
class ValKwargs:
    n: int = ranged(1, ge=1)
    """Samples per validation prompt."""
    temperature: float = ranged(1.0, gt=0)
    """Validation sampling temperature."""
    do_sample: bool = True
    """Sample during validation (false: greedy)."""


@dataclass
class RolloutConfig:
    name: str = registry_name("hf", "rollout")
    """The rollout engine: hf (transformers generate), vllm, latent."""
    n: int = ranged(8, ge=1)
    """Samples per prompt (the group size of GRPO and RLOO)."""
    temperature: float = ranged(1.0, gt=0)
    """Sampling temperature; log-probs are computed at the same temperature."""
    top_p: float = ranged(1.0, gt=0, le=1)
    """Nucleus sampling mass."""
    top_k: int = ranged(0, ge=0)
    """Top-k sampling; 0 disables."""
    do_sample: bool = True
    """Sample (false: greedy)."""
    log_prob_micro_batch_size: int = ranged(128, ge=1)
    """Samples per forward when recomputing the actor's log-probs."""
    val_kwargs: ValKwargs = field(default_factory=ValKwargs)
    """Sampling during validation."""
    dtype: str = one_of("auto", ("auto", *DTYPE_NAMES))
    """vLLM: the engine's dtype; auto is the dtype the actor computes in (bfloat16 under
    trainer.mixed_precision=bf16, which auto picks where the CPU or GPU has bf16 instructions)."""
    kv_cache_memory_gib: float | None = ranged(1.0, gt=0)
    """vLLM: KV cache size; null sizes it by gpu_memory_utilization."""
    gpu_memory_utilization: float = ranged(0.5, gt=0, le=1)
    """vLLM: share of device memory the engine may take."""
    enforce_eager: bool | None = None
    """vLLM: false compiles the model (CPU rollouts up to 30% faster, 17-35 s more start-up;
    docs/scaling.md), true runs it eagerly; null: compiled for runs of >= 200 steps."""
    enable_prefix_caching: bool = True
    """vLLM: the n samples of a prompt share its prefill."""
    max_num_seqs: int = ranged(256, ge=1)
    """vLLM: sequences decoded together."""


@dataclass
class RefConfig:
    log_prob_micro_batch_size: int = ranged(128, ge=1)
    """Samples per forward of the reference policy."""


@dataclass
class ActorRolloutRefConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    ref: RefConfig = field(default_factory=RefConfig)


@dataclass
class CriticConfig:
    lr: float = ranged(1e-3, gt=0)
    """Critic learning rate (GAE only)."""
    ppo_micro_batch_size: int = ranged(64, ge=1)
    """Samples per critic forward/backward."""
    ppo_epochs: int = ranged(1, ge=1)
    """Critic passes over each step's samples."""
    cliprange_value: float = ranged(0.5, gt=0)
    """Value clip range around the old values."""
    loss_agg_mode: str = one_of("token-mean", AGG_MODES)
    """How per-token value losses become one number."""
    grad_clip: float = ranged(1.0, gt=0)
    """Critic gradient norm clip."""


@dataclass
class VerifierSpec:
    name: str = "exact_answer"
    """A registered verifier, an entry point in group mmrl.verifiers, module:function or
    path/to/file.py:function (docs/verifiers.md)."""
    weight: float = 1.0
    """Weight in the summed score; 0 logs the verifier's metrics without rewarding them."""
    alias: str | None = None
    """Metric name (reward/<alias>/...); default: the verifier's name."""
    mode: str | None = one_of(None, (None, "batch", "process"))
    """batch or process; null: what the verifier declares (batch by default)."""
    timeout_s: float | None = ranged(None, gt=0)
    """Per worker call in process mode; null: reward.timeout_s."""
    chunk_size: int | None = ranged(None, ge=1)
    """Samples per worker call in process mode."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments passed to the verifier function."""


@dataclass
class RewardConfig:
    verifiers: list[VerifierSpec] = field(default_factory=lambda: [VerifierSpec()])
    """The verifiers whose weighted scores sum to the reward."""
    val_verifiers: list[VerifierSpec] | None = None
    """The verifiers that score validation (val/*, val-core/*), in the same form; null: the
    training verifiers. A stricter one makes reward hacking visible: the training reward rises
    while validation stays flat (docs/metrics.md)."""
    overlong_reward: str = one_of("zero", ("keep", "zero"))
    """Responses cut at max_response_length without EOS: keep scores them as they are, zero
    gives them zero reward."""
    num_workers: int | None = ranged(None, ge=1)
    """Worker processes for process-mode verifiers; null: the CPU count (at most 8)."""
    timeout_s: float = ranged(60.0, gt=0)
    """Default per-call timeout of process-mode verifiers."""


@dataclass
class KLControlConfig:
    type: str = registry_name("fixed", "kl_ctrl")
    """fixed, or adaptive (steers the measured KL towards target_kl)."""
    kl_coef: float = ranged(0.001, ge=0)
    """The (initial) KL-in-reward coefficient."""
    target_kl: float = ranged(0.1, gt=0)
    """adaptive: the KL to steer towards."""
    horizon: int = ranged(10000, ge=1)
    """adaptive: samples over which the coefficient adapts."""


@dataclass
class AlgorithmConfig:
    adv_estimator: str = registry_name("grpo", "adv_estimator")
    """grpo, gdpo (GRPO per verifier), gae, rloo, reinforce_plus_plus,
    reinforce_plus_plus_baseline, remax."""
    gamma: float = ranged(1.0, ge=0, le=1)
    """Discount per response step (GAE, REINFORCE++)."""
    lam: float = ranged(1.0, ge=0, le=1)
    """GAE lambda."""
    norm_adv_by_std_in_grpo: bool = True
    """Divide GRPO advantages by the group's std; false is Dr.GRPO."""
    use_kl_in_reward: bool = False
    """Subtract kl_ctrl's coefficient times the KL from the reward."""
    kl_penalty: str = registry_name("k1", "kl_penalty")
    """KL estimator of the KL in the reward: k1/kl, abs, k2/mse, k3/low_var_kl."""
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    """The coefficient of the KL in the reward."""
    rollout_is: str | None = one_of(None, (None, "token", "sequence"))
    """Truncated importance sampling from the rollout engine's distribution to the trainer's
    (a bf16 engine, or another kernel, against the actor): null (off), token or sequence."""
    rollout_is_cap: float = ranged(2.0, ge=1)
    """Importance weights are capped at this."""


@dataclass
class TrainerConfig:
    seed: int = 0
    """Seeds data order, sampling and initialisation."""
    total_steps: int = ranged(60, ge=1)
    """RL steps."""
    test_freq: int = ranged(10, ge=0)
    """Validate every N steps and after the last; 0 disables."""
    save_freq: int = ranged(0, ge=0)
    """Write a checkpoint (global_step_N/: actor, critic, optimizers, data and RNG state) every
    N steps and after the last; 0 saves only the final actor (docs/operations.md)."""
    resume_mode: str = one_of("auto", ("auto", "disable", "resume_path"))
    """auto: continue from output_dir's latest checkpoint when there is one; disable: start
    over; resume_path: continue from resume_from_path."""
    resume_from_path: str | None = None
    """A global_step_N folder to continue from (with resume_mode=resume_path)."""
    max_actor_ckpt_to_keep: int | None = ranged(None, ge=1)
    """Keep only the newest N checkpoints; null keeps all."""
    max_restarts: int = ranged(0, ge=0)
    """Ray mode: a worker that dies restarts the worker group from the latest checkpoint, up
    to this many times in one run (fault/restarts counts them)."""
    val_before_train: bool = True
    """Validate before step 1."""
    val_greedy: bool = False
    """Also validate with greedy decoding (metrics val/greedy/*)."""
    output_dir: str = "outputs/run"
    """Where the run writes (metrics, checkpoints, init_model)."""
    project_name: str = "mmrl"
    """The project the run belongs to (wandb groups runs by it)."""
    experiment_name: str = "run"
    """The run's name."""
    loggers: list[str] = each_one_of(
        ["console", "jsonl"], ("console", "jsonl", "tensorboard", "wandb")
    )
    """Where metrics go: console, jsonl (<output_dir>/metrics.jsonl), tensorboard
    (<output_dir>/tensorboard) and wandb (files under <output_dir>/wandb; needs the wandb
    extra). verl calls this trainer.logger (docs/metrics.md)."""
    progress_bar: bool = True
    """Show a progress bar."""
    n_workers_per_node: int = ranged(1, ge=1)
    """Workers (FSDP ranks) per node; one worker and no ray_address runs in-process."""
    nnodes: int = ranged(1, ge=1)
    """Nodes of a Ray cluster."""
    ray_address: str | None = None
    """auto or host:port joins a running cluster; null starts a local Ray when needed."""
    ray_object_store_mb: int = ranged(1024, ge=64)
    """Object store of a local Ray (the default size does not fit beside the engines)."""
    ray_num_cpus_per_worker: float = ranged(1.0, gt=0)
    """CPUs reserved per worker."""
    colocate_critic: bool = True
    """Critic in the actor workers' processes; false: its own workers."""
    device: str = one_of("auto", ("auto", "cpu", "cuda"))
    """auto picks cuda when a GPU is visible."""
    mixed_precision: str = one_of("auto", ("auto", "bf16", "fp32"))
    """auto: bf16 compute (fp32 parameters, optimizer state and gradient reduction) on a GPU
    and on a CPU with bf16 instructions (AVX512-BF16 or AMX), else fp32 (docs/scaling.md)."""
    dist_timeout_s: float = ranged(90.0, gt=0)
    """A collective waiting longer than this fails (a dead rank is an error, not a hang)."""
    max_invalid_rate: float | None = ranged(0.99, ge=0, le=1)
    """Stop the run (with a checkpoint) when reward/invalid_rate, the share of samples the
    verifiers could not score, stays above this for invalid_rate_patience steps in a row;
    null never stops. A step with no valid sample skips its update (docs/verifiers.md)."""
    invalid_rate_patience: int = ranged(10, ge=1)
    """Steps in a row over max_invalid_rate before the run stops."""
    skip_zero_variance_updates: bool = False
    """Leave groups whose valid samples all scored the same out of the update; verl keeps them
    (their advantages are 0, but the KL loss still applies). docs/algorithms.md."""
    doctor: DoctorConfig = field(default_factory=DoctorConfig)
    """The run doctor's thresholds (mmrl doctor RUN_DIR, and its warnings during training)."""


@dataclass
class RunConfig:
    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    task: dict[str, Any] = field(default_factory=dict)
    """Task settings; the task named by task.name parses them into its own type."""

    @property
    def output_dir(self) -> Path:
        return Path(self.trainer.output_dir)
