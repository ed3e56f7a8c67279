"""Property tests for the key functions: round trips, no mutation, collisions always raise."""

from __future__ import annotations

import contextlib
import copy
from collections import OrderedDict
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddpstate.errors import DDPStateError, KeyCollisionError
from ddpstate.keys import adapt_state_dict, add_prefix, normalize_keys, strip_prefix

PROPS = settings(max_examples=150, deadline=None)

PREFIXES = st.sampled_from(["module.", "_orig_mod.", "model.", "module._orig_mod.", "a.b."])
ANY_SEGMENT = st.sampled_from(
    ["a", "b", "0", "1", "enc", "weight", "Module", "module_list", "module", "_orig_mod", "model"]
)
# Segments no wrapper adds, for properties that need wrapper-free source names.
PLAIN_SEGMENT = st.sampled_from(["a", "b", "0", "1", "enc", "weight", "Module", "module_list"])
VALUES = st.one_of(
    st.integers(0, 4).map(lambda n: torch.arange(n, dtype=torch.float32)),
    st.integers(0, 9).map(torch.tensor),  # 0-dim, like num_batches_tracked
    st.integers(),
    st.none(),
    st.text(max_size=3),
)


def _module_paths(keys: list[str]) -> list[str]:
    paths = [""]
    for key in keys:
        parts = key.split(".")
        for i in range(1, len(parts)):
            path = ".".join(parts[:i])
            if path not in paths:
                paths.append(path)
    return paths


@st.composite
def state_dicts(
    draw: st.DrawFn, prefix: str = "", segment: st.SearchStrategy[str] = ANY_SEGMENT
) -> dict[Any, Any]:
    """A dict or OrderedDict (maybe with _metadata) whose keys do not start with ``prefix``."""
    names = draw(st.lists(st.lists(segment, min_size=1, max_size=4).map(".".join), max_size=8))
    names = list(dict.fromkeys(n for n in names if not (prefix and n.startswith(prefix))))
    ints = draw(st.lists(st.integers(0, 5), unique=True, max_size=2))
    keys: list[Any] = draw(st.permutations([*names, *ints]))
    kind = draw(st.sampled_from(["dict", "odict", "odict+meta"]))
    sd: dict[Any, Any] = {} if kind == "dict" else OrderedDict()
    for key in keys:
        sd[key] = draw(VALUES)
    if kind == "odict+meta":
        stem = prefix[:-1]
        paths = [
            p
            for p in draw(st.permutations(_module_paths(names)))
            if not (prefix and (p == stem or p.startswith(prefix))) and draw(st.booleans())
        ]
        sd._metadata = OrderedDict(  # type: ignore[attr-defined]
            (p, {"version": draw(st.integers(1, 3))}) for p in paths
        )
    return sd


def _snapshot(sd: dict[Any, Any]) -> tuple[Any, ...]:
    meta = getattr(sd, "_metadata", None)
    return (
        type(sd),
        [(k, id(v)) for k, v in sd.items()],
        None if meta is None else copy.deepcopy(list(meta.items())),
    )


def _same_entries(a: dict[Any, Any], b: dict[Any, Any]) -> bool:
    return list(a) == list(b) and all(a[k] is b[k] for k in a)


@PROPS
@given(st.data(), PREFIXES)
def test_strip_undoes_add_including_order_and_metadata(data: st.DataObject, prefix: str) -> None:
    sd = data.draw(state_dicts(prefix))
    out = strip_prefix(add_prefix(sd, prefix), prefix)
    assert type(out) is type(sd)
    assert _same_entries(out, sd)
    if hasattr(sd, "_metadata"):
        assert list(out._metadata.items()) == list(sd._metadata.items())  # type: ignore[attr-defined]
    else:
        assert not hasattr(out, "_metadata")


