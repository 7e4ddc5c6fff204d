"""`prepare_target` with `shard_target`: FSDP2-sharded decoder layers on 2 gloo processes
give the replicated target's features, embeddings and logits, including the early stop
after the last needed layer that the trainer uses."""

from __future__ import annotations

import pytest
import torch

from tests.distributed._backend_worker import launch

pytestmark = pytest.mark.distributed


def test_sharded_target_matches_an_untouched_copy(tmp_path):
    out = launch(2, tmp_path / "target.pt", shard_target=1)
    # the layers stay sharded between forwards: each rank holds half of every layer
    assert out["sharded"]
    # same weights, same float32 kernels; only the all-gather moves bytes around
    torch.testing.assert_close(out["got"], out["want"], rtol=0, atol=0)
