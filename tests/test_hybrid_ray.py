"""Ray mode with real processes: 2 FSDP workers against 1, a `ray start` head, a killed worker.

One local Ray (2 CPUs, a small object store, no dashboard) serves this module;
the `ray start` test runs its own head and its driver in subprocesses.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM

from mmrl.config import load_config
from mmrl.hybrid import ActorRolloutRefWorker, LocalWorkerGroup, WorkerError
from mmrl.hybrid.dispatch import Dispatch, register
from mmrl.protocol import Batch
from mmrl.sampling import SamplingParams
from mmrl.tasks import get_task
from mmrl.tasks.text_addition import build_char_tokenizer
from tests.conftest import run_overrides

pytestmark = pytest.mark.slow
OBJECT_STORE_BYTES = 512 * 2**20


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A random (not warmed-up) addition model and its tokenizer, saved with save_pretrained."""
    task = get_task("text_addition")({"name": "text_addition"})
    tokenizer = build_char_tokenizer()
    torch.manual_seed(0)
    model = task.build_model(tokenizer)
    path = tmp_path_factory.mktemp("tiny") / "model"
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")  # other test files start their own Ray
def local_ray() -> Iterator[None]:
    # 4 logical CPUs on 2 cores: the module-scoped gradient pairs keep their 2-worker group
    # (and its placement group) while later tests place groups of their own.
    ray.init(
        address="local", num_cpus=4, object_store_memory=OBJECT_STORE_BYTES, include_dashboard=False
    )
    yield
    ray.shutdown()


def short_cfg(tmp_path: Path, model_dir: Path, *extra: str):
    return load_config(
        run_overrides(
            tmp_path,
            f"actor_rollout_ref.model.path={model_dir}",
            "trainer.total_steps=1",
            "trainer.test_freq=0",
            "trainer.val_before_train=false",
            "data.train_batch_size=4",
            "actor_rollout_ref.rollout.n=4",
            "trainer.dist_timeout_s=60",
            # These tests hold one worker and two (and vLLM and the actor) to fp32 rounding;
            # bf16 rounds differently for every micro-batch shape.
            "trainer.mixed_precision=fp32",
            *extra,
        )
    )


def update_batch(n: int, vocab: int, prompt_len: int = 5, response_len: int = 6) -> Batch:
    """A PPO batch with responses of different lengths and one invalid sample."""
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, vocab, (n, prompt_len), generator=g)
    responses = torch.randint(3, vocab, (n, response_len), generator=g)
    lengths = torch.arange(n) % response_len + 1
    response_mask = (torch.arange(response_len)[None] < lengths[:, None]).float()
    attention_mask = torch.cat([torch.ones(n, prompt_len), response_mask], dim=1).long()
    old_log_probs = -2.0 + 0.1 * torch.randn(n, response_len, generator=g)
    return Batch.from_dict(
        {
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention_mask,
            "position_ids": torch.arange(prompt_len + response_len).expand(n, -1).clone(),
            "responses": responses,
            "response_mask": response_mask,
            "old_log_probs": old_log_probs,
            "ref_log_prob": old_log_probs + 0.05 * torch.randn(n, response_len, generator=g),
            "advantages": torch.randn(n, response_len, generator=g) * response_mask,
            "valid_mask": torch.arange(n) != 2,
        }
    )


