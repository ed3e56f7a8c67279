"""Key renaming rules, adapt_state_dict's matching and errors, and checkpoint containers."""

from __future__ import annotations

import copy
from collections import OrderedDict, defaultdict, namedtuple
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ddpstate.errors import (
    DDPStateError,
    KeyCollisionError,
    KeyMismatchError,
    StateDictNotFoundError,
)
from ddpstate.keys import (
    KNOWN_PREFIXES,
    STATE_DICT_NAMES,
    adapt_state_dict,
    add_prefix,
    detect_prefixes,
    find_state_dict,
    match_keys,
    normalize_keys,
    replace_state_dict,
    strip_prefix,
    unwrap_model,
)


def _compile(module: nn.Module) -> nn.Module:
    return torch.compile(module, backend="eager")  # type: ignore[return-value]


def _bn_model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))


# --------------------------------------------------------------------------- strip / add


def test_strip_prefix_keeps_order_type_values_and_int_keys() -> None:
    """Renamed keys stay where they were (torch's helper moves them to the end)."""
    w, b = torch.ones(2), torch.zeros(2)
    sd: OrderedDict[Any, Any] = OrderedDict(
        [("module.w", w), (0, {"step": 1}), ("other", "text"), ("module.b", b), (7, None)]
    )
    out = strip_prefix(sd)
    assert type(out) is OrderedDict
    assert list(out) == ["w", 0, "other", "b", 7]
    assert out["w"] is w and out["b"] is b and out[0] is sd[0] and out[7] is None
    assert list(sd) == ["module.w", 0, "other", "module.b", 7]  # input untouched


def test_strip_prefix_plain_dict_stays_plain_dict() -> None:
    out = strip_prefix({"module.a": 1, "module.b": [2]})
    assert type(out) is dict
    assert out == {"a": 1, "b": [2]}


def test_dict_subclass_keeps_its_type_and_state() -> None:
    sd: defaultdict[str, Any] = defaultdict(list, {"module.a": 1})
    out = strip_prefix(sd)
    assert type(out) is defaultdict and out.default_factory is list
    assert dict(out) == {"a": 1}


def test_empty_state_dicts() -> None:
    for fn in (strip_prefix, add_prefix, normalize_keys):
        assert fn({}) == {} and type(fn({})) is dict
        empty: OrderedDict[str, Any] = OrderedDict()
        empty._metadata = OrderedDict()  # type: ignore[attr-defined]
        out = fn(empty)
        assert out == OrderedDict() and out._metadata == OrderedDict()  # type: ignore[attr-defined]
    assert adapt_state_dict({}, []) == OrderedDict()
    assert adapt_state_dict({}, nn.ReLU()) == OrderedDict()
    with pytest.raises(KeyMismatchError) as info:
        adapt_state_dict({}, nn.Linear(1, 1))
    assert info.value.missing == ("weight", "bias")


def test_non_tensor_values_are_renamed_never_dropped() -> None:
    sd = {"module.a": None, "module.b": 3, "module.c": "x", "module._extra_state": {"k": 1}}
    assert strip_prefix(sd) == {"a": None, "b": 3, "c": "x", "_extra_state": {"k": 1}}
    assert add_prefix(strip_prefix(sd)) == sd
    assert normalize_keys({"_orig_mod.a": None}) == {"a": None}


def test_metadata_absent_stays_absent() -> None:
    sd = nn.Linear(2, 2).state_dict()
    del sd._metadata  # type: ignore[attr-defined]
    for out in (strip_prefix(add_prefix(sd)), normalize_keys(sd), adapt_state_dict(sd, sd)):
        assert not hasattr(out, "_metadata")


@pytest.mark.parametrize(
    "key", ["module", "Module.y", "module_list.0.weight", "layer.module.weight"]
)
def test_lookalike_keys_are_untouched(key: str) -> None:
    sd = {key: torch.ones(1)}
    assert list(strip_prefix(sd)) == [key]
    assert list(normalize_keys(sd)) == [key]


def test_strip_removes_the_prefix_repeatedly() -> None:
    assert list(strip_prefix({"module.module.x": 1, "module.y": 2})) == ["x", "y"]
    assert list(strip_prefix({"_orig_mod._orig_mod.x": 1}, "_orig_mod.")) == ["x"]
    # A key that is the prefix and nothing else names nothing; it is left alone.
    assert list(strip_prefix({"module.": 1})) == ["module."]


