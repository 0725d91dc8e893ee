"""Built-in verifiers against independent references: frame metrics, format, math, closed loop."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmrl.protocol import Batch
from mmrl.verifiers import (
    ClosedLoopSample,
    aggregate_frames,
    get_verifier,
    register_task_score,
    to_unit_float,
)
from mmrl.verifiers.image import ssim_per_frame
from mmrl.verifiers.reasoning import extract_answer, math_equal


def frame_batch(pred: np.ndarray, gt: np.ndarray, **non_tensor) -> Batch:
    return Batch.from_dict(
        {"pred_frames": torch.from_numpy(pred), "gt_frames": torch.from_numpy(gt)}, non_tensor
    )


def random_frames(b=3, f=2, h=24, w=20, seed=0, noise=0.1) -> tuple[np.ndarray, np.ndarray]:
    """float32 [b, f, h, w, 3] targets in [0, 1] and predictions = targets + noise, clipped."""
    rng = np.random.default_rng(seed)
    gt = rng.random((b, f, h, w, 3)).astype(np.float32)
    pred = np.clip(gt + noise * rng.standard_normal(gt.shape), 0, 1).astype(np.float32)
    return pred, gt


# ----- independent numpy references ------------------------------------------------------


def ref_psnr(p: np.ndarray, g: np.ndarray) -> float:
    return 10 * np.log10(1.0 / np.mean((p.astype(np.float64) - g) ** 2))


def ref_ssim(p: np.ndarray, g: np.ndarray) -> float:
    """Wang et al. 2004 SSIM, Gaussian window 11 / sigma 1.5, mean over pixels and channels. [H, W,
    3].

    Border handling as torchmetrics does it: reflect padding, every pixel averaged.
    """
    x = np.arange(11) - 5
    k = np.exp(-(x**2) / (2 * 1.5**2))
    k /= k.sum()

    def blur(a):  # separable Gaussian filter over a reflect-padded image, same size out
        padded = np.pad(a, 5, mode="reflect")
        rows = sum(k[j] * padded[j : j + a.shape[0], :] for j in range(11))
        return sum(k[j] * rows[:, j : j + a.shape[1]] for j in range(11))

    c1, c2 = 0.01**2, 0.03**2
    out = []
    for c in range(3):
        a, b = p[..., c].astype(np.float64), g[..., c].astype(np.float64)
        mu_a, mu_b = blur(a), blur(b)
        var_a, var_b = np.maximum(blur(a * a) - mu_a**2, 0), np.maximum(blur(b * b) - mu_b**2, 0)
        cov = blur(a * b) - mu_a * mu_b
        s = ((2 * mu_a * mu_b + c1) * (2 * cov + c2)) / (
            (mu_a**2 + mu_b**2 + c1) * (var_a + var_b + c2)
        )
        out.append(s.mean())
    return float(np.mean(out))


@pytest.mark.parametrize(
    ("name", "ref"),
    [
        ("psnr", ref_psnr),
        ("ssim", ref_ssim),
        ("mae", lambda p, g: np.abs(p.astype(np.float64) - g).mean()),
        ("mse", lambda p, g: ((p.astype(np.float64) - g) ** 2).mean()),
    ],
)
def test_frame_metrics_match_numpy_references(name, ref):
    pred, gt = random_frames()
    out = get_verifier(name)(frame_batch(pred, gt))
    expected = [
        np.mean([ref(pred[i, t], gt[i, t]) for t in range(pred.shape[1])]) for i in range(len(pred))
    ]
    np.testing.assert_allclose(out.scores, expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(
        out.metrics["last_frame"],
        [ref(pred[i, -1], gt[i, -1]) for i in range(3)],
        rtol=1e-4,
        atol=1e-5,
    )


@pytest.mark.parametrize("shape", [(11, 11), (48, 64), (64, 64), (33, 20)])
def test_ssim_is_torchmetrics_ssim(shape):
    """The banded-matrix Gaussian filter computes torchmetrics' SSIM (its defaults)."""
    from torchmetrics.functional.image import structural_similarity_index_measure

    gen = torch.Generator().manual_seed(0)
    gt = torch.rand(6, 3, *shape, generator=gen)
    pred = (gt + 0.2 * torch.randn(gt.shape, generator=gen)).clamp(0, 1)
    pred[0] = gt[0]  # identical frames: SSIM 1
    want = structural_similarity_index_measure(pred, gt, data_range=1.0, reduction="none")
    torch.testing.assert_close(ssim_per_frame(pred, gt), want, rtol=0, atol=1e-6)


