"""Policy families: chosen once from a checkpoint's files, and the only place that knows a
model's kind. The actor's log-probs, the rollout engine and checkpoint saving go through them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mmrl.hybrid.actor import compute_log_probs
from mmrl.models import FAMILIES, get_family, policy_family, register_family
from mmrl.models.latent_family import LatentFamily
from mmrl.models.latent_policy import AUTOENCODER_DIR, GaussianLatentPolicy, LatentPolicyConfig
from mmrl.models.tiny_vlm import build_tiny_qwen2_vl
from mmrl.processors import TextProcessor
from mmrl.protocol import Batch
from mmrl.rollout import get_rollout
from mmrl.sampling import SamplingParams
from tests.conftest import save_tiny_qwen2


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """One real tiny checkpoint folder per kind."""
    root = tmp_path_factory.mktemp("families")
    latent = root / "latent"
    torch.manual_seed(0)
    GaussianLatentPolicy(LatentPolicyConfig(hidden=16)).save_pretrained(latent)
    (latent / AUTOENCODER_DIR).mkdir()
    (latent / AUTOENCODER_DIR / "config.json").write_text("{}")
    return {
        "text_lm": save_tiny_qwen2(root / "lm", tied=False, seed=1),
        "vlm": build_tiny_qwen2_vl(root / "vlm", seed=2),
        "latent": latent,
    }


def test_each_checkpoint_picks_its_family(checkpoints):
    for name, path in checkpoints.items():
        assert policy_family(path) is get_family(name)
    assert get_family("text_lm").has_critic and not get_family("vlm").has_critic


def test_an_unknown_folder_names_itself_and_every_kind(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError) as err:
        policy_family(tmp_path)
    message = str(err.value)
    assert str(tmp_path) in message and "no known policy" in message and "weights.bin" in message
    assert all(name in message for name in ("text_lm", "vlm", "latent", "latent_policy.json"))
    with pytest.raises(FileNotFoundError, match="is not a folder"):
        policy_family(tmp_path / "missing")
    with pytest.raises(ValueError, match="known: flow_latent, latent, text_lm, vlm"):
        get_family("diffusion")


def test_a_folder_of_two_kinds_is_an_error(checkpoints, tmp_path):
    both = tmp_path / "both"
    both.mkdir()
    for folder in (checkpoints["latent"], checkpoints["text_lm"]):
        for f in folder.iterdir():
            if f.is_file():
                (both / f.name).write_bytes(f.read_bytes())
    with pytest.raises(FileNotFoundError, match="holds 2 kinds of policy"):
        policy_family(both)


def text_prompts(tokenizer) -> Batch:
    return TextProcessor(tokenizer, max_prompt_length=8).encode_prompts(["12+34=", "1+2="])


def latent_prompts(f: int = 2) -> Batch:
    g = torch.Generator().manual_seed(0)
    return Batch.from_dict(
        {
            "context_latents": torch.randn(3, 2, 4, 8, 8, generator=g),
            "actions": torch.randn(3, 2 + f - 1, 2, generator=g),
            "attention_mask": torch.ones(3, 2, dtype=torch.long),
        }
    )


@pytest.mark.parametrize("kind", ["text_lm", "latent"])
def test_engine_actor_and_save_go_through_the_family(checkpoints, kind, tmp_path):
    """The hf engine samples with the family, the actor's recomputation agrees, and a saved
    checkpoint is picked up as the same kind with the same weights."""
    family = policy_family(checkpoints[kind])
    model = family.load(checkpoints[kind])
    tokenizer = family.load_tokenizer(checkpoints[kind])
    assert (tokenizer is None) == (kind == "latent")
    engine = get_rollout("hf")(model=model, family=family, tokenizer=tokenizer)
    prompts = latent_prompts() if kind == "latent" else text_prompts(tokenizer)
    out = engine.generate(prompts, SamplingParams(max_tokens=2, temperature=0.8, seed=0))
    mask = out["response_mask"].bool()
    recomputed = compute_log_probs(family, model, out, micro_batch_size=2, temperature=0.8)
    assert (recomputed - out["rollout_log_probs"]).abs()[mask].max() < 1e-3

    family.save(model, tmp_path / "saved", model.state_dict(), source=checkpoints[kind])
    assert policy_family(tmp_path / "saved") is family
    again = family.load(tmp_path / "saved")
    pairs = zip(model.state_dict().values(), again.state_dict().values(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)


def test_vlm_family_saves_its_processor_and_has_no_critic(checkpoints, tmp_path):
    family = policy_family(checkpoints["vlm"])
    model = family.load(checkpoints["vlm"])
    family.save(model, tmp_path / "saved", model.state_dict(), source=checkpoints["vlm"])
    assert (tmp_path / "saved" / "processor_config.json").is_file()
    assert policy_family(tmp_path / "saved") is family
    serving = family.vllm_serving(checkpoints["vlm"], family.load_tokenizer(checkpoints["vlm"]))
    assert serving.multimodal and set(serving.placeholder_ids) <= set(serving.suppressed_token_ids)
    with pytest.raises(ValueError, match="vlm policy has no critic.*adv_estimator=gae"):
        family.load_critic(checkpoints["vlm"])
    with pytest.raises(ValueError, match="latent policy cannot be served by vLLM"):
        get_family("latent").vllm_serving(checkpoints["latent"], None)


def test_a_new_kind_is_one_family_and_one_registration(checkpoints, tmp_path):
    """A family registered from outside mmrl is detected, sampled and scored with no other
    change (here: a latent policy stored under a different marker file)."""
    folder = tmp_path / "toy"
    folder.mkdir()
    (folder / "toy_policy").write_text(str(checkpoints["latent"]))

    @register_family("toy")
    class ToyFamily(LatentFamily):
        def detect(self, path: Path) -> bool:
            return (path / "toy_policy").is_file()

        def describe(self) -> str:
            return "a toy_policy file naming a latent policy folder"

        def load(self, path: Path, dtype: str = "float32") -> torch.nn.Module:
            return super().load(Path((path / "toy_policy").read_text()), dtype)

    try:
        family = policy_family(folder)
        assert family.name == "toy"
        model = family.load(folder)
        out = get_rollout("hf")(model=model, family=family).generate(
            latent_prompts(), SamplingParams(max_tokens=2, seed=1)
        )
        recomputed = compute_log_probs(family, model, out, micro_batch_size=3, temperature=1.0)
        assert (recomputed - out["rollout_log_probs"]).abs().max() < 1e-3
    finally:
        FAMILIES.pop("toy")
