"""Your own videos end to end through the CLI: pretraining, GRPO, evaluation, report."""

import json
import os
import stat

import pytest

from tests.video_data import EPISODES, FRAMES, PRETRAIN, SHAPE, train_args, write_episodes

# RL must lower the test split's sampled LPIPS by more than the seed-to-seed spread of that
# change: 0.0030, the sample std of RL - base over RL seeds 0-4 (-0.0141, -0.0079, -0.0072,
# -0.0121, -0.0084; benchmarks/results/worldmodel_videos.json, docs/benchmarks.md). On two
# other pretrained starts (pretraining seeds 1 and 2) RL seed 0 gained 0.0125 and 0.0064, so
# the claim does not hang on one start. Greedy LPIPS is not asserted: it improved by
# 0.0049 ± 0.0044, less than twice its spread.
LPIPS_MARGIN = 0.0030


def listing(folder):
    return sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir())


@pytest.mark.slow
def test_own_videos_pretrain_grpo_eval_through_the_cli(tmp_path):
    import torch

    from mmrl.trainer.cli import main

    # The margin was measured with one intra-op thread; the thread count changes the float
    # reduction order, and with it which samples GRPO draws, so the test uses the same.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)

    videos = write_episodes(tmp_path / "videos", EPISODES, t=FRAMES, shape=SHAPE)
    before = listing(videos)
    os.chmod(videos, stat.S_IRUSR | stat.S_IXUSR | stat.S_IRGRP | stat.S_IXGRP)  # a-w
    pre, run = tmp_path / "pretrain", tmp_path / "run"
    try:
        assert main(["pretrain-worldmodel", f"data.videos={videos}", f"output_dir={pre}",
                     "progress_bar=false", *PRETRAIN]) == 0  # fmt: skip
        assert main(train_args(videos, pre, run, seed=0)) == 0
        test_split = pre / "data" / "test"
        evaluate = ["eval", "--model", str(run / "actor"), "--data", str(test_split)]
        assert main([*evaluate, "--windows", "16", "--json", str(tmp_path / "e.json")]) == 0
    finally:
        os.chmod(videos, stat.S_IRWXU)
        torch.set_num_threads(threads)
    assert listing(videos) == before  # the recordings' folder is untouched
    layout = json.loads((run / "actor" / "worldmodel_layout.json").read_text())
    assert layout["grid"] == [6, 8]  # 48x64 frames, 8x downsampling: 48 tokens per frame
    table = json.loads((run / "worldmodel_eval.json").read_text())
    rows = json.loads((tmp_path / "e.json").read_text())
    for metrics in (table["base"]["greedy"], table["rl"]["greedy"], rows["model (greedy)"]):
        assert all(f"{m}@t{t}" in metrics for m in ("psnr", "lpips") for t in (1, 2))
        assert "lpips/slope" in metrics
    base, rl = table["base"]["sampled"]["lpips"], table["rl"]["sampled"]["lpips"]
    assert rl < base - LPIPS_MARGIN, (base, rl)
    assert (run / "report" / "frames.png").exists() and (run / "report.html").exists()