def test_metadata_matches_torchs_own_wrapper_layouts() -> None:
    """add_prefix writes the _metadata torch's wrappers write; strip_prefix undoes it."""
    model = _bn_model()
    plain = model.state_dict()
    dp = nn.DataParallel(model).state_dict()
    dp_compiled = nn.DataParallel(_compile(model)).state_dict()
    dp_dp = nn.DataParallel(nn.DataParallel(model)).state_dict()

    added = add_prefix(plain, "module.")
    assert list(added) == list(dp) and added._metadata == dp._metadata  # type: ignore[attr-defined]
    added2 = add_prefix(plain, "module._orig_mod.")
    assert list(added2) == list(dp_compiled)
    assert added2._metadata == dp_compiled._metadata  # type: ignore[attr-defined]

    for wrapped, prefix in (
        (dp, "module."),
        (dp_compiled, "module._orig_mod."),
        (dp_dp, "module."),
    ):
        stripped = strip_prefix(wrapped, prefix)
        assert list(stripped) == list(plain)
        assert list(stripped._metadata.items()) == list(plain._metadata.items())  # type: ignore[attr-defined]


def test_metadata_entries_are_copies() -> None:
    sd = nn.Linear(2, 2).state_dict()
    out = add_prefix(sd)
    out._metadata["module"]["version"] = 99  # type: ignore[attr-defined]
    assert sd._metadata[""]["version"] == 1  # type: ignore[attr-defined]


def test_num_batches_tracked_zero_dim_tensors_survive() -> None:
    model = _bn_model()
    model[1].num_batches_tracked.fill_(12)  # type: ignore[operator, union-attr]
    sd = nn.DataParallel(model).state_dict()
    nbt = sd["module.1.num_batches_tracked"]
    assert nbt.dim() == 0 and nbt.dtype == torch.int64
    for out in (strip_prefix(sd), normalize_keys(sd), adapt_state_dict(sd, _bn_model())):
        assert out["1.num_batches_tracked"] is nbt
    fresh = _bn_model()
    fresh.load_state_dict(adapt_state_dict(sd, fresh))
    assert int(fresh[1].num_batches_tracked) == 12  # type: ignore[arg-type]


def test_bad_arguments_are_value_errors() -> None:
    with pytest.raises(ValueError, match=r"ending in '\.'"):
        strip_prefix({}, "module")
    with pytest.raises(ValueError, match=r"ending in '\.'"):
        add_prefix({}, "")
    with pytest.raises(ValueError, match="on_collision"):
        normalize_keys({}, on_collision="last")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- collisions


def test_collision_raises_naming_both_keys_in_either_order() -> None:
    a, b = torch.zeros(1), torch.ones(1)
    for sd in ({"x": a, "module.x": b}, {"module.x": b, "x": a}):
        with pytest.raises(KeyCollisionError) as info:
            strip_prefix(sd)
        assert info.value.keys == ("x", "module.x")
        assert "'x'" in str(info.value) and "'module.x'" in str(info.value)
        assert isinstance(info.value, KeyMismatchError) and isinstance(info.value, DDPStateError)


def test_collision_choices_pick_the_winner_and_keep_position() -> None:
    a, b, c = torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)
    sd = {"x": a, "y": c, "module.x": b}
    kept = strip_prefix(sd, on_collision="keep_existing")
    assert list(kept) == ["x", "y"] and kept["x"] is a
    prefixed = strip_prefix(sd, on_collision="keep_prefixed")
    assert list(prefixed) == ["x", "y"] and prefixed["x"] is b


def test_normalize_collision_between_two_renamed_keys() -> None:
    sd = {"module._orig_mod.x": 1, "_orig_mod.module.x": 2, "module.module.module.x": 3}
    with pytest.raises(KeyCollisionError) as info:
        normalize_keys(sd)
    assert info.value.keys == ("module._orig_mod.x", "_orig_mod.module.x")
    assert normalize_keys(sd, on_collision="keep_prefixed") == {"x": 3}
    assert normalize_keys(sd, on_collision="keep_existing") == {"x": 1}


# --------------------------------------------------------------------------- normalize


def test_normalize_removes_every_torch_wrapper_segment() -> None:
    sd = {
        "module._orig_mod.module.a.w": 1,
        "_orig_mod.enc._orig_mod.b": 2,
        "enc.layer.module.c": 3,  # inner .module. may be real: kept
        "module": 4,
    }
    assert list(normalize_keys(sd)) == ["a.w", "enc.b", "enc.layer.module.c", "module"]