def test_two_fsdp_workers_update_like_one(tmp_path, tiny_model_dir, local_ray):
    from mmrl.hybrid.ray_group import RayWorkerGroup, ResourcePool

    # One optimizer step over all 8 samples, accumulated over micro-batches of up to 3:
    # [3, 3, 2] rows on one worker, [3, 1] on each of two. Token counts differ per micro-batch.
    cfg = short_cfg(
        tmp_path,
        tiny_model_dir,
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size=3",
        "actor_rollout_ref.actor.lr=1e-3",
    )
    args = ("actor", ActorRolloutRefWorker, cfg, tiny_model_dir, True)
    one = LocalWorkerGroup.spawn(*args, device_type="cpu", timeout_s=60)
    two = RayWorkerGroup.spawn(
        ResourcePool(1, 2, cpus_per_worker=1), *args, device_type="cpu", timeout_s=60
    )
    try:
        vocab = AutoModelForCausalLM.from_pretrained(tiny_model_dir).config.vocab_size
        batch = update_batch(8, vocab)
        # 7 rows do not divide over 2 ranks: padded, then cut back, in order. Positions past a
        # response's end are not computed (a rank trims its micro-batch to the longest response
        # it holds), so only response tokens are compared.
        mask = batch[:7]["response_mask"].bool()
        two_lp, one_lp = two.compute_log_prob(batch[:7]), one.compute_log_prob(batch[:7])
        assert torch.allclose(two_lp[mask], one_lp[mask], atol=1e-5)
        # Greedy decoding of 5 prompts: each rank decodes under its gathered full weights.
        prompts = Batch.from_dict(
            {k: batch[k][:5, :5] for k in ("input_ids", "attention_mask", "position_ids")}
        )
        greedy = SamplingParams(max_tokens=4, do_sample=False)
        assert torch.equal(
            two.generate_sequences(prompts, greedy)["responses"],
            one.generate_sequences(prompts, greedy)["responses"],
        )

        initial = one.full_state_dict()[0]
        metrics_one = one.update_actor(batch.clone(), seed=1)
        metrics_two = two.update_actor(batch.clone(), seed=1)
        after_one, after_two = one.full_state_dict()[0], two.full_state_dict()
        assert after_two[1] == {}  # gathered onto rank 0 only
        assert max((after_one[k] - after_two[0][k]).abs().max().item() for k in after_one) < 1e-5
        assert max((after_one[k] - initial[k]).abs().max().item() for k in after_one) > 1e-4
        assert metrics_two["actor/grad_norm"] == pytest.approx(
            metrics_one["actor/grad_norm"], rel=1e-4
        )

        saved = two.save_pretrained(tmp_path / "saved")[0]
        reloaded = AutoModelForCausalLM.from_pretrained(saved, local_files_only=True).state_dict()
        assert all(torch.equal(reloaded[k], after_two[0][k]) for k in reloaded)
    finally:
        two.shutdown()


# (policy loss, aggregation mode): every mode once, every policy loss once.
GRADIENT_CASES = [
    ("vanilla", "token-mean"),
    ("vanilla", "seq-mean-token-sum"),
    ("cispo", "seq-mean-token-mean"),
    ("cispo", "seq-mean-token-sum-norm"),
    ("gspo", "token-mean"),  # GSPO's own sequence mean under a token-mean actor setting
]


@pytest.fixture(scope="module")
def worker_pairs(tmp_path_factory, tiny_model_dir, local_ray):
    """``{role: (one worker, two workers)}``: one actor per case, a critic and a VLM actor,
    all on one pair of Ray processes (colocated roles) and one in-process rank."""
    from mmrl.hybrid import CriticWorker
    from mmrl.hybrid.ray_group import RayWorkerGroup, ResourcePool
    from mmrl.models.tiny_vlm import build_tiny_qwen2_vl

    tmp = tmp_path_factory.mktemp("pairs")
    # One optimizer step over the whole batch (mini-batch = batch), accumulated over
    # micro-batches of 3 rows: [3, 3, 2] on one rank, [3, 1] on each of two. No clipping,
    # every loss term on: the gradients must be equal, not only their signs.
    common = (
        "actor_rollout_ref.actor.ppo_micro_batch_size=3",
        "actor_rollout_ref.actor.grad_clip=1e6",
        "actor_rollout_ref.actor.entropy_coeff=0.01",
        "actor_rollout_ref.actor.kl_loss_coef=0.1",
        "critic.ppo_micro_batch_size=3",
        "critic.grad_clip=1e6",
        "critic.loss_agg_mode=seq-mean-token-mean",
    )
    roles = {}
    for loss, mode in GRADIENT_CASES:
        cfg = short_cfg(
            tmp,
            tiny_model_dir,
            *common,
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            f"actor_rollout_ref.actor.policy_loss.loss_mode={loss}",
            f"actor_rollout_ref.actor.loss_agg_mode={mode}",
        )
        roles[f"{loss}/{mode}"] = (ActorRolloutRefWorker, (cfg, tiny_model_dir, True))
    cfg = short_cfg(tmp, tiny_model_dir, *common, "actor_rollout_ref.actor.ppo_mini_batch_size=2")
    roles["critic"] = (CriticWorker, (cfg, tiny_model_dir))
    vlm_dir = build_tiny_qwen2_vl(tmp / "vlm", seed=2)
    cfg = short_cfg(
        tmp,
        vlm_dir,
        *common,
        "actor_rollout_ref.rollout.n=2",
        "data.train_batch_size=3",
        "actor_rollout_ref.actor.ppo_mini_batch_size=3",  # 3 prompts x 2 samples
        "data.max_prompt_length=64",
    )
    roles["vlm"] = (ActorRolloutRefWorker, (cfg, vlm_dir, True))

    pairs, first = {}, None
    for role, (cls, args) in roles.items():
        one = LocalWorkerGroup.spawn(role, cls, *args, device_type="cpu", timeout_s=60)
        if first is None:
            pool = ResourcePool(1, 2, cpus_per_worker=1)
            first = two = RayWorkerGroup.spawn(
                pool, role, cls, *args, device_type="cpu", timeout_s=60
            )
        else:
            two = first.colocate(role, cls, *args)
        pairs[role] = (one, two)
    pairs["vlm_dir"] = vlm_dir
    yield pairs
    first.shutdown()


