"""``diff_files``: compare two checkpoints' model state dicts tensor by tensor."""

from __future__ import annotations

import collections
import contextlib
import os
from collections.abc import Mapping
from typing import Any, Optional

import torch

from ddpstate import keys
from ddpstate._collectives import with_message
from ddpstate._convert.common import (
    StateEdit,
    describe,
    dotted,
    find_state_dict,
    old_arguments,
)
from ddpstate._convert.results import DiffResult
from ddpstate._convert.source import (
    Checkpoint,
    check_materializable,
    failures_named,
    iter_tensors,
    read_checkpoint,
)
from ddpstate._fs import PathLike
from ddpstate._io.safetensors_io import tied_keys
from ddpstate._progress import Progress
from ddpstate.errors import AmbiguousStateDictError, StateDictNotFoundError

_DIFF_CHUNK = 1 << 22


def _model_tensors(
    ckpt: Checkpoint, key: Optional[str] = None
) -> tuple[str, Mapping[Any, Any], Optional[str]]:
    """``(where, state dict, note)``: the model tensors diff compares in one file.

    ``key`` picks the state dict where the file has that entry; a file that is
    a bare state dict itself is taken whole (so ``--key state_dict`` compares a
    Lightning checkpoint with a plain one). Several state dicts and no ``key``
    is refused, as :func:`ddpstate.load_model_state` refuses it.
    """
    root = ckpt.obj
    if isinstance(root, torch.nn.Module):
        return f"the parameters of the pickled {type(root).__name__}", root.state_dict(), None
    note = None
    try:
        path, sd = find_state_dict(root, key)
    except AmbiguousStateDictError as exc:  # only when no key names one
        raise with_message(exc, f"{ckpt.path}: {exc}") from exc
    except StateDictNotFoundError as exc:
        if key is None:
            every = collections.OrderedDict((dotted(p) or "", t) for p, t in iter_tensors(root))
            return "every tensor (no model state dict found)", every, None
        try:
            path, sd = find_state_dict(root, None)
        except StateDictNotFoundError:
            path = None
        if path != ():
            raise with_message(exc, f"{ckpt.path}: {exc}") from exc
        note = f"{ckpt.path} is a bare state dict without {key!r}; compared whole"
    return (f"'{dotted(path)}'" if path else "the whole file"), sd, note


def _tied_only(sd: Mapping[Any, Any], other: Mapping[Any, Any]) -> dict[Any, Any]:
    """``{key: canonical}``: keys of ``sd`` absent from ``other``, tied to a key both have.

    A tied key (lm_head.weight sharing the embedding) is the same tensor as its
    canonical key, so comparing the canonical key compares it; transformers'
    ``save_pretrained`` leaves such a key out of its files.
    """
    tensors = {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}
    aliases, _ = tied_keys(tensors)
    return {k: c for k, c in aliases.items() if k not in other and c in other}


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    flat_a = a.reshape(-1)
    flat_b = b.reshape(-1)
    worst = 0.0
    for start in range(0, flat_a.numel(), _DIFF_CHUNK):
        x = flat_a[start : start + _DIFF_CHUNK]
        y = flat_b[start : start + _DIFF_CHUNK]
        if x.is_complex():
            delta = (x.to(torch.complex128) - y.to(torch.complex128)).abs()
        elif x.dtype == torch.bool:
            delta = (x != y).to(torch.float64)
        else:
            try:
                x64, y64 = x.to(torch.float64), y.to(torch.float64)
            except (RuntimeError, TypeError):  # no float64 for this dtype: count differing bytes
                delta = (x.view(torch.uint8) != y.view(torch.uint8)).to(torch.float64)
            else:
                # NaN against NaN is equal; NaN against a number (or inf - inf) counts as inf.
                delta = (x64 - y64).abs().nan_to_num(nan=float("inf"), posinf=float("inf"))
                delta = torch.where(torch.isnan(x64) & torch.isnan(y64), 0.0, delta)
        if delta.numel():
            worst = max(worst, float(delta.max()))
    return worst