def test_uint8_and_float_frames_give_the_same_scores():
    rng = np.random.default_rng(1)
    gt8 = rng.integers(0, 256, (2, 3, 16, 16, 3), dtype=np.uint8)
    pred8 = rng.integers(0, 256, (2, 3, 16, 16, 3), dtype=np.uint8)
    as_float = frame_batch(pred8.astype(np.float32) / 255, gt8.astype(np.float32) / 255)
    for name in ("psnr", "mae", "ssim"):
        a, b = get_verifier(name)(frame_batch(pred8, gt8)), get_verifier(name)(as_float)
        np.testing.assert_allclose(a.scores, b.scores, rtol=1e-5)


def test_frame_convention_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"\[B, F, H, W, 3\].*\[2, 3, 8, 8\]"):
        to_unit_float(torch.zeros(2, 3, 8, 8))
    with pytest.raises(KeyError, match="gt_frames"):
        get_verifier("psnr")(Batch.from_dict({"pred_frames": torch.zeros(1, 1, 8, 8, 3)}))
    single = to_unit_float(torch.full((2, 8, 8, 3), 255, dtype=torch.uint8))
    assert single.shape == (2, 1, 8, 8, 3) and float(single.max()) == 1.0


def test_identical_frames_psnr_is_capped_and_errors_are_zero():
    pred, gt = random_frames(noise=0.0)
    batch = frame_batch(gt, gt)
    assert np.all(get_verifier("psnr")(batch).scores == 100.0)
    assert np.all(get_verifier("mae")(batch).scores == 0.0)
    np.testing.assert_allclose(get_verifier("ssim")(batch).scores, 1.0, atol=1e-6)


def test_aggregate_frames_mean_last_discounted():
    values = torch.tensor([[1.0, 2.0, 4.0], [3.0, 3.0, 3.0]])
    torch.testing.assert_close(aggregate_frames(values, "mean"), torch.tensor([7 / 3, 3.0]))
    torch.testing.assert_close(aggregate_frames(values, "last"), torch.tensor([4.0, 3.0]))
    g = 0.5
    expected = (1 + 2 * g + 4 * g * g) / (1 + g + g * g)
    torch.testing.assert_close(
        aggregate_frames(values, "discounted", g), torch.tensor([expected, 3.0])
    )
    torch.testing.assert_close(
        aggregate_frames(values, "discounted", 1.0), aggregate_frames(values, "mean")
    )
    with pytest.raises(ValueError, match="not one of"):
        aggregate_frames(values, "median")


def test_frame_verifier_aggregation_kwargs():
    pred, gt = random_frames(f=4, seed=3)
    pred[:, -1] = gt[:, -1]  # a perfect last frame
    batch = frame_batch(pred, gt)
    assert np.all(get_verifier("mae")(batch, aggregate="last").scores == 0.0)
    mean = get_verifier("mae")(batch).scores
    discounted = get_verifier("mae")(batch, aggregate="discounted", gamma=0.5).scores
    assert np.all(discounted > mean)  # early frames (with error) weigh more


# ----- text: format and math ------------------------------------------------------------


def text_batch(responses: list[str], truths: list[str] | None = None) -> Batch:
    truths = truths if truths is not None else [""] * len(responses)
    return Batch.from_dict(non_tensor={"response_text": responses, "ground_truth": truths})