@PROPS
@given(st.data(), PREFIXES)
def test_inputs_are_never_mutated(data: st.DataObject, prefix: str) -> None:
    sd = data.draw(state_dicts())
    before = _snapshot(sd)
    for call in (
        lambda: strip_prefix(sd, prefix, on_collision="keep_prefixed"),
        lambda: add_prefix(sd, prefix),
        lambda: normalize_keys(sd, on_collision="keep_existing"),
        lambda: adapt_state_dict(sd, [k for k in sd if isinstance(k, str)], strict=False),
        lambda: adapt_state_dict(add_prefix(sd, prefix), list(sd)),
    ):
        # An error is fine; touching the input is not.
        with contextlib.suppress(DDPStateError):
            call()
        assert _snapshot(sd) == before


@PROPS
@given(st.data(), PREFIXES)
def test_strip_collision_always_raises(data: st.DataObject, prefix: str) -> None:
    sd = data.draw(state_dicts(prefix))
    names = [k for k in sd if isinstance(k, str)]
    if not names:
        names = ["w"]
        sd["w"] = torch.zeros(1)
    victim = data.draw(st.sampled_from(names))
    extra = prefix * data.draw(st.integers(1, 2)) + victim
    at = data.draw(st.integers(0, len(sd)))
    items = list(sd.items())
    items.insert(at, (extra, "injected"))
    crowded = type(sd)(items)
    try:
        strip_prefix(crowded, prefix)
    except KeyCollisionError as exc:
        assert exc.keys == (victim, extra)
    else:
        raise AssertionError(f"no collision raised for {victim!r} and {extra!r}")
    kept = strip_prefix(crowded, prefix, on_collision="keep_existing")
    assert kept[victim] is sd[victim] and len(kept) == len(sd)
    assert strip_prefix(crowded, prefix, on_collision="keep_prefixed")[victim] == "injected"


@PROPS
@given(st.data())
def test_normalize_collision_always_raises(data: st.DataObject) -> None:
    sd = data.draw(state_dicts(segment=PLAIN_SEGMENT))
    names = [k for k in sd if isinstance(k, str)]
    if not names:
        names = ["enc.w"]
        sd["enc.w"] = torch.zeros(1)
    victim = data.draw(st.sampled_from(names))
    lead = data.draw(st.sampled_from(["module.", "_orig_mod.", "module._orig_mod.", ""]))
    parts = victim.split(".")
    cut = data.draw(st.integers(0, len(parts) - 1))
    inner = data.draw(st.booleans()) or not lead
    if inner:
        parts.insert(cut, "_orig_mod")
    extra = lead + ".".join(parts)
    crowded = type(sd)([*sd.items(), (extra, "injected")])
    try:
        normalize_keys(crowded)
    except KeyCollisionError as exc:
        assert exc.keys == (victim, extra)
    else:
        raise AssertionError(f"no collision raised for {victim!r} and {extra!r}")


@PROPS
@given(st.data())
def test_normalize_is_idempotent(data: st.DataObject) -> None:
    sd = data.draw(state_dicts())
    once = normalize_keys(sd, on_collision="keep_existing")
    twice = normalize_keys(once)
    assert _same_entries(once, twice)
    if hasattr(once, "_metadata"):
        assert list(twice._metadata.items()) == list(once._metadata.items())  # type: ignore[attr-defined]


@PROPS
@given(st.data(), st.lists(st.sampled_from(["module.", "_orig_mod."]), max_size=3))
def test_adapt_finds_the_way_back_through_any_wrapper_chain(
    data: st.DataObject, chain: list[str]
) -> None:
    sd = {
        k: v for k, v in data.draw(state_dicts(segment=PLAIN_SEGMENT)).items() if isinstance(k, str)
    }
    wrapped = sd
    for prefix in chain:
        wrapped = add_prefix(wrapped, prefix)
    back = adapt_state_dict(wrapped, list(sd))
    assert _same_entries(dict(back), sd)
    forth = adapt_state_dict(sd, list(wrapped))
    assert _same_entries(dict(forth), wrapped)