def assert_same_gradients(one, two) -> None:
    (g1,), (g2, rest) = one.full_grads(), two.full_grads()
    assert rest == {} and set(g1) == set(g2) and g1
    scale = max(g.abs().max().item() for g in g1.values())
    assert scale > 1e-6, "zero gradient: the comparison shows nothing"
    for name, g in g1.items():
        diff = (g2[name] - g).abs().max().item()
        torch.testing.assert_close(
            g2[name], g, rtol=1e-4, atol=1e-6 * scale, msg=f"{name}: {diff:.3g} of {scale:.3g}"
        )


@pytest.mark.parametrize("case", [f"{loss}/{mode}" for loss, mode in GRADIENT_CASES])
def test_two_workers_compute_the_gradient_of_one(worker_pairs, tiny_model_dir, case):
    """Every aggregation mode: each micro-batch's weight counts tokens (or rows) over both
    ranks, so the sum over ranks and micro-batches is the whole batch's loss."""
    one, two = worker_pairs[case]
    vocab = AutoModelForCausalLM.from_pretrained(tiny_model_dir).config.vocab_size
    batch = update_batch(8, vocab)
    batch["old_log_probs"] = batch["old_log_probs"] + 0.4 * torch.randn(
        batch["old_log_probs"].shape, generator=torch.Generator().manual_seed(5)
    )  # ratios far enough from 1 that clipping is active
    one.update_actor(batch.clone(), seed=1)
    two.update_actor(batch.clone(), seed=1)
    assert_same_gradients(one, two)


def test_two_critic_workers_compute_the_gradient_of_one(worker_pairs, tiny_model_dir):
    one, two = worker_pairs["critic"]
    vocab = AutoModelForCausalLM.from_pretrained(tiny_model_dir).config.vocab_size
    batch = update_batch(8, vocab)
    values = one.compute_values(batch)
    assert torch.allclose(two.compute_values(batch), values, atol=1e-5)
    batch["values"] = values
    g = torch.Generator().manual_seed(7)
    batch["returns"] = (values + torch.randn(values.shape, generator=g)) * batch["response_mask"]
    one.update_critic(batch.clone(), seed=1)
    two.update_critic(batch.clone(), seed=1)
    assert_same_gradients(one, two)


def test_two_workers_compute_the_gradient_of_one_on_a_vlm_batch(worker_pairs):
    """Images of different sizes, a text-only prompt, mrope positions: each rank collates its
    own rows' visual inputs."""
    from mmrl.config import DataConfig
    from mmrl.processors import VisionProcessor
    from tests.test_vlm_training import prompts

    one, two = worker_pairs["vlm"]
    proc = VisionProcessor.from_pretrained(
        worker_pairs["vlm_dir"], DataConfig(max_prompt_length=64)
    )
    batch = one.generate_sequences(prompts(proc, n=2), SamplingParams(max_tokens=5, seed=3))
    batch["old_log_probs"] = one.compute_log_prob(batch)
    assert torch.allclose(two.compute_log_prob(batch), batch["old_log_probs"], atol=1e-5)
    g = torch.Generator().manual_seed(9)
    mask = batch["response_mask"]
    batch["ref_log_prob"] = batch["old_log_probs"] + 0.1 * torch.randn(mask.shape, generator=g)
    batch["advantages"] = torch.randn(len(batch), 1, generator=g) * mask
    batch["valid_mask"] = torch.ones(len(batch), dtype=torch.bool)
    one.update_actor(batch.clone(), seed=1)
    two.update_actor(batch.clone(), seed=1)
    assert_same_gradients(one, two)


