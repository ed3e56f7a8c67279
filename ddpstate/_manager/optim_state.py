"""Optimizer state keyed by parameter name: an optimizer's model entry, and the two forms.

``Optimizer.state_dict()`` keys each parameter's state by its position in
``param_groups``, so a model whose layers are declared in another order takes
the moments of the wrong layer without a word. ``CheckpointManager.save``
therefore writes each optimizer with its model's parameter names (as the model
entry's keys are: the wrappers' ``module.``/``_orig_mod.`` removed), and ``restore`` maps
them back onto the live optimizer by name before anything is loaded.

The mapping is written here rather than taken from torch's
``get_optimizer_state_dict``/``set_optimizer_state_dict``: those run a
zero-gradient ``step()`` on an optimizer that has no state yet
(``_init_optim_state``), which on save changes live training (Adam's step count
becomes 1, SGD's first dampened step changes); on restore they refuse,
unless ``strict=False``, a checkpoint without state for some parameter (one
that had no gradient yet), which plain optimizers save and load; and they keep
``DataParallel``'s ``module.`` in the names (checked on torch 2.13). The saved
form is plain dicts, lists, tensors, strings and numbers, so plain
``torch.load`` opens it, and ``Optimizer.load_state_dict`` still reads it by
position as before.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Optional

import torch
from torch import nn

from ddpstate._io.model_state import DTypePolicy
from ddpstate._keys.wrappers import wrapper_chain
from ddpstate._warn import warn
from ddpstate.errors import DTypeMismatchError, InvalidArgumentError, OptimizerStateMismatchError

_PARAMS = "params"
# torch >= 2.6 records the names an optimizer was built with in its groups; the
# live group's own names win on load (Optimizer.load_state_dict keeps them).
_PARAM_NAMES = "param_names"
# Optimizer.load_state_dict never casts "step" (it stays float32 on the CPU).
_UNCAST_KEYS = frozenset({"step"})
_LISTED = 8
_COMPILED_SEGMENT = "_orig_mod"


def _listing(items: list[str], show: Callable[[str], str] = repr) -> str:
    shown = ", ".join(show(i) for i in items[:_LISTED])
    return shown + (f" and {len(items) - _LISTED} more" if len(items) > _LISTED else "")


def params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """``optimizer``'s parameters, in ``param_groups`` order."""
    return [p for group in optimizer.param_groups for p in group[_PARAMS]]


def owner(optimizer: torch.optim.Optimizer, state: Mapping[str, Any], where: str) -> Optional[str]:
    """The entry name of the model in ``state`` that holds all of ``optimizer``'s parameters.

    Returns None when no model entry holds any of them.

    Raises:
        InvalidArgumentError: The parameters are spread over several model
            entries, or only some of them belong to a model entry.
    """
    wanted = {id(p) for p in params(optimizer)}
    holders: dict[str, int] = {}
    for name, obj in state.items():
        if isinstance(obj, nn.Module):
            held = len(wanted & {id(p) for p in obj.parameters()})
            if held:
                holders[name] = held
    if not holders:
        return None
    full = [n for n, held in holders.items() if held == len(wanted)]
    if len(full) == 1:
        return full[0]
    if full:
        reason = f"every one of its parameters is in each of the model entries {full}"
    else:
        counts = ", ".join(f"{n!r} holds {held}" for n, held in holders.items())
        reason = f"no model entry holds all {len(wanted)} of its parameters ({counts})"
    raise InvalidArgumentError(
        f"{where}: optimizer state is saved by parameter name, so the optimizer must "
        f"belong to exactly one model entry of the same state; {reason}. Pass each "
        f"model once, and one model entry per optimizer (put models one optimizer "
        f"trains together in one nn.ModuleDict entry)"
    )


def param_names(model: nn.Module) -> dict[int, list[str]]:
    """Each parameter's names in ``model`` as its entry's keys have them, by id.

    The wrappers ``model`` holds are peeled off and compiled submodules lose their
    ``_orig_mod`` segment, as ``unwrapped_state_dict`` does for the model entry;
    tied parameters have several names.
    """
    *_, plain = wrapper_chain(model)
    names: dict[int, list[str]] = {}
    for name, param in plain.named_parameters(remove_duplicate=False):
        # torch.compile reserves this attribute name for the module it wraps.
        kept = ".".join(s for s in name.split(".") if s != _COMPILED_SEGMENT)
        names.setdefault(id(param), []).append(kept)
    return names


