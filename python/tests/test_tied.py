"""Tied weights (`tie_word_embeddings`: lm_head.weight IS embed.weight) through real daemons, in
every consumer mode: attach views, load_into (strict and not), bind_module, the Pauser of a
single-copy store, get_changes / apply_changes. Each version is checked bit for bit against the
trainer's model under every name it has.

Two trainers: "tied" registers the model's state_dict() as it is (the Trainer finds the tied
tensor and publishes it once, under embed.weight); "both" registers copies of every name, as
trainers before the alias handling did (embed.weight and lm_head.weight both published, same
bytes): consumers must load either."""
from __future__ import annotations

import contextlib
import time

import pytest
import torch

from _tied import TiedLM, assert_bits, every_name, step
from refit.changes import ChangeSet, TensorChange, apply_changes, get_changes
from refit.inference import Consumer
from refit.local import daemon_pair
from refit.pause import Pauser, bind_module
from refit.trainer import Trainer

WAIT_S = 20.0
STYLES = ["tied", "both"]


def register(trainer: Trainer, model: TiedLM, style: str) -> None:
    if style == "tied":
        reg = trainer.register({n: t.detach() for n, t in model.state_dict().items()})
        assert trainer.aliases == {"lm_head.weight": "embed.weight"}
        assert reg.tensors == 4
    else:  # an older trainer: one copy per name
        reg = trainer.register({n: t.detach().clone() for n, t in model.state_dict().items()})
        assert trainer.aliases == {}
        assert reg.tensors == 5


def published(trainer: Trainer, model: TiedLM) -> dict:
    """The trainer's model by the names the version holds."""
    want = every_name(model)
    assert_bits(trainer.tensors, {n: want[n] for n in trainer.tensors}, "trainer.tensors")
    return {n: want[n] for n in trainer.tensors}


def loose_module() -> TiedLM:
    """A tied module without the `steps` buffer, with a parameter no version has."""
    m = TiedLM()
    del m.steps
    m.extra = torch.nn.Parameter(torch.zeros(3))
    return m


@pytest.mark.parametrize("style", STYLES)
def test_views_load_into_and_bind_module_follow_a_tied_trainer(fresh_daemons, style):
    pub_sock, sub_sock = fresh_daemons
    torch.manual_seed(3)
    model = TiedLM()
    trainer = Trainer(pub_sock, client="rank0")
    register(trainer, model, style)
    consumer = Consumer(sub_sock, name=f"tied-{style}")
    strict_model, loose, bound = TiedLM(), loose_module(), TiedLM()
    for v in range(1, 5):
        step(model, v)
        trainer.update(model.state_dict())  # both names: one write per published tensor
        assert trainer.publish().version == v
        assert consumer.wait_for_version(v, timeout=WAIT_S) == v
        want, names = every_name(model), published(trainer, model)

        with consumer.attach() as w:  # the names the version holds
            assert sorted(w) == sorted(names)
            assert_bits(w, names, f"attach v{v}")
            n = bind_module(bound, w)  # zero copy: the module's tensors are the views
            assert n == len(w)
            assert bound.embed.weight.data_ptr() == w["embed.weight"].data_ptr()
            assert bound.lm_head.weight is bound.embed.weight
            assert_bits(every_name(bound), want, f"bind_module v{v}")
        with consumer.attach(aliases=strict_model) as w:  # + the module's tied names
            assert_bits(w, want, f"attach(aliases=module) v{v}")
            if style == "tied":
                assert w["lm_head.weight"] is w["embed.weight"]
        with consumer.attach(aliases=trainer.aliases) as w:
            assert_bits(w, want, f"attach(aliases=trainer.aliases) v{v}")

        assert consumer.load_into(strict_model) == v
        assert strict_model.lm_head.weight is strict_model.embed.weight
        assert_bits(every_name(strict_model), want, f"load_into v{v}")

        with pytest.raises(ValueError) as e:
            consumer.load_into(loose)  # strict: both ways
        assert "not in the module: steps" in str(e.value)
        assert f"not in version {v}: extra" in str(e.value)
        assert consumer.load_into(loose, strict=False) == v
        assert consumer.skipped == ("steps",)
        assert_bits(every_name(loose), {n: t for n, t in want.items() if n != "steps"},
                    f"load_into(strict=False) v{v}")
        assert torch.equal(loose.extra.detach(), torch.zeros(3))

    # A consumer whose module is NOT tied needs every name in the version.
    untied = TiedLM(tied=False)
    if style == "tied":
        with pytest.raises(ValueError, match="not in version 4: lm_head.weight"):
            consumer.load_into(untied)
        consumer.load_into(untied, strict=False)
        assert_bits(every_name(untied), {n: t for n, t in want.items() if n != "lm_head.weight"},
                    "untied module, strict=False")
    else:
        consumer.load_into(untied)
        assert_bits(every_name(untied), want, "untied module")
    trainer.close()
    consumer.close()