def test_normalize_rewrites_metadata_keeping_the_real_modules_entry() -> None:
    model = _bn_model()
    model[1]._version = 2  # the BatchNorm's own entry must win over wrappers' version 1
    wrapped = _compile(nn.DataParallel(_compile(model)))
    out = normalize_keys(wrapped.state_dict())
    assert list(out._metadata.items()) == list(model.state_dict()._metadata.items())  # type: ignore[attr-defined]
    partial = nn.Sequential(_compile(nn.Linear(2, 2)))
    meta = normalize_keys(partial.state_dict())._metadata  # type: ignore[attr-defined]
    assert list(meta) == ["", "0"]


# --------------------------------------------------------------------------- detect


def test_detect_prefixes() -> None:
    assert KNOWN_PREFIXES == ("module.", "_orig_mod.", "model.")
    assert detect_prefixes(nn.DataParallel(_compile(nn.Linear(1, 1))).state_dict()) == [
        "module.",
        "_orig_mod.",
    ]
    assert detect_prefixes(["model.module.w", "model.module.b"]) == ["model.", "module."]
    assert detect_prefixes(["module.w", "b"]) == []
    assert detect_prefixes(["module"]) == []
    assert detect_prefixes([]) == [] and detect_prefixes([0, 1]) == []


# --------------------------------------------------------------------------- adapt


class HasModuleChild(nn.Module):
    """A plain model whose real submodule is called ``module``."""

    def __init__(self) -> None:
        super().__init__()
        self.module = nn.Linear(2, 2)
        self.scale = nn.Parameter(torch.ones(1))


def test_adapt_target_with_a_real_submodule_named_module() -> None:
    source = nn.DataParallel(HasModuleChild()).state_dict()
    assert list(source) == ["module.scale", "module.module.weight", "module.module.bias"]
    target = HasModuleChild()
    out = adapt_state_dict(source, target)
    assert list(out) == ["scale", "module.weight", "module.bias"]
    assert out["module.weight"] is source["module.module.weight"]
    # And back into a compiled one.
    back = adapt_state_dict(target.state_dict(), _compile(HasModuleChild()))
    assert list(back) == ["_orig_mod.scale", "_orig_mod.module.weight", "_orig_mod.module.bias"]


def test_adapt_inner_dataparallel_given_a_target() -> None:
    inner = nn.Sequential(nn.DataParallel(nn.Linear(2, 2)))
    plain_sd = nn.Sequential(nn.Linear(2, 2)).state_dict()
    out = adapt_state_dict(plain_sd, inner)
    assert list(out) == ["0.module.weight", "0.module.bias"]
    assert out["0.module.weight"] is plain_sd["0.weight"]
    back = adapt_state_dict(inner.state_dict(), nn.DataParallel(nn.Sequential(nn.Linear(2, 2))))
    assert list(back) == ["module.0.weight", "module.0.bias"]
    # Targets given as keys work by the same rules.
    assert list(adapt_state_dict(plain_sd, ["0.module.weight", "0.module.bias"])) == [
        "0.module.weight",
        "0.module.bias",
    ]


def test_adapt_lightning_model_prefix() -> None:
    net = _bn_model()
    lightning_sd = add_prefix(net.state_dict(), "model.")
    out = adapt_state_dict(lightning_sd, nn.DataParallel(_bn_model()))
    assert list(out) == [f"module.{k}" for k in net.state_dict()]
    assert match_keys(lightning_sd, _bn_model()).rule.endswith(
        "leading 'model.' removed from the source"
    )
    # The other way: a plain state dict into a target that has the prefix.
    to_lightning = adapt_state_dict(net.state_dict(), lightning_sd)
    assert list(to_lightning) == list(lightning_sd)


def test_adapt_result_follows_target_order_and_keeps_values() -> None:
    source = OrderedDict([("module.bias", torch.ones(2)), ("module.weight", torch.ones(2, 2))])
    out = adapt_state_dict(source, nn.Linear(2, 2))
    assert list(out) == ["weight", "bias"] and out["bias"] is source["module.bias"]