def is_by_name(value: Any) -> bool:
    """Whether a saved optimizer state dict is in the by-name form (not positional)."""
    groups = value.get("param_groups") if isinstance(value, Mapping) else None
    return (
        isinstance(groups, list)
        and any(isinstance(g, Mapping) and g.get(_PARAMS) for g in groups)
        and all(
            isinstance(g, Mapping) and all(isinstance(p, str) for p in g.get(_PARAMS, ()))
            for g in groups
        )
    )


def by_name(optimizer: torch.optim.Optimizer, model: nn.Module, where: str) -> dict[str, Any]:
    """``optimizer.state_dict()`` with parameter positions replaced by ``model``'s names."""
    positional = optimizer.state_dict()
    names = param_names(model)
    name_of: dict[Any, str] = {}
    # Optimizer.state_dict numbers the parameters in group order; zipping the saved
    # groups with the live ones reads that numbering instead of re-deriving it.
    for saved, live in zip(positional["param_groups"], optimizer.param_groups, strict=True):
        for index, param in zip(saved[_PARAMS], live[_PARAMS], strict=True):
            if id(param) not in names:
                raise InvalidArgumentError(
                    f"{where}: the optimizer holds a parameter of shape {list(param.shape)} "
                    f"that is not among its model's named parameters; build the optimizer "
                    f"from model.parameters()"
                )
            name_of[index] = names[id(param)][0]
    out = {k: v for k, v in positional.items() if k not in ("state", "param_groups")}
    out["state"] = {name_of.get(k, k): v for k, v in positional["state"].items()}
    out["param_groups"] = [
        {**group, _PARAMS: [name_of[i] for i in group[_PARAMS]]}
        for group in positional["param_groups"]
    ]
    return out


def _resolve(
    saved: Mapping[str, Any], optimizer: torch.optim.Optimizer, model: nn.Module, where: str
) -> tuple[list[list[str]], list[int]]:
    """Each live group's saved names (in the live order) and the saved group it takes.

    Raises:
        OptimizerStateMismatchError: A live parameter has no saved group, a saved
            one has no live parameter, or a live group's parameters come from
            several saved groups (their settings could differ).
    """
    group_of = {n: i for i, g in enumerate(saved["param_groups"]) for n in g[_PARAMS]}
    names = param_names(model)
    chosen: list[list[str]] = []
    missing: list[str] = []
    for group in optimizer.param_groups:
        picked = []
        for param in group[_PARAMS]:
            aliases = names.get(id(param), [])
            found = next((n for n in aliases if n in group_of), None)
            if found is None:
                missing.append(aliases[0] if aliases else f"<unnamed {list(param.shape)}>")
            else:
                picked.append(found)
        chosen.append(picked)
    taken = {n for picked in chosen for n in picked}
    unexpected = [n for n in group_of if n not in taken]
    if missing or unexpected:
        raise OptimizerStateMismatchError(
            f"{where}: the saved optimizer state does not hold the same parameters as the "
            f"live optimizer (matched by name): live parameters in no saved group: "
            f"[{_listing(missing)}]; saved parameters the live optimizer lacks: "
            f"[{_listing(unexpected)}]. Build the optimizer over the same parameters as the "
            f"run that saved it, or leave it out of restore's state to start it afresh",
            missing=missing,
            unexpected=unexpected,
        )
    sources: list[int] = []
    for index, picked in enumerate(chosen):
        from_groups = sorted({group_of[n] for n in picked})
        if len(from_groups) > 1:
            spread = "; ".join(
                f"saved group {g}: [{_listing([n for n in picked if group_of[n] == g])}]"
                for g in from_groups
            )
            raise OptimizerStateMismatchError(
                f"{where}: live param group {index} holds parameters of "
                f"{len(from_groups)} saved param groups ({spread}), whose settings "
                f"(lr, weight decay...) may differ, so names cannot say which to keep. "
                f"Build the optimizer's param groups as the run that saved it did (a group "
                f"may be split, not merged)",
                missing=[],
                unexpected=[],
            )
        sources.append(from_groups[0] if from_groups else -1)
    return chosen, sources


