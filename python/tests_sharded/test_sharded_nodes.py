"""FSDP2 over two trainer nodes without a gather: 4 ranks (torch.multiprocessing, gloo on CPU) run
`fully_shard` on the small transformer trained with AdamW on the GPL-3 text; ranks 0-1 are node
0 and feed node 0's shard publisher, ranks 2-3 node 1's (`publisher.shard` of set "fsdp"). Each
publisher joins only its node's Shard(0) blocks into its rows of each tensor (a part, never the
whole tensor); the subscriber joins both shards' parts. It must hold, at every version, exactly
the whole tensors (`full_tensor()`, gathered by the test only), versions after the first as
deltas."""
from __future__ import annotations

from _sharded_common import TinyLM, node_daemons, run_fsdp

VERSIONS = 4
LR = 1e-3
WORLD, NODES = 4, 2


def test_fsdp2_ranks_on_two_nodes_publish_their_rows_to_their_nodes_publisher(
        tmp_path_factory, tmp_path):
    names = [n for n, _ in TinyLM().named_parameters()]
    with node_daemons(tmp_path_factory, NODES) as env:
        per_node = WORLD // NODES
        sockets = [env.pub_locals[rank // per_node] for rank in range(WORLD)]
        # Each node's round completes on its own publisher: one committing Publish each.
        refits = run_fsdp(env, tmp_path, WORLD, sockets, VERSIONS, LR)
        # Every parameter is split over both nodes: each publisher holds rows of it, never all.
        for n, control in enumerate(env.pub_controls):
            st = control.status()
            assert st.version == VERSIONS
            sliced = {t.name: t for t in st.trainer_api.sliced}
            assert sorted(sliced) == sorted(names), f"node {n}"
            for name, t in sliced.items():
                assert t.shard_part and 0 < t.rows < t.whole_shape[0], f"node {n}: {t}"
        # The subscriber's version covers both shards, and Verify agrees with the records.
        sub = env.sub_control.status()
        assert len(sub.shards.shards) == NODES
        assert all(s.tensors == len(names) for s in sub.shards.shards), sub.shards
        assert env.sub_control.verify().ok
        changed = [r.changed_elements / r.total_elements for r in refits[1:]]
        assert min(changed) > 0.01, f"training changed too little to test deltas: {changed}"