def diff_files(
    a: PathLike,
    b: PathLike,
    *,
    raw_keys: bool = False,
    key: Optional[str] = None,
    strip_prefix: Optional[str] = None,
    add_prefix: Optional[str] = None,
    normalize: bool = False,
    on_collision: keys.OnCollision = "error",
    atol: float = 0.0,
    weights_only: bool = True,
    progress: bool = False,
    storage_options: Optional[dict[str, Any]] = None,
    **legacy: Any,
) -> DiffResult:
    """Compare the model state dicts of two checkpoint files, tensor by tensor.

    The state dicts are located as :func:`convert_file` locates them (``key``
    names one; a file holding several is refused without it), the key rule
    (``strip_prefix``, ``add_prefix`` or ``normalize``, as for
    :func:`convert_file`) is applied to both, and keys are then compared after
    removing wrapper prefixes (``module.``, ``_orig_mod.``) unless
    ``raw_keys``; shapes and dtypes must match; the largest absolute
    difference of each shared tensor is reported. Tensors are read one pair at
    a time (a sharded checkpoint: one tensor of one shard at a time).

    Args:
        a: First checkpoint (any format ddpstate reads, a sharded one included).
        b: Second checkpoint.
        raw_keys: Compare keys exactly as stored (after the key rule, if any).
        key: Dotted path of the model state dict in each file that has it; a
            file that is a bare state dict is compared whole.
        strip_prefix: Remove this prefix from both files' model keys.
        add_prefix: Add this prefix to both files' model keys.
        normalize: Remove every wrapper prefix from both (the default unless
            ``raw_keys``; with ``raw_keys`` it still applies).
        on_collision: When renaming makes two keys of a file equal: ``"error"``,
            ``"keep_existing"`` or ``"keep_prefixed"``.
        atol: Differences up to this count as equal.
        weights_only: ``False`` loads with torch's full unpickler, which runs
            whatever code the files name: only for files you trust.
        progress: Draw a progress bar on stderr (only on a terminal).
        storage_options: fsspec options for URLs.
        **legacy: ``unsafe=`` (now ``weights_only=``, inverted), with a
            ``DeprecationWarning``.

    Returns:
        A :class:`DiffResult`; ``.equal`` tells the verdict.

    Raises:
        CheckpointNotFoundError, CheckpointFormatError, CheckpointCorruptError,
        UnsafeCheckpointError: as for :func:`convert_file`.
        KeyCollisionError: Normalizing a file's keys makes two of them equal
            (compare with ``raw_keys=True``).
        AmbiguousStateDictError: A file holds several state dicts and no
            ``key`` names one (the message names them).
        StateDictNotFoundError: ``key`` is in neither place it could be.
        InvalidArgumentError: More than one key rule.

    Example:
        >>> import torch, tempfile, os
        >>> from ddpstate.convert import diff_files
        >>> d = tempfile.mkdtemp()
        >>> torch.save({"module.w": torch.ones(2)}, os.path.join(d, "a.pt"))
        >>> torch.save({"w": torch.ones(2) + 1e-7}, os.path.join(d, "b.pt"))
        >>> diff_files(os.path.join(d, "a.pt"), os.path.join(d, "b.pt"), atol=1e-6).equal
        True
    """
    unsafe = not old_arguments("diff_files", legacy, weights_only=weights_only)[0]
    edit = StateEdit(
        strip_prefix=strip_prefix, add_prefix=add_prefix, normalize=normalize,
        on_collision=on_collision,
    )  # fmt: skip
    with contextlib.ExitStack() as stack:
        stack.enter_context(failures_named(f"{os.fspath(a)} or {os.fspath(b)}"))
        ca, cb = (
            read_checkpoint(os.fspath(p), unsafe=unsafe, storage_options=storage_options)
            for p in (a, b)
        )
        where_a, sd_a, note_a = _model_tensors(ca, key)
        where_b, sd_b, note_b = _model_tensors(cb, key)
        sd_a, sd_b = edit.rename(sd_a), edit.rename(sd_b)
        if not raw_keys:
            sd_a = keys.normalize_keys(sd_a, on_collision=on_collision)
            sd_b = keys.normalize_keys(sd_b, on_collision=on_collision)
        tied_a, tied_b = _tied_only(sd_a, sd_b), _tied_only(sd_b, sd_a)
        only_a = tuple(str(k) for k in sd_a if k not in sd_b and k not in tied_a)
        only_b = tuple(str(k) for k in sd_b if k not in sd_a and k not in tied_b)
        mismatched: list[tuple[str, str, str]] = []
        diffs: dict[str, float] = {}
        shared = [k for k in sd_a if k in sd_b]
        total = sum(
            v.nbytes for k in shared for v in (sd_a[k], sd_b[k]) if isinstance(v, torch.Tensor)
        )
        bar = stack.enter_context(
            contextlib.closing(Progress(total, "diff", enabled=None if progress else False))
        )
        for k in shared:
            va, vb = sd_a[k], sd_b[k]
            # A tensor's description is its dtype and shape: equal ones are comparable.
            what_a, what_b = describe(va), describe(vb)
            if what_a != what_b:
                mismatched.append((str(k), what_a, what_b))
            if what_a != what_b or not isinstance(va, torch.Tensor):
                continue
            check_materializable(ca, str(k), va)
            check_materializable(cb, str(k), vb)
            diffs[str(k)] = _max_abs_diff(va, vb)
            bar.update(va.nbytes + vb.nbytes)
        notes = [f"compared {where_a} of {ca.path} with {where_b} of {cb.path}"]
        notes += [n for n in (note_a, note_b) if n]
        notes += [
            f"{k} is tied to {c} in {side} (one tensor under both keys) and absent from the "
            f"other, as transformers leaves a tied key out; compared as {c}"
            for side, tied in (("A", tied_a), ("B", tied_b))
            for k, c in tied.items()
        ]
        if not raw_keys:
            notes.append(
                "keys compared without wrapper prefixes (--raw-keys compares them as stored)"
            )
        return DiffResult(
            a=ca.path,
            b=cb.path,
            only_a=only_a,
            only_b=only_b,
            mismatched=tuple(mismatched),
            max_abs_diff=diffs,
            atol=atol,
            different_values=tuple(k for k, v in diffs.items() if not v <= atol),
            notes=tuple(notes),
        )