def test_adapt_carries_source_module_versions_to_target_paths() -> None:
    """An old BatchNorm checkpoint (version 1, no num_batches_tracked) loads into DP."""
    old = _bn_model().state_dict()
    del old["1.num_batches_tracked"]
    old._metadata["1"]["version"] = 1  # type: ignore[attr-defined]
    target = nn.DataParallel(_bn_model())
    with pytest.raises(KeyMismatchError) as info:
        adapt_state_dict(old, target)
    assert info.value.missing == ("module.1.num_batches_tracked",)
    partial = adapt_state_dict(old, target, strict=False)
    assert partial._metadata["module.1"] == {"version": 1}  # type: ignore[attr-defined]
    # BatchNorm reads the version and fills in num_batches_tracked itself.
    result = target.load_state_dict(partial, strict=True)
    assert result.missing_keys == [] and result.unexpected_keys == []


def test_adapt_mismatch_error_lists_keys_counts_and_nearest() -> None:
    target = nn.Sequential(*(nn.Linear(2, 2) for _ in range(4)))
    source = {f"module.blocks.{i}.{p}": torch.ones(1) for i in range(4) for p in ("weight", "bias")}
    source["module.extra"] = torch.ones(1)
    with pytest.raises(KeyMismatchError) as info:
        adapt_state_dict(source, target)
    err = info.value
    assert len(err.missing) == 8 and len(err.unexpected) == 9
    text = str(err)
    assert "8 missing and 9 unexpected" in text
    assert "'0.weight' (nearest: 'module.blocks.0.weight')" in text
    assert "and 3 more" in text and "and 4 more" in text
    assert "strict=False" in text
    assert not text.startswith('"')  # KeyError's quoting is not applied


def test_adapt_strict_false_and_match_keys_report_the_rest() -> None:
    source = {"module.weight": torch.ones(2, 2), "module.extra": torch.ones(1), 3: "x"}
    out = adapt_state_dict(source, nn.Linear(2, 2), strict=False)
    assert list(out) == ["weight"]
    match = match_keys(source, nn.Linear(2, 2))
    assert not match.complete
    assert match.missing == ("bias",) and match.unexpected == ("module.extra", 3)
    assert match.mapping == {"weight": "module.weight"}


def test_adapt_refuses_ambiguous_matches() -> None:
    """Two source keys that reduce to one target key are never guessed between."""
    source = {"module.w": torch.ones(1), "w": torch.zeros(1)}
    with pytest.raises(KeyMismatchError):
        adapt_state_dict(source, ["w"])


def test_adapt_target_kinds() -> None:
    source = nn.DataParallel(nn.Linear(2, 2)).state_dict()
    target_sd = nn.Linear(2, 2).state_dict()
    for target in (target_sd, target_sd.keys(), list(target_sd), tuple(target_sd)):
        assert list(adapt_state_dict(source, target)) == ["weight", "bias"]
    with pytest.raises(TypeError, match="target"):
        adapt_state_dict(source, "weight")


def test_adapt_does_not_mutate_inputs() -> None:
    source = nn.DataParallel(_bn_model()).state_dict()
    before_keys, before_meta = list(source), copy.deepcopy(source._metadata)  # type: ignore[attr-defined]
    target = _bn_model()
    target_before = {k: v.clone() for k, v in target.state_dict().items()}
    adapt_state_dict(source, target)
    assert list(source) == before_keys and source._metadata == before_meta  # type: ignore[attr-defined]
    assert all(torch.equal(v, target_before[k]) for k, v in target.state_dict().items())


def test_unwrap_model_nested_in_any_order() -> None:
    net = nn.Linear(2, 2)
    assert unwrap_model(_compile(nn.DataParallel(_compile(nn.DataParallel(net))))) is net
    assert unwrap_model(net) is net


# --------------------------------------------------------------------------- containers


def _sd() -> dict[str, torch.Tensor]:
    return {"w": torch.ones(2), "b": torch.zeros(2)}


def test_find_bare_and_named_state_dicts() -> None:
    sd = _sd()
    assert find_state_dict(sd) == ((), sd)
    assert find_state_dict({}) == ((), {})
    for name in STATE_DICT_NAMES:
        path, found = find_state_dict({"epoch": 3, "optimizer": {"state": {}}, name: sd})
        assert path == (name,) and found is sd
    path, found = find_state_dict({"model": {"state_dict": sd, "step": 2}, "epoch": 1})
    assert path == ("model", "state_dict") and found is sd
    path, found = find_state_dict({"ckpt": {"model_state": sd}})
    assert path == ("ckpt", "model_state")


