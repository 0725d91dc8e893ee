"""Process-mode verifiers beside FSDP workers on the Ray that mmrl starts for them.

That Ray holds exactly the CPUs of the workers' placement-group bundles; verifier actors
must still start (they reserve no CPU) and run every call. Ray must not be running when
this module starts, so it has its own file (the hybrid tests' Ray lives for their module).
"""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
import ray

from mmrl.config import load_config
from mmrl.trainer.fit import fit
from tests.conftest import run_overrides

pytestmark = pytest.mark.slow

# A user's verifier file: exact match, plus whether the call ran inside a Ray worker.
VERIFIER = textwrap.dedent("""
    import sys
    import numpy as np
    from mmrl.verifiers import VerifierOutput

    def exact_in_ray(batch):
        in_ray = "ray" in sys.modules and sys.modules["ray"].is_initialized()
        scores = np.array([float(str(r).strip() == str(t).strip())
                           for r, t in zip(batch["response_text"], batch["ground_truth"])])
        return VerifierOutput(scores=scores, valid=np.ones(len(scores), dtype=bool),
                              metrics={"in_ray": np.full(len(scores), float(in_ray))})
""")


def test_process_verifiers_run_on_ray_beside_two_fsdp_workers(tmp_path, warm_model_dir):
    assert not ray.is_initialized(), "another test left Ray running"
    verifier = tmp_path / "my_verifier.py"
    verifier.write_text(VERIFIER)
    cfg = load_config(
        run_overrides(
            tmp_path / "run",
            f"actor_rollout_ref.model.path={warm_model_dir}",
            "trainer.total_steps=2",
            "trainer.test_freq=2",
            "data.train_batch_size=4",
            "actor_rollout_ref.rollout.n=4",
            "trainer.n_workers_per_node=2",
            "trainer.ray_object_store_mb=512",
            "trainer.dist_timeout_s=120",
            f"reward.verifiers=[{{name: '{verifier}:exact_in_ray', alias: exact, mode: process}}]",
            "reward.num_workers=2",
        )
    )
    result = fit(cfg)
    assert result.series("reward/exact/in_ray") == [1.0, 1.0]  # the calls ran on Ray actors
    assert result.series("val/exact/in_ray") == [1.0, 1.0]
    assert sum(result.series("reward/exact/errors")) == 0
    # The warmed-up model answers some sums right: scores come back and line up with samples.
    assert np.mean(result.series("reward/exact/mean")) > 0.1
    assert not ray.is_initialized()  # mmrl stops the Ray it started
