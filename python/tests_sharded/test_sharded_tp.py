"""FSDP2 trainer to a tensor-parallel rollout, with no gather on either side: 2 gloo ranks run
`fully_shard` on the small transformer trained with AdamW on the GPL-3 text and register their
Shard(0) blocks with one publisher, which cuts the column-parallel weights by rows and the
row-parallel ones by columns into one part per rollout rank (publisher.cut, 2 parts). Two
subscribers, tensor-parallel ranks 0 and 1 (upstream.slice), must each hold exactly their rank's
share of every cut tensor (of `full_tensor()`, gathered by the test only, split as the engines
split) and every other tensor whole, at every version, as deltas after the first; the consumer's
`Weights.slices` says where each share lies in the whole tensor. Rank 0 keeps a single copy
updated in place (store.slots 1), and its change sets, applied to the previous version's
shares, give the new ones bit for bit (share coordinates). (The fused qkv/gate_up weights
are cut as plain rows here: an engine that splits each of q, k, v needs them published apart.)"""
from __future__ import annotations

import contextlib
import fnmatch
import types


from _sharded_common import assert_bits_equal, check_version, run_fsdp

from refit.changes import get_changes
from refit.control import Control
from refit.inference import Consumer
from refit.local import Daemon, publisher_yaml, subscriber_yaml

VERSIONS = 3
LR = 1e-3
WORLD, TP = 2, 2
ROWS = ["embed_tokens.weight", "lm_head.weight", "layers.*.qkv_proj.weight",
        "layers.*.gate_up_proj.weight"]
COLUMNS = ["layers.*.o_proj.weight", "layers.*.down_proj.weight"]


def cut_dim(name: str):
    """The dim `name` is cut along (0 rows, 1 columns), or None when published whole."""
    if any(fnmatch.fnmatchcase(name, p) for p in ROWS):
        return 0
    if any(fnmatch.fnmatchcase(name, p) for p in COLUMNS):
        return 1
    return None


def shares(full, rank: int):
    """Rank `rank`'s tensors: each cut tensor's share [n*r/TP, n*(r+1)/TP) of its dim, the rest
    whole; and name -> (whole shape, offsets) of the shares."""
    want, where = {}, {}
    for name, t in full.items():
        dim = cut_dim(name)
        if dim is None:
            want[name] = t
            continue
        n = t.shape[dim]
        a, b = n * rank // TP, n * (rank + 1) // TP
        want[name] = t.narrow(dim, a, b - a).contiguous()
        where[name] = (tuple(t.shape), tuple(a if d == dim else 0 for d in range(t.dim())))
    return want, where


@contextlib.contextmanager
def tp_daemons(tmp_path_factory):
    """A publisher cutting into TP parts and one subscriber per TP rank (rank 0 a single copy,
    store.slots 1; the others store.slots 3)."""
    d = str(tmp_path_factory.mktemp("refitd"))
    with contextlib.ExitStack() as stack:
        pub = Daemon("publisher", "pub", d,
                     publisher_yaml("pub", d, cut={"parts": TP, "rows": ROWS,
                                                   "columns": COLUMNS}))
        stack.callback(pub.stop)
        pub_ready = pub.start()
        subs, controls, consumers = [], [], []
        for r in range(TP):
            sub = Daemon("subscriber", f"tp{r}", d,
                         subscriber_yaml(f"tp{r}", d, pub_ready["listen"],
                                         slots=1 if r == 0 else 3, tp_slice=(r, TP)))
            stack.callback(sub.stop)
            ready = sub.start()
            subs.append(sub)
            controls.append(Control(ready["listen"]))
            stack.callback(controls[-1].close)
            consumers.append(Consumer(ready["local_socket"], name=f"pytest-tp{r}"))
            stack.callback(consumers[-1].close)
        yield types.SimpleNamespace(pub_local=pub_ready["local_socket"], subs=subs,
                                    sub_controls=controls, consumers=consumers,
                                    logs=[pub] + subs)


def check_changes(consumer, version: int, held, want) -> None:
    """The change set from version - 1, applied to `held` (that version's tensors), gives `want`
    bit for bit; it lists only tensors that changed, in their own (share) coordinates."""
    changes = get_changes(consumer, version - 1)
    assert not changes.reload_fully, changes.reason
    assert (changes.from_version, changes.to_version) == (version - 1, version)
    assert changes.tensors, f"version {version}: no changes"
    for name, c in changes.tensors.items():
        assert tuple(c.shape) == tuple(want[name].shape), (name, c.shape, want[name].shape)
        flat = held[name].view(-1)
        flat[c.indices] = c.values
    assert_bits_equal(held, want, f"rank 0's tensors after the change set to {version}")


def test_fsdp2_blocks_reach_each_tensor_parallel_rank_as_its_share(tmp_path_factory, tmp_path):
    with tp_daemons(tmp_path_factory) as env:
        held = {}  # rank 0's shares as an engine keeping its own weights holds them

        def check(_, version, full, delta):
            refits = []
            cut = [n for n in full if cut_dim(n) is not None]
            for r in range(TP):
                want, where = shares(full, r)
                rank = types.SimpleNamespace(consumer=env.consumers[r],
                                             sub_control=env.sub_controls[r], logs=env.logs)
                refits.append(check_version(rank, version, want, delta=delta))
                with env.consumers[r].attach(version) as w:
                    assert w.slices == where, f"rank {r}: {w.slices} != {where}"
                    assert_bits_equal(dict(w), want, f"rank {r} at version {version}")
                    # The rank holds its share only: half of every cut tensor.
                    held_elements = sum(w[n].numel() for n in cut)
                whole = sum(full[n].numel() for n in cut)
                assert held_elements <= whole / TP * 1.02, (r, held_elements, whole)
                if r == 0:
                    if held:
                        check_changes(env.consumers[0], version, held, want)
                    held.clear()
                    held.update({n: t.clone() for n, t in want.items()})
            return refits[0]

        refits = run_fsdp(env, tmp_path, WORLD, [env.pub_local] * WORLD, VERSIONS, LR,
                          check=check)
        changed = [r.changed_elements / r.total_elements for r in refits[1:]]
        assert min(changed) > 0.01, f"training changed too little to test deltas: {changed}"
        for control in env.sub_controls:
            assert control.verify().ok
