"""Dispatch over data-parallel ranks: chunking, padding, merging, and the group front end."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmrl.hybrid.dispatch import (
    Dispatch,
    average_metrics,
    collect,
    dispatch_mode,
    register,
    split_args,
)
from mmrl.hybrid.group import WorkerGroup
from mmrl.protocol import Batch


def make_batch(n: int) -> Batch:
    return Batch.from_dict(
        {
            "input_ids": torch.arange(n * 3).reshape(n, 3),
            "score": torch.arange(n, dtype=torch.float32),
        },
        {
            "uid": [f"u{i}" for i in range(n)],
            "multi_modal_inputs": [{"pixel_values": np.full((2, 2), i)} for i in range(n)],
        },
    )


class EchoWorker:
    """Records the chunk each rank received and answers with per-row results."""

    def __init__(self, rank: int) -> None:
        self.rank, self.seen = rank, []

    @register(Dispatch.DP_COMPUTE)
    def annotate(self, batch: Batch, offset: float) -> Batch:
        self.seen.append(batch)
        out = batch.clone()
        out["rank"] = torch.full((len(batch),), self.rank)
        out["shifted"] = batch["score"] + offset
        out.meta["num_rows"] = len(batch)
        return out

    @register(Dispatch.DP_COMPUTE)
    def row_sums(self, batch: Batch) -> torch.Tensor:
        return batch["input_ids"].sum(-1)

    @register(Dispatch.DP_UPDATE)
    def train(self, batch: Batch) -> dict[str, float]:
        return {"loss": float(self.rank), "rows": float(len(batch))}

    @register(Dispatch.ALL)
    def whoami(self) -> int:
        return self.rank

    def not_exposed(self) -> None: ...


class InProcessGroup(WorkerGroup):
    """``world_size`` workers in this process: the group's dispatch without processes."""

    def __init__(self, world_size: int) -> None:
        super().__init__("echo", EchoWorker, world_size)
        self.workers = [EchoWorker(r) for r in range(world_size)]

    def _run(self, method, calls):
        return [
            getattr(w, method)(*a, **kw) for w, (a, kw) in zip(self.workers, calls, strict=True)
        ]


def test_uneven_batch_is_padded_then_unpadded_in_order():
    group = InProcessGroup(world_size=2)
    batch = make_batch(5)
    out = group.annotate(batch, offset=10.0)
    # Each rank saw 3 rows: the 5 real ones plus one padding copy of row 0, at the end.
    assert [len(b) for w in group.workers for b in w.seen] == [3, 3]
    assert list(group.workers[1].seen[0]["uid"]) == ["u3", "u4", "u0"]
    assert len(out) == 5
    assert list(out["uid"]) == [f"u{i}" for i in range(5)]
    assert [int(m["pixel_values"][0, 0]) for m in out["multi_modal_inputs"]] == list(range(5))
    assert torch.equal(out["input_ids"], batch["input_ids"])
    assert torch.equal(out["shifted"], batch["score"] + 10.0)
    assert out["rank"].tolist() == [0, 0, 0, 1, 1]
    assert out.meta["num_rows"] == 6  # integer meta counts add up over ranks (padding included)


def test_tensor_results_are_concatenated_in_order_without_padding():
    group = InProcessGroup(world_size=3)
    batch = make_batch(7)
    assert torch.equal(group.row_sums(batch), batch["input_ids"].sum(-1))


def test_metrics_are_averaged_over_ranks():
    metrics = InProcessGroup(world_size=2).train(make_batch(4))
    assert metrics == {"loss": 0.5, "rows": 2.0}


def test_update_refuses_a_batch_that_does_not_divide():
    with pytest.raises(
        ValueError, match=r"5 samples cannot be split evenly over 2 .*n_workers_per_node"
    ):
        InProcessGroup(world_size=2).train(make_batch(5))


def test_all_mode_reaches_every_rank():
    assert InProcessGroup(world_size=3).whoami() == [0, 1, 2]


def test_unregistered_method_is_a_clear_error():
    with pytest.raises(
        AttributeError, match=r"not_exposed is not a worker-group method.*'annotate'"
    ):
        InProcessGroup(world_size=1).not_exposed()


def test_split_args_keeps_other_arguments():
    calls, pad = split_args(Dispatch.DP_COMPUTE, 2, ("x", make_batch(4)), {"seed": 3}, "m")
    assert pad == 0
    assert [(a[0], len(a[1]), kw) for a, kw in calls] == [
        ("x", 2, {"seed": 3}),
        ("x", 2, {"seed": 3}),
    ]
    with pytest.raises(TypeError, match="got no Batch argument"):
        split_args(Dispatch.DP_COMPUTE, 2, (1,), {}, "m")


def test_collect_merges_meta_and_rejects_unknown_results():
    parts = [make_batch(2), make_batch(2)]
    parts[0].meta.update(clipped=1, time_s=0.5, engine="hf")
    parts[1].meta.update(clipped=2, time_s=0.25, engine="hf")
    merged = collect(Dispatch.DP_COMPUTE, parts, pad_size=1)
    assert len(merged) == 3
    assert merged.meta == {"clipped": 3, "time_s": 0.5, "engine": "hf"}
    with pytest.raises(TypeError, match="cannot merge per-rank results of type str"):
        collect(Dispatch.DP_COMPUTE, ["a", "b"], 0)
    assert dispatch_mode(EchoWorker, "train") is Dispatch.DP_UPDATE


def test_rank_metrics_combine_as_their_names_say():
    per_rank = [
        {"actor/pg_loss": 1.0, "rollout/logprob_diff_max": 0.1, "rollout_is/min": 0.5},
        {"actor/pg_loss": 3.0, "rollout/logprob_diff_max": 0.3, "rollout_is/min": 0.9},
    ]
    assert average_metrics(per_rank) == {
        "actor/pg_loss": 2.0,
        "rollout/logprob_diff_max": 0.3,
        "rollout_is/min": 0.5,
    }
