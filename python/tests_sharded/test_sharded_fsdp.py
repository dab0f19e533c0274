"""FSDP2 trainers publishing without a gather: 2 and 4 ranks (torch.multiprocessing, gloo on
CPU) run `fully_shard` on a small transformer trained with AdamW on the GPL-3 text; every rank
registers its DTensor shards (BF16) as blocks under client rank<r> and publishes the same
version every step. The subscriber must hold, at every version, exactly the whole tensors
(`full_tensor()`, gathered by the test only), versions after the first as deltas."""
from __future__ import annotations

import pytest

import _sharded_workers as workers
from _sharded_common import Procs, TinyLM, check_version, daemons

VERSIONS = 5
LR = 1e-3


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_ranks_publish_their_shards(tmp_path_factory, tmp_path, world):
    names = [n for n, _ in TinyLM().named_parameters()]
    with daemons(tmp_path_factory) as env:
        procs = Procs()
        try:
            ack = procs.queue()
            for rank in range(world):
                procs.start(rank, workers.fsdp_rank, world, str(tmp_path / "store"), env.pub_local,
                            VERSIONS, LR, ack)
            refits = []
            for version in range(1, VERSIONS + 1):
                _, v, full = procs.get("full")
                assert v == version
                assert sorted(full) == sorted(names)
                # Exactly one rank's Publish completed the round, each rank published once.
                published = [procs.get("published") for _ in range(world)]
                assert sorted(p[1] for p in published) == list(range(world))
                assert all(p[2] == version for p in published), published
                assert sum(p[3] for p in published) == 1, f"version {version}: {published}"
                refits.append(check_version(env, version, full, delta=version > 1))
                ack.put(version)
            for _ in range(world):
                procs.get("done")
            procs.join()
        finally:
            procs.close()
        # The publisher holds whole tensors (one per parameter), no blocks.
        st = env.pub_control.status()
        assert st.version == VERSIONS and st.tensors == len(names)
        changed = [r.changed_elements / r.total_elements for r in refits[1:]]
        assert min(changed) > 0.01, f"training changed too little to test deltas: {changed}"