def test_format_reward():
    responses = [
        "<think>2+2 is 4</think><answer>4</answer>",
        "  <think>multi\nline</think>\n<answer>x</answer>\n",
        "<answer>4</answer>",
        "<think>a</think><answer>4</answer> trailing",
        "<think>a</think>",
    ]
    assert get_verifier("format")(text_batch(responses)).scores.tolist() == [1, 1, 0, 0, 0]


@pytest.mark.parametrize(
    ("answer", "truth", "equal"),
    [
        ("\\frac{1}{2}", "0.5", True),
        ("1/2", "\\frac{1}{2}", True),
        ("\\boxed{3}", "3", True),
        ("x = 3", "3", True),
        ("\\sqrt{4}", "2", True),
        ("3", "4", False),
        ("\\{1, 2\\}", "\\{2, 1\\}", True),
        ("no answer", "7", False),
    ],
)
def test_math_equal(answer, truth, equal):
    assert math_equal(answer, truth) is equal


def test_math_answer_reads_the_answer_tag():
    responses = [
        "<think>half</think><answer>\\frac{2}{4}</answer>",
        "<think>hmm</think><answer>3</answer>",
        "0.5",
    ]
    out = get_verifier("math_answer")(text_batch(responses, ["0.5", "0.5", "1/2"]))
    assert out.scores.tolist() == [1.0, 0.0, 1.0]
    assert out.metrics["has_answer_tag"].tolist() == [1.0, 1.0, 0.0]
    assert extract_answer("<answer> a </answer> then <answer>b</answer>") == "b"


def test_choice_answer_compares_words_not_symbols():
    responses = [
        "<think>x</think><answer> Red </answer>",
        "<think>x</think><answer>der</answer>",
        "blue",
        "<answer>B</answer>",
    ]
    out = get_verifier("choice_answer")(text_batch(responses, ["red", "red", "blue", "b"]))
    assert out.scores.tolist() == [
        1.0,
        0.0,
        1.0,
        1.0,
    ]  # math_answer calls "der" equal to "red" (d*e*r)
    assert out.metrics["has_answer_tag"].tolist() == [1.0, 1.0, 0.0, 1.0]


# ----- closed loop ---------------------------------------------------------------------------


class ToyEnv:
    """An environment whose true next frame brightness is ``level``."""

    def __init__(self, level: float) -> None:
        self.level = level

    def reset(self, seed=None):
        return self.level

    def step(self, action):
        return self.level


@register_task_score("toy_brightness")
def toy_brightness(sample: ClosedLoopSample) -> float:
    """1 - |predicted brightness - the environment's level|."""
    assert sample.predicted_frames.shape[-1] == 3 and sample.predicted_frames.dtype == torch.float32
    return 1.0 - abs(float(sample.predicted_frames.mean()) - sample.env.reset())


def test_closed_loop_gets_env_handles_from_field_or_factory():
    frames = torch.stack([torch.full((2, 8, 8, 3), v) for v in (0.2, 0.5)])
    batch = Batch.from_dict({"pred_frames": frames}, {"env": [ToyEnv(0.2), ToyEnv(0.0)]})
    np.testing.assert_allclose(
        get_verifier("closed_loop")(batch, task="toy_brightness").scores, [1.0, 0.5]
    )

    by_factory = Batch.from_dict(
        {"pred_frames": frames}, {"extra_info": [{"level": 0.2}, {"level": 0.5}]}
    )
    by_factory.meta["env_factory"] = lambda info: ToyEnv(info["level"])
    np.testing.assert_allclose(
        get_verifier("closed_loop")(by_factory, task="toy_brightness").scores, [1.0, 1.0]
    )

    with pytest.raises(KeyError, match="env_factory"):
        get_verifier("closed_loop")(Batch.from_dict({"pred_frames": frames}), task="toy_brightness")
    with pytest.raises(ValueError, match="unknown closed-loop task score"):
        get_verifier("closed_loop")(batch, task="nope")
