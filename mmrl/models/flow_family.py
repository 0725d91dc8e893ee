"""The flow latent family: each denoising step of a flow-matching world model is a policy step.

A response predicts F latent frames; frame ``f`` starts from noise and takes S denoising
steps of the SDE sampler of :mod:`mmrl.models.flow_sde`, conditioned on the K latents before
it (the prompt's ``context_latents`` first, then its own earlier frames) and the K actions
``actions[:, f:f+K]``. Response step ``f * S + k`` is frame ``f``'s step from ``t_k`` to
``t_{k+1}``: a Gaussian with an exact log-density, except the last step of each frame, which
is the ODE's (deterministic, masked out). PPO/GRPO ratios, clipping, KL estimators and
importance weights apply to these steps as to tokens.

Sampling knobs live in the policy's ``flow_policy.json`` (``num_steps``, ``noise_level``,
``train_steps``). ``temperature`` multiplies the noise level (the SDE keeps the ODE's
marginals at any level, so it changes how a path explores, not where it ends on average).
``do_sample=False`` integrates the ODE and reports each step's log-density under the SDE at
the policy's noise level. ``top_k``/``top_p`` do not apply and are ignored. No guidance is
used (the model has no unconditional branch).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mmrl.models.family import PolicyFamily, register_family, torch_dtype
from mmrl.models.flow_policy import CONFIG_FILE, FlowVelocityPolicy
from mmrl.models.flow_sde import (
    sample_step,
    step_distribution,
    step_entropy,
    step_log_prob,
    time_grid,
)
from mmrl.models.latent_family import check_latent_sampling
from mmrl.models.row_noise import RowNoise
from mmrl.protocol import Batch
from mmrl.sampling import FRAME_END_KEY, SamplingParams

PATH_KEY = "flow_path"  # [B, F, S + 1, C, h, w]: each frame's states from noise to its latent
TIMES_KEY = "flow_times"  # [B, S + 1]: the time grid the path was sampled on
MEAN_KEY = "flow_mean"  # [B, F, S, C, h, w]: each step's Gaussian mean as sampled
STD_KEY = "flow_std"  # [B, F*S]: each step's Gaussian std as sampled (0: the ODE's last step)


@register_family("flow_latent")
class FlowLatentFamily(PolicyFamily):
    """A :class:`~mmrl.models.flow_policy.FlowVelocityPolicy` folder (``flow_policy.json``, its
    weights and the ``autoencoder/`` that defines the latents).

    Prompts are the latent family's: ``context_latents [B, K, C, h, w]``, ``actions [B, K+F-1,
    A]``, ``attention_mask [B, K]``; ``max_tokens`` counts predicted frames. :meth:`generate`
    adds ``response_latents [B, F, C, h, w]`` (the denoised latents), ``flow_path`` and
    ``flow_times`` (what :meth:`response_log_probs` recomputes from), ``flow_mean`` and
    ``flow_std`` (each step's Gaussian as sampled), ``response_mask [B, F*S]``
    (0 on each frame's deterministic last step and on steps not drawn for training),
    ``rollout_log_probs [B, F*S]``, ``frame_end_steps [B, F]`` (each frame's last trained step,
    where a per-frame score goes), ``response_clipped [B]`` (all False) and extends
    ``attention_mask`` (and ``position_ids``) to [B, K + F*S].
    """

    module_rollout = "latent"
    auto_bf16 = False  # Gaussian step densities, as the latent family's

    def detect(self, path: Path) -> bool:
        return (path / CONFIG_FILE).is_file()

    def describe(self) -> str:
        return f"a flow policy folder ({CONFIG_FILE}, its weights and autoencoder/)"

    def load(self, path: Path, dtype: str = "float32") -> nn.Module:
        return FlowVelocityPolicy.from_pretrained(path).to(torch_dtype(dtype))

    def save(
        self, model: nn.Module, path: Path, state_dict: dict[str, torch.Tensor], source: Path
    ) -> None:
        # The policy copies the autoencoder/ of the folder it was loaded from (``source``).
        model.save_pretrained(path, state_dict=state_dict)

    def vllm_refusal(self) -> str:
        return (
            f"a {self.name} policy samples its denoising steps on its own module and cannot be "
            f"served by vLLM: set actor_rollout_ref.rollout.name={self.module_rollout}"
        )

    def response_log_probs(
        self,
        model: nn.Module,
        batch: Batch,
        temperature: float = 1.0,
        with_entropy: bool = False,
        entropy_grad: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-densities ``[B, F*S]`` of the recorded steps (and entropies) under ``model``.

        Each step is scored as it was sampled: one forward per (frame, step) over the rows
        (:meth:`step_gaussians`). Steps no row trains are 0.
        """
        path = batch[PATH_KEY]
        b, s = path.shape[0], path.shape[2] - 1
        zeros = path.new_zeros(b)
        log_probs, entropies = [zeros] * (path.shape[1] * s), [zeros] * (path.shape[1] * s)
        dims = path[0, 0, 0].numel()
        for (frame, step), (mean, std) in self.step_gaussians(model, batch, temperature).items():
            log_probs[frame * s + step] = step_log_prob(path[:, frame, step + 1], mean, std)
            entropies[frame * s + step] = step_entropy(std, dims)
        # The noise schedule is fixed, so the entropy has no gradient to keep.
        entropy = torch.stack(entropies, 1) if with_entropy else None
        return torch.stack(log_probs, 1), entropy

    def step_gaussians(
        self, model: nn.Module, batch: Batch, temperature: float = 1.0
    ) -> dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]:
        """Each trained step's Gaussian under ``model``: ``{(frame, step): (mean [B, C, h, w],
        std [B])}``, recomputed from the recorded state, time and context.

        Only the steps some row trains (``response_mask``) are computed. Under a process
        group, every rank computes the union of the ranks' steps, so sharded forwards stay
        paired.
        """
        path, times, mask = batch[PATH_KEY], batch[TIMES_KEY], batch["response_mask"]
        context, actions = batch["context_latents"], batch["actions"]
        b, f, s = path.shape[0], path.shape[1], path.shape[2] - 1
        k = context.shape[1]
        active = mask.reshape(b, f, s).bool().any(0)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            active = active.float()
            dist.all_reduce(active, op=dist.ReduceOp.MAX)
            active = active.bool()
        seq = torch.cat([context, batch["response_latents"][:, :-1]], dim=1)
        noise_level, t_cap = model.cfg.noise_level * temperature, float(times[0, 1])
        gaussians = {}
        for frame, step in active.nonzero().tolist():
            x, t, t_next = path[:, frame, step], times[:, step], times[:, step + 1]
            velocity = model(x, t, seq[:, frame : frame + k], actions[:, frame : frame + k])
            gaussians[frame, step] = step_distribution(x, velocity, t, t_next, noise_level, t_cap)
        return gaussians

    @torch.no_grad()
    def generate(
        self, model: nn.Module, prompts: Batch, sampling: SamplingParams, tokenizer: Any = None
    ) -> Batch:
        cfg = model.cfg
        context, actions = prompts["context_latents"], prompts["actions"]
        (b, k), f, s = context.shape[:2], sampling.max_tokens, cfg.num_steps
        check_latent_sampling(prompts, sampling, "a flow policy's SDE")
        noise = RowNoise.for_rollout(prompts, sampling)
        was_training = model.training
        model.eval()
        grid = time_grid(s).to(context)
        noise_level = cfg.noise_level * (sampling.temperature if sampling.do_sample else 1.0)
        # Every frame's starting noise first: the ODE and the SDE start from the same points.
        starts = noise.randn((f, *context.shape[2:])).transpose(0, 1).to(context)
        window, paths, means, stds, log_probs = context, [], [], [], []
        for frame in range(f):
            act, x = actions[:, frame : frame + k], starts[frame]
            path, frame_means = [x], []
            for step in range(s):
                t, t_next = grid[step].expand(b), grid[step + 1].expand(b)
                velocity = model(x, t, window, act)
                mean, std = step_distribution(x, velocity, t, t_next, noise_level, float(grid[1]))
                if sampling.do_sample:
                    x = sample_step(mean, std, noise)
                else:  # the ODE: Euler's step, scored under the policy's SDE
                    x = step_distribution(x, velocity, t, t_next, 0.0, float(grid[1]))[0]
                log_probs.append(step_log_prob(x, mean, std))
                path.append(x)
                frame_means.append(mean)
                stds.append(std)
            paths.append(torch.stack(path, 1))
            means.append(torch.stack(frame_means, 1))
            window = torch.cat([window[:, 1:], x.unsqueeze(1)], dim=1)
        model.train(was_training)
        mask = trained_steps(b, f, s, cfg.train_steps, step_generator(sampling))
        mask = mask.to(context.device)
        out = prompts.clone()
        out[PATH_KEY] = torch.stack(paths, 1)
        out[TIMES_KEY] = grid.expand(b, s + 1).clone()
        out[MEAN_KEY] = torch.stack(means, 1)
        out[STD_KEY] = torch.stack(stds, 1)
        out["response_latents"] = out[PATH_KEY][:, :, -1].clone()
        out["rollout_log_probs"] = torch.stack(log_probs, 1).float()
        return finish_flow_rollout(out, mask, f, s)


def step_generator(sampling: SamplingParams) -> torch.Generator:
    """The generator of the trained-step subset: seeded by the step's ``sampling.seed`` alone,
    so every rank of a worker group, and a run at any worker count, trains the same steps."""
    generator = torch.Generator()
    if sampling.seed is None:
        generator.seed()
    else:
        generator.manual_seed(sampling.seed)
    return generator


def trained_steps(
    b: int, frames: int, steps: int, train_steps: int, generator: torch.Generator
) -> torch.Tensor:
    """``response_mask [b, frames*steps]``: per frame, ``train_steps`` of the ``steps - 1``
    stochastic steps drawn at random (the same for every row of the call; all when 0); each
    frame's last step, which is deterministic, is never trained."""
    mask = torch.zeros(frames, steps)
    for frame in range(frames):
        picked = torch.randperm(steps - 1, generator=generator)[: train_steps or steps - 1]
        mask[frame, picked] = 1.0
    return mask.flatten().expand(b, -1).clone()


def finish_flow_rollout(out: Batch, mask: torch.Tensor, frames: int, steps: int) -> Batch:
    """Add the response bookkeeping to a sampled batch: ``response_mask``, ``frame_end_steps``,
    ``response_clipped`` and ``attention_mask``/``position_ids`` extended by ``frames*steps``."""
    b, n = mask.shape
    device = mask.device
    out["response_mask"] = mask
    step_index = torch.arange(n, device=device).expand(b, n)
    last = torch.where(mask.bool(), step_index, -1).reshape(b, frames, steps).amax(-1)
    out[FRAME_END_KEY] = last.long()
    out["attention_mask"] = torch.cat(
        [out["attention_mask"], torch.ones(b, n, dtype=torch.long, device=device)], dim=1
    )
    if "position_ids" in out:
        ids = out["position_ids"]
        out["position_ids"] = torch.cat(
            [ids, ids[:, -1:] + torch.arange(1, n + 1, device=ids.device)], dim=1
        )
    out["response_clipped"] = torch.zeros(b, dtype=torch.bool, device=device)
    out.meta["num_clipped"] = 0
    return out