def test_vllm_engines_in_two_fsdp_workers_follow_every_update(tmp_path, tiny_model_dir, local_ray):
    """Each rank's in-process vLLM engine samples for its chunk; after an update the
    weights gathered from the FSDP shards are in every engine: the engines' sampling
    log-probs equal the sharded actor's recomputed ones."""
    from mmrl.hybrid.ray_group import RayWorkerGroup, ResourcePool

    cfg = short_cfg(
        tmp_path,
        tiny_model_dir,
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.kv_cache_memory_gib=0.0625",
        "actor_rollout_ref.actor.lr=1e-2",
    )
    two = RayWorkerGroup.spawn(
        ResourcePool(1, 2, cpus_per_worker=1),
        "actor",
        ActorRolloutRefWorker,
        cfg,
        tiny_model_dir,
        True,
        device_type="cpu",
        timeout_s=60,
    )
    try:
        vocab = AutoModelForCausalLM.from_pretrained(tiny_model_dir).config.vocab_size
        batch = update_batch(8, vocab)
        prompts = Batch.from_dict(
            {k: batch[k][:7, :5] for k in ("input_ids", "attention_mask", "position_ids")}
        )
        sampling = SamplingParams(max_tokens=6, temperature=1.0, seed=3)
        before = two.generate_sequences(prompts, sampling)
        assert len(before) == 7  # 7 prompts over 2 ranks: padded, then cut back
        two.update_actor(batch, seed=1)  # a large step: the sampled distribution moves
        after = two.generate_sequences(prompts, sampling)
        recomputed = two.compute_log_prob(after)
        mask = after["response_mask"].bool()
        assert (after["rollout_log_probs"] - recomputed).abs()[mask].max() < 1e-4
        stale = two.compute_log_prob(before)  # the old samples under the new weights
        assert (before["rollout_log_probs"] - stale).abs()[
            before["response_mask"].bool()
        ].max() > 1e-3
    finally:
        two.shutdown()


def test_killed_worker_is_named_with_its_step(tmp_path, tiny_model_dir, local_ray, monkeypatch):
    from mmrl.trainer import fit as fit_module

    killed_at, real_build = [], fit_module.build_workers

    def build_with_a_fault(*args, **kwargs):
        workers = real_build(*args, **kwargs)
        actor, real_call = workers.actor, workers.actor.update_actor

        def kill_rank_1_then_call(*call_args, **call_kwargs):
            # Mid-step: after generation and scoring, rank 1's process dies just before the
            # update (the one call every step makes; on-policy runs skip the old log-prob pass).
            ray.kill(actor.hosts[1])
            killed_at.append(time.monotonic())
            return real_call(*call_args, **call_kwargs)

        actor.update_actor = kill_rank_1_then_call
        return workers

    monkeypatch.setattr(fit_module, "build_workers", build_with_a_fault)
    cfg = short_cfg(tmp_path, tiny_model_dir, "trainer.n_workers_per_node=2")
    pattern = (
        r"rank 1 of 2 in group 'actor' \(pid \d+ on .+\) died during update_actor at RL step 1"
    )
    with pytest.raises(WorkerError, match=pattern):
        fit_module.fit(cfg)
    assert time.monotonic() - killed_at[0] < 20, "the failure was not reported promptly"