def test_tied_names_with_different_bits_are_refused(fresh_daemons):
    pub_sock, sub_sock = fresh_daemons
    model = TiedLM()
    trainer = Trainer(pub_sock, client="rank0")
    register(trainer, model, "tied")
    other = model.lm_head.weight.detach().clone()
    other.view(torch.int16)[0, 0] += 1
    with pytest.raises(ValueError, match="lm_head.weight and embed.weight"):
        trainer.update({"embed.weight": model.embed.weight, "lm_head.weight": other})
    trainer.update({"lm_head.weight": other})  # an alias alone writes its canonical tensor
    assert torch.equal(trainer.tensors["embed.weight"].view(torch.int16), other.view(torch.int16))

    # An older trainer publishing a tied module's two names with different bytes: refused, and
    # nothing is copied.
    state = {n: t.detach().clone() for n, t in model.state_dict().items()}
    state["lm_head.weight"] = other
    trainer.register(state)
    assert trainer.publish(allow_degenerate=True).version == 1
    consumer = Consumer(sub_sock, name="tied-differ")
    assert consumer.wait_for_version(1, timeout=WAIT_S) == 1
    dst = TiedLM()
    before = every_name(dst)
    with pytest.raises(ValueError, match="tied in the module but different in the version"):
        consumer.load_into(dst)
    assert_bits(every_name(dst), before, "nothing copied")
    # The same for change sets (built here: the subscriber never pairs such names).
    idx = torch.tensor([0, 5], dtype=torch.int64)
    cs = ChangeSet(1, 2, 0, False, "", {
        "embed.weight": TensorChange("embed.weight", (512, 64), idx,
                                     torch.ones(2, dtype=torch.bfloat16), 0),
        "lm_head.weight": TensorChange("lm_head.weight", (512, 64), idx,
                                       torch.zeros(2, dtype=torch.bfloat16), 0)})
    with pytest.raises(ValueError, match="tied in the module with embed.weight"):
        apply_changes(dst, cs)
    assert_bits(every_name(dst), before, "nothing written")
    cs.tensors["lm_head.weight"].values = torch.ones(2, dtype=torch.bfloat16)
    assert apply_changes(dst, cs) == 2  # the same changes twice: written once
    assert float(dst.lm_head.weight.view(-1)[5]) == 1.0
    trainer.close()
    consumer.close()


@contextlib.contextmanager
def single_copy_pair(tmp_path_factory):
    with daemon_pair(str(tmp_path_factory.mktemp("refitd-tied")), slots=1,
                     digest_v2=True) as (pub, sub):
        yield pub.ready["local_socket"], sub.ready["local_socket"]



def first_version(pub_sock, sub_sock, model, style, name):
    """A trainer that registered `model` (style) and published version 1, and a consumer `name`
    of the subscriber that applied it."""
    trainer = Trainer(pub_sock, client="rank0")
    register(trainer, model, style)
    assert trainer.publish().version == 1
    consumer = Consumer(sub_sock, name=name)
    assert consumer.wait_for_version(1, timeout=WAIT_S) == 1
    return trainer, consumer

