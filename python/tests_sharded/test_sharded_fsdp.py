"""FSDP2 trainers publishing without a gather: 2 and 4 ranks (torch.multiprocessing, gloo on
CPU) run `fully_shard` on a small transformer trained with AdamW on the GPL-3 text; every rank
registers its DTensor shards (BF16) as blocks under client rank<r> and publishes the same
version every step. The subscriber must hold, at every version, exactly the whole tensors
(`full_tensor()`, gathered by the test only), versions after the first as deltas."""
from __future__ import annotations

import pytest

from _sharded_common import TinyLM, daemons, run_fsdp

VERSIONS = 5
LR = 1e-3


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_ranks_publish_their_shards(tmp_path_factory, tmp_path, world):
    names = [n for n, _ in TinyLM().named_parameters()]
    with daemons(tmp_path_factory) as env:
        refits = run_fsdp(env, tmp_path, world, [env.pub_local] * world, VERSIONS, LR)
        # The publisher holds whole tensors (one per parameter), no blocks.
        st = env.pub_control.status()
        assert st.version == VERSIONS and st.tensors == len(names)
        changed = [r.changed_elements / r.total_elements for r in refits[1:]]
        assert min(changed) > 0.01, f"training changed too little to test deltas: {changed}"