def test_find_prefers_the_top_level_and_accepts_one_object_under_two_names() -> None:
    sd = _sd()
    assert find_state_dict({"model": sd, "ema": {"state_dict": _sd()}})[0] == ("model",)
    assert find_state_dict({"model": sd, "state_dict": sd})[0] == ("state_dict",)


def test_find_ambiguous_lists_candidates() -> None:
    ckpt = {"state_dict": _sd(), "state_dict_ema": _sd()}
    with pytest.raises(StateDictNotFoundError) as info:
        find_state_dict(ckpt)
    assert "'state_dict', 'state_dict_ema'" in str(info.value) and "key=" in str(info.value)
    path, _ = find_state_dict(ckpt, key="state_dict_ema")
    assert path == ("state_dict_ema",)


def test_find_none_lists_what_is_there() -> None:
    with pytest.raises(StateDictNotFoundError) as info:
        find_state_dict({"epoch": 3, "net": _sd(), "opt": {"state": {}}})
    text = str(info.value)
    assert "'epoch', 'net', 'opt'" in text and "found at 'net'" in text
    with pytest.raises(StateDictNotFoundError, match=r"pickled nn\.Module"):
        find_state_dict({"model": nn.Linear(1, 1)})
    with pytest.raises(StateDictNotFoundError, match="not a mapping"):
        find_state_dict([1, 2])


def test_find_with_dotted_keys() -> None:
    sd = _sd()
    ckpt = {"model.ema": sd, "runs": [{"weights": sd}], "model": {"state_dict": sd}}
    assert find_state_dict(ckpt, key="model.ema")[0] == ("model.ema",)
    assert find_state_dict(ckpt, key="model.state_dict")[0] == ("model", "state_dict")
    assert find_state_dict(ckpt, key="runs.0.weights")[0] == ("runs", 0, "weights")
    with pytest.raises(StateDictNotFoundError, match=r"no entry 'model\.nope'"):
        find_state_dict(ckpt, key="model.nope")
    with pytest.raises(StateDictNotFoundError, match="not a state dict"):
        find_state_dict(ckpt, key="runs")


def test_replace_state_dict_copies_only_the_path() -> None:
    optimizer = {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1}]}
    inner: OrderedDict[str, Any] = OrderedDict(state_dict={"module.w": torch.ones(1)}, tag="x")
    ckpt = {"epoch": 4, "optimizer": optimizer, "model": inner}
    path, sd = find_state_dict(ckpt)
    new_sd = strip_prefix(sd)
    new = replace_state_dict(ckpt, path, new_sd)
    assert new["model"]["state_dict"] is new_sd and type(new["model"]) is OrderedDict
    assert new["optimizer"] is optimizer and new["epoch"] == 4 and new["model"]["tag"] == "x"
    assert list(ckpt["model"]["state_dict"]) == ["module.w"]  # input untouched
    assert replace_state_dict(ckpt, (), new_sd) is new_sd
    Pair = namedtuple("Pair", "meta weights")
    seq = [Pair("m", sd)]
    out = replace_state_dict(seq, (0, "weights"), new_sd)
    assert out[0].weights is new_sd and out[0].meta == "m" and seq[0].weights is sd
    with pytest.raises(StateDictNotFoundError, match="no entry 'nope'"):
        replace_state_dict(ckpt, ("model", "nope"), new_sd)


def test_real_checkpoint_file_round_trip(tmp_path: Path) -> None:
    """Save a DDP-style training checkpoint, convert its keys in place, load it plainly."""
    model = nn.DataParallel(_bn_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(8, 3)).sum().backward()
    optimizer.step()
    source = tmp_path / "ddp.pt"
    torch.save(
        {"epoch": 5, "model_state_dict": model.state_dict(), "optim": optimizer.state_dict()},
        source,
    )
    ckpt = torch.load(source, weights_only=True)
    path, sd = find_state_dict(ckpt)
    assert path == ("model_state_dict",) and detect_prefixes(sd) == ["module."]
    converted = replace_state_dict(ckpt, path, strip_prefix(sd))
    target_file = tmp_path / "plain.pt"
    torch.save(converted, target_file)
    reloaded = torch.load(target_file, weights_only=True)
    plain = _bn_model()
    result = plain.load_state_dict(reloaded["model_state_dict"], strict=True)
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert reloaded["epoch"] == 5 and reloaded["optim"]["param_groups"][0]["lr"] == 0.1
    for key, value in model.module.state_dict().items():
        assert torch.equal(plain.state_dict()[key], value)