def test_separate_critic_group_on_the_session_cluster(tmp_path, tiny_model_dir, local_ray):
    from mmrl.trainer.fit import fit

    cfg = short_cfg(
        tmp_path,
        tiny_model_dir,
        "trainer.ray_address=auto",
        "trainer.n_workers_per_node=2",
        "trainer.ray_num_cpus_per_worker=0.5",
        "trainer.colocate_critic=false",
        "algorithm.adv_estimator=gae",
    )
    row = fit(cfg).history[-1]
    assert "critic/vf_loss" in row and "critic/values/mean" in row
    deadline = time.monotonic() + 30
    while ray.available_resources().get("CPU") != 2:  # every bundle is given back
        assert time.monotonic() < deadline, ray.available_resources()
        time.sleep(0.5)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def ray_head(log_path: Path, env: dict[str, str]) -> Iterator[str]:
    """A Ray head in the foreground (`--block`), reached on loopback; terminating it stops this
    cluster.

    `ray stop` would stop every Ray on the machine, other users' included.
    """
    port, temp_dir = (
        free_port(),
        tempfile.mkdtemp(prefix="ray", dir="/tmp"),
    )  # short: socket paths are limited
    command = [
        str(Path(sys.executable).parent / "ray"),
        "start",
        "--head",
        f"--port={port}",
        "--num-cpus=2",
        f"--object-store-memory={OBJECT_STORE_BYTES}",
        "--include-dashboard=false",
        "--disable-usage-stats",
        f"--temp-dir={temp_dir}",
        "--block",
    ]
    with open(log_path, "w") as log:
        head = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 90
        while "will now block" not in log_path.read_text():
            if head.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ray start failed:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.5)
        yield f"127.0.0.1:{port}"
    finally:
        head.terminate()
        head.wait(timeout=90)
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_train_through_a_ray_start_head(tmp_path, tiny_model_dir):
    # Ray 2.60 clusters check a token; head and driver share one made for this test.
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    with ray_head(tmp_path / "head.log", env) as address:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "mmrl.trainer.cli",
                "train",
                *run_overrides(tmp_path / "run", f"actor_rollout_ref.model.path={tiny_model_dir}"),
                f"trainer.ray_address={address}",
                "trainer.n_workers_per_node=2",
                "algorithm.adv_estimator=gae",
                "trainer.total_steps=2",
                "trainer.test_freq=0",
                "trainer.val_before_train=false",
                "data.train_batch_size=4",
                "actor_rollout_ref.rollout.n=4",
            ],
            capture_output=True,
            text=True,
            timeout=400,
            env=env,
        )
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    rows = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in rows] == [1, 2]
    assert "critic/vf_loss" in rows[-1] and "timing_s/update_weights" in rows[-1]
    assert (tmp_path / "run" / "actor" / "config.json").is_file()


def test_expected_error_in_a_worker_arrives_short_with_its_rank(tmp_path, local_ray):
    from mmrl.errors import CheckpointError
    from mmrl.hybrid.ray_group import RayWorkerGroup, ResourcePool

    not_a_model = tmp_path / "not_a_model"
    not_a_model.mkdir()
    cfg = short_cfg(tmp_path, not_a_model)
    with pytest.raises(CheckpointError) as err:
        RayWorkerGroup.spawn(
            ResourcePool(1, 1, cpus_per_worker=1),
            "actor",
            ActorRolloutRefWorker,
            cfg,
            not_a_model,
            False,
            device_type="cpu",
            timeout_s=60,
        )
    short = err.value.short()
    assert short.startswith("rank 0 of 1") and "holds no known policy" in short
    assert "Traceback" not in short and len(short.splitlines()) <= 2


class _BrokenCollective:
    """Rank 1's process is killed; rank 0 reports the broken collective before Ray notices."""

    def __init__(self) -> None:
        self.rank = torch.distributed.get_rank()

    @register(Dispatch.ALL)
    def all_reduce(self) -> None:
        if self.rank == 0:
            raise RuntimeError("Read error [127.0.0.1]:5019: Connection reset by peer")
        time.sleep(2.0)
        os.kill(os.getpid(), 9)


def test_a_peer_error_caused_by_a_killed_rank_is_reported_as_the_death(local_ray):
    """Only a death can be restarted from (trainer.max_restarts), so the connection error it
    causes on the surviving rank must not be what the driver reports."""
    from mmrl.hybrid.ray_group import RayWorkerGroup, ResourcePool

    # The workers cannot import this test module, so its class travels by value.
    module = sys.modules[__name__]
    ray.cloudpickle.register_pickle_by_value(module)
    try:
        group = RayWorkerGroup.spawn(
            ResourcePool(1, 2, cpus_per_worker=1),
            "broken",
            _BrokenCollective,
            device_type="cpu",
            timeout_s=60,
        )
        with pytest.raises(WorkerError) as err:
            group.all_reduce()
    finally:
        ray.cloudpickle.unregister_pickle_by_value(module)
    assert err.value.worker_died and err.value.rank == 1, str(err.value)
    assert "rank 1 of 2 in group 'broken'" in str(err.value)