@pytest.mark.parametrize("style", STYLES)
def test_pauser_serves_a_tied_module_from_the_one_copy(tmp_path_factory, style):
    torch.manual_seed(5)
    model, engine = TiedLM(), TiedLM()
    ids = torch.arange(0, 512, 7)
    with single_copy_pair(tmp_path_factory) as (pub_sock, sub_sock):
        trainer, consumer = first_version(pub_sock, sub_sock, model, style, f"tied-pauser-{style}")
        with Pauser(consumer, module=engine, timeout=WAIT_S) as pauser:
            ptr = None
            for v in range(1, 6):
                if v > 1:
                    step(model, v)
                    trainer.update(model.state_dict())
                    assert trainer.publish().version == v
                deadline = time.monotonic() + WAIT_S
                while True:
                    with pauser.batch() as w:
                        held = w.version
                        out = engine(ids)
                        snapshot = every_name(engine)
                        if held == v:
                            # The module's tied names are in the batch's weights too (as the
                            # bound view when the version holds the tensor once).
                            assert "lm_head.weight" in w
                            if style == "tied":
                                assert w["lm_head.weight"] is w["embed.weight"]
                            assert engine.embed.weight.data_ptr() == \
                                w["embed.weight"].data_ptr(), "not the store's view"
                    if held == v:
                        break
                    assert held == v - 1 and time.monotonic() < deadline, f"v{v} never came"
                assert engine.lm_head.weight is engine.embed.weight
                assert_bits(snapshot, every_name(model), f"Pauser v{v}")
                assert torch.equal(out.view(torch.int16), model(ids).view(torch.int16))
                ptr = ptr or engine.embed.weight.data_ptr()
                assert engine.embed.weight.data_ptr() == ptr, "the views moved: a copy was made"
            assert pauser.pauses >= 1 and not pauser.weights_may_be_torn
        trainer.close()
        consumer.close()


@pytest.mark.parametrize("style", STYLES)
def test_change_sets_follow_a_tied_trainer(tmp_path_factory, style):
    torch.manual_seed(9)
    model, engine = TiedLM(), TiedLM()
    with single_copy_pair(tmp_path_factory) as (pub_sock, sub_sock):
        trainer, consumer = first_version(pub_sock, sub_sock, model, style, f"tied-changes-{style}")
        held = consumer.load_into(engine)
        assert_bits(every_name(engine), every_name(model), "load_into v1")
        loose = loose_module()
        consumer.load_into(loose, strict=False)
        v = 1
        for target in (2, 3, 4, 5, 8):  # 6 and 7 skipped: one composed change set 5 -> 8
            while v < target:
                v += 1
                step(model, v)
                trainer.update(model.state_dict())
                assert trainer.publish().version == v
            assert consumer.wait_for_version(v, timeout=WAIT_S) == v
            changes = get_changes(consumer, held)
            assert not changes.reload_fully, changes.reason
            assert (changes.from_version, changes.to_version) == (held, v)
            assert "embed.weight" in changes.tensors
            assert set(changes.tensors) <= set(trainer.tensors)
            dup = changes.tensors.get("lm_head.weight")
            expect = changes.changed_elements() - (dup.indices.numel() if dup is not None else 0)
            assert 0 < expect
            assert apply_changes(engine, changes) == expect  # strict (the default)
            assert engine.lm_head.weight is engine.embed.weight
            assert_bits(every_name(engine), every_name(model), f"apply_changes v{v}")
            with pytest.raises(ValueError, match="steps: not in the module"):
                apply_changes(loose, changes)
            apply_changes(loose, changes, strict=False)
            assert_bits(every_name(loose), {n: t for n, t in every_name(model).items()
                                            if n != "steps"}, f"apply_changes(strict=False) v{v}")
            held = v
        trainer.close()
        consumer.close()
