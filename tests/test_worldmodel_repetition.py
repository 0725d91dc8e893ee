"""The repetition rate: one definition for the reward, mmrl eval and the report."""

import numpy as np
import torch

from mmrl.protocol import Batch
from mmrl.tasks.worldmodel_eval import frame_scores
from mmrl.verifiers import get_verifier
from mmrl.verifiers.repetition import repetition_rate


def moving(n_frames: int, start: int = 0) -> np.ndarray:
    frames = np.zeros((n_frames, 32, 32, 3), np.uint8)
    for t in range(n_frames):
        frames[t, 4:8, start + 2 * t : start + 2 * t + 4] = 255
    return frames


def test_a_frozen_prediction_of_a_moving_truth_is_repeated():
    last = moving(1)[0]
    truth = moving(4)[1:]  # three future frames, each moved
    frozen = np.repeat(last[None], 3, axis=0)
    half = truth.copy()
    half[2] = half[1]  # the third predicted frame stands still
    pred = np.stack([frozen, truth, half])
    unit = lambda x: torch.from_numpy(x).float() / 255  # noqa: E731
    rates = repetition_rate(unit(pred), unit(np.stack([truth] * 3)), unit(np.stack([last] * 3)))
    assert np.allclose(rates, [1.0, 0.0, 1 / 3])
    still = np.repeat(last[None, None], 3, axis=1)  # the truth does not move: no verdict
    assert np.isnan(repetition_rate(unit(still), unit(still), unit(last[None])))[0]


def test_the_verifier_and_the_evaluation_agree():
    last = np.stack([moving(1)[0]] * 2)
    truth = np.stack([moving(3)[1:]] * 2)
    pred = truth.copy()
    pred[0] = last[0]  # sample 0 copies its last context frame
    batch = Batch.from_dict(
        {
            "pred_frames": torch.from_numpy(pred),
            "gt_frames": torch.from_numpy(truth),
            "last_context_frame": torch.from_numpy(last),
        }
    )
    out = get_verifier("repetition_penalty")(batch)
    assert out.scores.tolist() == [-1.0, 0.0] and out.metrics["rate"].tolist() == [1.0, 0.0]
    scores = frame_scores(pred, truth, np.ones(2, bool), None, last)
    assert scores["repetition"].tolist() == [1.0, 0.0]
    assert scores["psnr@t1"].shape == (2,) and "psnr@t2" in scores


def test_codec_error_on_the_first_frame_is_not_motion():
    """A copy of the last frame as the tokenizer decodes it repeats, though it differs from
    the recorded frame by the tokenizer's error."""
    last = np.stack([moving(1)[0]])
    truth = np.stack([moving(3)[1:]])
    decoded = last.copy()
    decoded[0, 20:, :] = 40  # the codec's error, larger than tau
    copy = np.repeat(decoded[:, None], 2, axis=1)
    unit = lambda x: torch.from_numpy(x).float() / 255  # noqa: E731
    assert repetition_rate(unit(copy), unit(truth), unit(last))[0] == 0.5  # t=1 looks moved
    assert repetition_rate(unit(copy), unit(truth), unit(last), last_decoded=unit(decoded))[0] == 1