def to_positional(
    saved: Mapping[str, Any], optimizer: torch.optim.Optimizer, model: nn.Module, where: str
) -> dict[str, Any]:
    """A by-name optimizer state dict in ``optimizer``'s own positional layout.

    Each live group takes the settings of the saved group its parameters came
    from; each live parameter the state saved under its name. Nothing is loaded.

    Raises:
        OptimizerStateMismatchError: Names cannot resolve the layout (see ``_resolve``).
    """
    chosen, sources = _resolve(saved, optimizer, model, where)
    saved_state: Mapping[str, Any] = saved.get("state", {})
    live_groups = optimizer.state_dict()["param_groups"]
    groups: list[dict[str, Any]] = []
    state: dict[int, Any] = {}
    index = 0
    for live, picked, source in zip(live_groups, chosen, sources, strict=True):
        base = saved["param_groups"][source] if source >= 0 else live
        settings = {k: v for k, v in base.items() if k not in (_PARAMS, _PARAM_NAMES)}
        ids = []
        for name in picked:
            if name in saved_state:
                state[index] = saved_state[name]
            ids.append(index)
            index += 1
        groups.append({**settings, _PARAMS: ids})
    out = {k: v for k, v in saved.items() if k not in ("state", "param_groups")}
    out["state"] = state
    out["param_groups"] = groups
    return out


def check_dtypes(
    positional: Mapping[str, Any],
    optimizer: torch.optim.Optimizer,
    model: Optional[nn.Module],
    *,
    policy: DTypePolicy,
    where: str,
) -> None:
    """Refuse (``policy="refuse"``) the saved state tensors that loading would cast.

    ``Optimizer.load_state_dict`` casts each floating state tensor (but ``step``)
    to its parameter's dtype, silently; a change of kind never happens there.

    Raises:
        DTypeMismatchError: A state tensor's dtype differs from its parameter's.
    """
    if policy != "refuse" or not isinstance(positional.get("state"), Mapping):
        return
    names = param_names(model) if model is not None else {}
    changes: list[str] = []
    # A positional state of another layout is Optimizer.load_state_dict's to refuse.
    groups = zip(positional.get("param_groups", []), optimizer.param_groups, strict=False)
    for saved_group, live in groups:
        for index, param in zip(saved_group.get(_PARAMS, []), live[_PARAMS], strict=False):
            entry = positional["state"].get(index)
            if not isinstance(entry, Mapping) or not param.is_floating_point():
                continue
            label = names.get(id(param), [f"#{index}"])[0]
            changes += [
                f"{label!r}/{key} (saved {str(value.dtype)[6:]}, parameter {str(param.dtype)[6:]})"
                for key, value in entry.items()
                if key not in _UNCAST_KEYS
                and isinstance(value, torch.Tensor)
                and value.is_floating_point()
                and value.dtype != param.dtype
            ]
    if changes:
        raise DTypeMismatchError(
            f"{where}: {len(changes)} optimizer state tensor(s) would change dtype: "
            f"{_listing(changes, str)}. Cast the model to the saved dtype before restoring, or "
            f"pass allow_dtype_change=True to cast the saved state to the parameters' dtypes"
        )


def saved_form(name: str, optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> Any:
    """What ``save`` writes for optimizer entry ``name``: by name when a model entry owns it.

    Raises:
        InvalidArgumentError: Its parameters belong to several model entries (see ``owner``).
    """
    where = f"CheckpointManager.save: state[{name!r}]"
    model = owner(optimizer, state, where)
    if model is None:
        return optimizer.state_dict()
    return by_name(optimizer, state[model], where)


def warn_unpaired(state: Mapping[str, Any], folder: str) -> None:
    """Warn once per optimizer of ``state`` that no model entry owns (saved by position)."""
    for name, obj in state.items():
        if isinstance(obj, torch.optim.Optimizer) and owner(obj, state, folder) is None:
            warn(
                f"CheckpointManager.save ({folder}): optimizer entry {name!r} has no model in "
                f"the same state, so its state is saved by parameter position: a model whose "
                f"layers are later declared in another order would take the wrong layers' "
                f"state. Pass its model in the same state (e.g. {{'model': model, "
                f"{name!r}: optimizer}}) to save it by parameter name"
            )
