"""The flow latent family: denoising steps as policy steps. The rollout's records are what the
actor recomputes, the deterministic last step of each frame is masked, per-frame scores land on
kept steps, the ODE is deterministic, it shards with FSDP2 and saves with its autoencoder, and
vLLM refuses it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmrl.errors import ConfigError
from mmrl.hybrid.actor import compute_log_probs
from mmrl.models import get_family, policy_family
from mmrl.models.flow_policy import CONFIG_FILE, FlowPolicyConfig, FlowVelocityPolicy
from mmrl.models.latent_policy import AUTOENCODER_DIR
from mmrl.protocol import Batch
from mmrl.rollout import get_rollout
from mmrl.sampling import FRAME_END_KEY, SamplingParams

FLOW = get_family("flow_latent")
S = 4  # denoising steps per frame


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tensors this small run fastest on one intra-op thread (two threads wait on each other
    when the cores are shared)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def policy(seed: int = 0, **kw) -> FlowVelocityPolicy:
    torch.manual_seed(seed)
    cfg = FlowPolicyConfig(block_out_channels=[8, 16], norm_num_groups=4, num_steps=S, **kw)
    return FlowVelocityPolicy(cfg)


def prompts(b: int = 6, f: int = 2) -> Batch:
    g = torch.Generator().manual_seed(0)
    return Batch.from_dict(
        {
            "context_latents": torch.randn(b, 2, 4, 8, 8, generator=g),
            "actions": torch.rand(b, 2 + f - 1, 2, generator=g) * 2 - 1,
            "attention_mask": torch.ones(b, 2, dtype=torch.long),
            "position_ids": torch.arange(2).expand(b, 2).clone(),
            FRAME_END_KEY: torch.arange(f).expand(b, f).clone(),
        },
        non_tensor={"uid": np.asarray([str(i // 2) for i in range(b)], dtype=object)},
    )


def sampling(f: int = 2, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=f, min_tokens=f, seed=3, **kw)


def rollout(model, batch: Batch, **kw) -> Batch:
    engine = get_rollout("latent")(model=model, family=FLOW)
    return engine.generate(batch, sampling(**kw))


def test_rollout_layout_and_exact_recomputation():
    model, batch = policy(), prompts()
    out = rollout(model, batch, temperature=1.0)
    b, f = 6, 2
    assert out["response_latents"].shape == (b, f, 4, 8, 8)
    assert out["flow_path"].shape == (b, f, S + 1, 4, 8, 8)
    assert out["response_mask"].shape == out["rollout_log_probs"].shape == (b, f * S)
    assert out["attention_mask"].shape == (b, 2 + f * S) and not out["response_clipped"].any()
    # Each frame's last step (to t = 0) is deterministic: masked, no density.
    mask = out["response_mask"].view(b, f, S)
    assert (mask[:, :, -1] == 0).all() and (mask[:, :, :-1] == 1).all()
    assert (out["rollout_log_probs"].view(b, f, S)[:, :, -1] == 0).all()
    assert torch.equal(out["response_latents"], out["flow_path"][:, :, -1])
    assert out[FRAME_END_KEY].tolist() == [[S - 2, 2 * S - 2]] * b  # the last kept step
    # Each step records its Gaussian: the ODE's last step has std 0, the others do not, and
    # the actor's recomputation of each trained step gives the recorded mean and std.
    assert out["flow_mean"].shape == (b, f, S, 4, 8, 8) and out["flow_std"].shape == (b, f * S)
    stds = out["flow_std"].view(b, f, S)
    assert (stds[:, :, -1] == 0).all() and (stds[:, :, :-1] > 0).all()
    with torch.no_grad():
        gaussians = FLOW.step_gaussians(model, out)
    assert sorted(gaussians) == [(fr, st) for fr in range(f) for st in range(S - 1)]
    for (frame, step), (mean, std) in gaussians.items():
        assert torch.equal(mean, out["flow_mean"][:, frame, step])
        assert torch.equal(std, stds[:, frame, step])
    # The actor's recomputation of the identical batch in one micro-batch is bit for bit the
    # sampler's record; split into other, reordered micro-batches it agrees within 1e-4.
    recomputed = compute_log_probs(FLOW, model, out, micro_batch_size=b, temperature=1.0)
    keep = out["response_mask"].bool()
    assert torch.equal(recomputed[keep], out["rollout_log_probs"][keep])
    order = np.array([4, 1, 5, 0, 3, 2])
    shuffled = compute_log_probs(FLOW, model, out[order], micro_batch_size=4, temperature=1.0)
    assert (shuffled - out["rollout_log_probs"][order]).abs()[keep[order]].max() < 1e-4
    # Frame 2's context is frame 1's denoised latent: a changed frame 1 changes frame 2's
    # log-densities, not frame 1's.
    changed = out.clone()
    changed["response_latents"] = out["response_latents"].clone()
    changed["response_latents"][:, 0] += 0.5
    moved = compute_log_probs(FLOW, model, changed, micro_batch_size=b, temperature=1.0)
    assert torch.equal(moved[:, :S], recomputed[:, :S])
    assert (moved[:, S : 2 * S - 1] - recomputed[:, S : 2 * S - 1]).abs().min() > 0


def test_temperature_scales_the_noise_and_the_recomputation_follows_it():
    model, batch = policy(), prompts()
    cold = rollout(model, batch, temperature=0.5)
    hot = rollout(model, batch, temperature=1.0)
    keep = cold["response_mask"].bool()
    # Smaller noise: narrower steps, higher densities at their own samples.
    assert cold["rollout_log_probs"][keep].mean() > hot["rollout_log_probs"][keep].mean()
    again = compute_log_probs(FLOW, model, cold, micro_batch_size=6, temperature=0.5)
    assert torch.equal(again[keep], cold["rollout_log_probs"][keep])
    # Entropies are the Gaussians': half the noise is log(2) less per dimension (256 here).
    _, cold_entropy = FLOW.response_log_probs(model, cold, 0.5, with_entropy=True)
    _, hot_entropy = FLOW.response_log_probs(model, cold, 1.0, with_entropy=True)
    assert (cold_entropy[~keep] == 0).all()
    gap = hot_entropy[keep] - cold_entropy[keep]
    assert torch.allclose(gap, torch.full_like(gap, 256 * np.log(2)), atol=1e-3)


def test_ode_path_is_deterministic_and_seeds_repeat_samples():
    model, batch = policy(), prompts()
    greedy = rollout(model, batch, do_sample=False)
    other_seed = get_rollout("latent")(model=model, family=FLOW).generate(
        batch, SamplingParams(max_tokens=2, min_tokens=2, seed=99, do_sample=False)
    )
    # Only the starting noise differs between seeds; the ODE from it has no noise at all.
    path = greedy["flow_path"]
    grid = greedy["flow_times"][0]
    with torch.no_grad():
        v = model(path[:, 0, 0], grid[0].expand(6), batch["context_latents"],
                  batch["actions"][:, :2])  # fmt: skip
    assert torch.allclose(path[:, 0, 1], path[:, 0, 0] + (grid[1] - grid[0]) * v, atol=1e-6)
    assert not torch.equal(other_seed["response_latents"], greedy["response_latents"])
    repeat = rollout(model, batch, do_sample=False)
    assert torch.equal(repeat["flow_path"], greedy["flow_path"])
    # Greedy reports each step's density under the policy's SDE: what the actor recomputes.
    recomputed = compute_log_probs(FLOW, model, greedy, micro_batch_size=6, temperature=1.0)
    keep = greedy["response_mask"].bool()
    assert torch.equal(recomputed[keep], greedy["rollout_log_probs"][keep])
    sampled = rollout(model, batch)
    assert torch.equal(rollout(model, batch)["flow_path"], sampled["flow_path"])
    assert not torch.equal(sampled["flow_path"], greedy["flow_path"])
    # Noise level 0: the sampler is the ODE even when sampling.
    ode = policy(noise_level=0.0)
    assert torch.equal(
        rollout(ode, batch)["response_latents"], rollout(ode, batch, do_sample=False)[
            "response_latents"]
    )  # fmt: skip


def test_trained_steps_subset_masks_the_rest_and_per_frame_scores_land_on_kept_steps():
    from mmrl.config import load_config
    from mmrl.trainer.experience import apply_scores
    from mmrl.verifiers import VerifierOutput

    model, batch = policy(train_steps=2), prompts(f=3)
    out = rollout(model, batch, f=3)
    mask = out["response_mask"].view(6, 3, S)
    assert (mask.sum(-1) == 2).all() and (mask[:, :, -1] == 0).all()
    assert (mask == mask[:1]).all()  # one draw per rollout call, shared by its rows
    ends = out[FRAME_END_KEY]
    assert (out["response_mask"].gather(1, ends) == 1).all()
    recomputed = compute_log_probs(FLOW, model, out, micro_batch_size=6, temperature=1.0)
    assert (recomputed[~out["response_mask"].bool()] == 0).all()  # untrained steps: not run
    scores = np.arange(18, dtype=np.float32).reshape(6, 3)
    cfg = load_config([])
    placed, _ = apply_scores(out, VerifierOutput(scores=scores, valid=np.ones(6, bool)), cfg)
    token_scores = placed["token_level_scores"]
    assert torch.equal(token_scores.sum(-1), torch.from_numpy(scores).sum(-1))
    assert torch.equal(token_scores.gather(1, ends), torch.from_numpy(scores))


def test_vllm_refuses_a_flow_policy_in_one_line(tmp_path):
    with pytest.raises(ConfigError) as err:
        FLOW.vllm_serving(tmp_path, None)
    message = str(err.value)
    assert "\n" not in message and "flow_latent policy" in message
    assert "cannot be served by vLLM: set actor_rollout_ref.rollout.name=latent" in message


def test_mmrl_train_refuses_vllm_for_the_flow_task_before_any_work(tmp_path, capsys):
    from mmrl.trainer.cli import main

    run, cache = tmp_path / "run", tmp_path / "cache"
    args = [f"trainer.output_dir={run}", f"task.work_dir={cache}"]
    code = main(["train", "task=worldmodel_flow", "actor_rollout_ref.rollout.name=vllm", *args])
    err = capsys.readouterr().err
    assert code == 1
    assert "rollout.name=vllm: a flow_latent policy samples its denoising steps" in err
    assert "set actor_rollout_ref.rollout.name=latent" in err
    assert not run.exists() and not cache.exists()  # nothing pretrained, nothing written


def test_flow_policy_shards_with_fsdp2_and_saves_with_its_autoencoder(tmp_path):
    from mmrl.hybrid import fsdp

    fsdp.init_process_group(0, 1, "cpu", 60.0)
    source = tmp_path / "init"
    policy().save_pretrained(source)
    (source / AUTOENCODER_DIR).mkdir()
    (source / AUTOENCODER_DIR / "config.json").write_text("{}")
    family = policy_family(source)
    assert family is FLOW and family.load_tokenizer(source) is None
    plain = FlowVelocityPolicy.from_pretrained(source)
    sharded = fsdp.shard_model(family.load(source), None)
    out = rollout(plain, prompts())
    recomputed = compute_log_probs(FLOW, sharded, out, 6, 1.0)
    keep = out["response_mask"].bool()
    assert (recomputed - out["rollout_log_probs"]).abs()[keep].max() < 1e-4
    state = fsdp.full_state_dict(sharded, on_every_rank=False)
    family.save(sharded, tmp_path / "saved", state, source=source)
    assert (tmp_path / "saved" / CONFIG_FILE).is_file()
    assert (tmp_path / "saved" / AUTOENCODER_DIR / "config.json").is_file()
    again = FlowVelocityPolicy.from_pretrained(tmp_path / "saved")
    pairs = zip(plain.state_dict().values(), again.state_dict().values(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    n_params = sum(p.numel() for p in FlowVelocityPolicy(FlowPolicyConfig()).parameters())
    assert 100_000 <= n_params <= 500_000  # the default size runs on two CPU cores


def test_config_errors_name_the_setting():
    with pytest.raises(ValueError, match="num_steps=1: a flow policy needs at least 2"):
        FlowPolicyConfig(num_steps=1)
    with pytest.raises(ValueError, match="train_steps=4: expected 0 .all. up to num_steps - 1"):
        FlowPolicyConfig(num_steps=4, train_steps=4)
    with pytest.raises(ValueError, match=r"needs actions \[B, 4, A\], found \[6, 3, 2\]"):
        rollout(policy(), prompts(f=2), f=3)


def test_mmrl_eval_scores_a_flow_policy_folder_greedy_sampled_and_against_copying(tmp_path, capsys):
    """`mmrl eval` reads a flow folder as it reads a Gaussian latent one: ODE and SDE rows, the
    autoencoder's references, and the data's fit checked first."""
    import json

    from mmrl.trainer.eval_worldmodel import main
    from mmrl.worldmodel.data import generate_dataset
    from mmrl.worldmodel.latent_ae import AEConfig, LatentAutoencoder, build_ae_model

    folder = tmp_path / "flow"
    policy().save_pretrained(folder)
    ae = LatentAutoencoder(build_ae_model(AEConfig(block_out_channels=[8, 8, 8]), 32))
    ae.save_pretrained(folder / AUTOENCODER_DIR)
    push = generate_dataset("push", 2, 5, tmp_path / "push", seed=0, progress=False)
    args = ["--model", str(folder), "--data", str(push), "--windows", "3", "--samples", "2"]
    assert main([*args, "--json", str(tmp_path / "m.json")]) == 0
    out = capsys.readouterr().out
    assert "flow-matching latent policy; 3 windows" in out and "env: push" in out
    assert "copy last context frame (through the AE)" in out
    rows = json.loads((tmp_path / "m.json").read_text())
    greedy, sampled = rows["model (greedy)"], rows["model (sampled x2, T=1)"]
    assert all(np.isfinite(greedy[k]) for k in ("psnr", "lpips", "state_match")), greedy
    assert greedy["psnr"] != sampled["psnr"]  # the ODE and the SDE are different decodings
    # The repetition rate is the token models' metric: copying repeats every moving frame.
    assert np.isfinite(greedy["repetition"]) and np.isfinite(sampled["repetition"])
    assert rows["copy last context frame (through the AE)"]["repetition"] == 1.0
    grid = generate_dataset("grid", 1, 5, tmp_path / "grid", seed=0, progress=False)
    with pytest.raises(ValueError, match="actions have dimension 1; the latent policy takes 2"):
        main(["--model", str(folder), "--data", str(grid)])


def test_flow_on_recordings_names_its_videos_task(tmp_path):
    """task=worldmodel_flow_videos needs the folder; the environment recipe's state metric on
    recordings points to the videos task."""
    from mmrl.config import load_config
    from mmrl.tasks import get_task
    from mmrl.worldmodel.latent_ae import AEConfig, LatentAutoencoder, build_ae_model
    from tests.video_data import write_episodes

    with pytest.raises(ValueError, match=r"task=worldmodel_flow_videos .* task.data.videos=DIR"):
        get_task("worldmodel_flow_videos")(load_config(["task=worldmodel_flow_videos"]).task)
    videos = write_episodes(tmp_path / "videos", 4)
    cfg = load_config(
        ["task=worldmodel_flow", f"task.data.videos={videos}", f"task.work_dir={tmp_path / 'w'}"]
    )
    task = get_task(cfg.task["name"])(cfg.task)
    ae = LatentAutoencoder(build_ae_model(AEConfig(block_out_channels=[8, 8, 8]), (48, 64)))
    ae.save_pretrained(tmp_path / "policy" / AUTOENCODER_DIR)
    with pytest.raises(ValueError, match=r"\['state_match'\].*task=worldmodel_flow_videos"):
        task.build_prompt_processor(tmp_path / "policy", cfg)


def test_mmrl_train_names_an_empty_videos_folder_in_one_line(tmp_path, capsys):
    from mmrl.trainer.cli import main

    empty, work = tmp_path / "empty", tmp_path / "work"
    empty.mkdir()
    args = [f"task.data.videos={empty}", f"trainer.output_dir={tmp_path / 'run'}"]
    code = main(["train", "task=worldmodel_flow_videos", *args, f"task.work_dir={work}"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err, err
    assert f"{empty}: no videos (*.mp4" in err and len(err.strip().splitlines()) == 1
    assert not work.exists() and list(empty.iterdir()) == []
