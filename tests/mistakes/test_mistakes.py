"""Mistakes a new user makes, each refused loudly or handled right (issue 15).

One test (or table) per row of the issue that a single process shows; the
multi-rank rows are in ``test_mistakes_dist.py``.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import enum
import io
import pathlib
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import ddpstate
from ddpstate import formats
from ddpstate.cli import main
from ddpstate.errors import (
    CheckpointFormatError,
    DDPStateError,
    DeviceMapError,
    InvalidArgumentError,
    ShapeMismatchError,
    UnsafeCheckpointError,
)
from ddpstate.manager import verify_checkpoint


class Color(enum.Enum):
    RED = 1
    BLUE = 2


@dataclass
class Config:
    lr: float
    tags: list[str]


class Opaque:
    def __init__(self) -> None:
        self.x = 1


# --------------------------------------------------------------------------- row 2: safe types


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray):
        return (
            type(b) is np.ndarray
            and a.dtype == b.dtype
            and a.shape == b.shape
            and np.array_equal(a, b, equal_nan=a.dtype.kind in "fc")
        )
    if isinstance(a, collections.defaultdict):
        return type(b) is type(a) and b.default_factory is a.default_factory and a == b
    if isinstance(a, (dict, list, tuple)):
        return type(b) is type(a) and a == b
    return type(b) is type(a) and a == b


#: Restored out of the box: saved by save() and restored by restore()/load().
EVERYDAY: dict[str, Any] = {
    "np.float64": np.float64(0.9),
    "np.float32": np.float32(1.5),
    "np.float16": np.float16(2.5),
    "np.int8": np.int8(-3),
    "np.uint64": np.uint64(2**63),
    "np.bool_": np.bool_(True),
    "np.complex128": np.complex128(1 - 2j),
    "np.longdouble": np.longdouble(3.25),
    "array float32 2-d": np.arange(6, dtype=np.float32).reshape(2, 3),
    "array int64": np.arange(5),
    "array uint8": np.array([0, 255], dtype=np.uint8),
    "array bool": np.array([True, False]),
    "array complex64": np.array([1 + 1j], dtype=np.complex64),
    "array float16 fortran": np.asfortranarray(np.ones((2, 3), dtype=np.float16)),
    "array empty": np.zeros((0, 4)),
    "array nan": np.array([np.nan, 1.0]),
    "Path": pathlib.Path("/data/run1/ckpt"),
    "PurePosixPath": pathlib.PurePosixPath("a/b"),
    "PureWindowsPath": pathlib.PureWindowsPath("C:/a"),
    "datetime": datetime.datetime(2024, 5, 6, 7, 8, 9, 10),
    "datetime utc": datetime.datetime(2024, 5, 6, tzinfo=datetime.timezone.utc),
    "date": datetime.date(2024, 1, 31),
    "time": datetime.time(12, 30),
    "timedelta": datetime.timedelta(hours=3, microseconds=5),
    "Namespace": argparse.Namespace(lr=0.1, name="exp", steps=[1, 2]),
    "OrderedDict": collections.OrderedDict([("b", 1), ("a", 2.0)]),
    "nested": {"hist": [np.float32(0.5), np.float32(0.25)], "at": datetime.date(2024, 2, 1)},
    "set": {1, 2, 3},
    "complex": 1 + 2j,
    "tensor in Namespace": argparse.Namespace(w=torch.ones(2)),
}

#: Refused at save (path named) unless listed in safe_globals; (value, allowed with).
REFUSED: dict[str, tuple[Any, list[Any]]] = {
    "enum member": (Color.RED, [Color]),
    "dataclass": (Config(0.1, ["a"]), [Config]),
    "plain class": (Opaque(), [Opaque]),
    "numpy object array": (np.array([1, "a"], dtype=object), []),
    "defaultdict(Config)": (collections.defaultdict(Opaque), []),
    # Plain torch cannot rebuild one: refused, naming dict(...) as the fix.
    "defaultdict(list)": (collections.defaultdict(list, {"x": [1, 2]}), []),
    "defaultdict(int)": (collections.defaultdict(int, {"n": 3}), []),
    "whole nn.Module": (nn.Linear(2, 2), []),
}


@pytest.mark.parametrize("name", list(EVERYDAY))
def test_everyday_types_save_verify_and_restore(name: str, tmp_path: Path) -> None:
    value = EVERYDAY[name]
    with ddpstate.CheckpointManager(tmp_path / "run") as manager:
        manager.save(1, {"value": value})
        assert verify_checkpoint(manager.directory).ok
        state: dict[str, Any] = {"value": None}
        assert manager.restore(state) == 1
    restored = state["value"]
    if name == "tensor in Namespace":  # restored onto this rank's device ("auto")
        assert torch.equal(restored.w.cpu(), value.w)
    else:
        assert _same(value, restored), (value, restored)
    # The same both ways through the plain save/load pair.
    ddpstate.save({"value": value}, tmp_path / "v.pt")
    loaded = ddpstate.load(tmp_path / "v.pt")["value"]
    assert name == "tensor in Namespace" or _same(value, loaded)


def test_the_table_is_big_enough() -> None:
    assert len(EVERYDAY) + len(REFUSED) >= 15


@pytest.mark.parametrize("name", list(REFUSED))
def test_other_types_are_refused_at_save_naming_their_path(name: str, tmp_path: Path) -> None:
    value, allow = REFUSED[name]
    with ddpstate.CheckpointManager(tmp_path / "run") as manager:
        with pytest.raises(DDPStateError) as info:
            manager.save(1, {"extra": {"items": [0, value]}})
        assert "state['extra']['items'][1]" in str(info.value)
        assert manager.steps() == []
    with pytest.raises(UnsafeCheckpointError) as plain:
        ddpstate.save({"items": [0, value]}, tmp_path / "v.pt")
    assert "obj['items'][1]" in str(plain.value)
    assert not (tmp_path / "v.pt").exists()
    if not allow:
        return
    assert f"safe_globals=[{type(value).__qualname__}]" in str(info.value)
    with ddpstate.CheckpointManager(tmp_path / "allowed", safe_globals=allow) as manager:
        manager.save(1, {"extra": {"items": [0, value]}})
        state: dict[str, Any] = {"extra": None}
        manager.restore(state)
    restored = state["extra"]["items"][1]
    assert type(restored) is type(value)
    assert restored == value or vars(restored) == vars(value)
    ddpstate.save({"v": value}, tmp_path / "ok.pt", safe_globals=allow)
    assert type(ddpstate.load(tmp_path / "ok.pt", safe_globals=allow)["v"]) is type(value)


def test_unsafe_types_can_still_be_saved_when_asked_by_name(tmp_path: Path) -> None:
    ddpstate.save({"o": Opaque()}, tmp_path / "o.pt", weights_only=False)
    with pytest.raises(UnsafeCheckpointError, match="safe_globals"):
        ddpstate.load(tmp_path / "o.pt")
    assert ddpstate.load(tmp_path / "o.pt", weights_only=False)["o"].x == 1


def test_allowing_types_leaves_torchs_global_allowlist_alone(tmp_path: Path) -> None:
    before = sorted(map(repr, torch.serialization.get_safe_globals()))
    ddpstate.save({"c": Color.RED, "n": np.float64(1)}, tmp_path / "c.pt", safe_globals=[Color])
    assert ddpstate.load(tmp_path / "c.pt", safe_globals=[Color])["c"] is Color.RED
    assert sorted(map(repr, torch.serialization.get_safe_globals())) == before
    with pytest.raises(UnsafeCheckpointError):
        ddpstate.load(tmp_path / "c.pt")  # not allowed by the earlier call


# --------------------------------------------------------------------------- row 3: convert suffix


def test_convert_to_a_safetensors_name_writes_safetensors(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    src = tmp_path / "good.pt"
    torch.save({"model": {"module.w": torch.arange(3.0)}}, src)
    out = tmp_path / "out.safetensors"
    assert main(["convert", str(src), str(out), "--strip-module", "-q"]) == 0
    assert ddpstate.detect_format(out) == "safetensors"
    assert torch.equal(load_file(str(out))["w"], torch.arange(3.0))
    back = tmp_path / "back.pt"
    assert main(["convert", str(out), str(back), "-q"]) == 0
    assert ddpstate.detect_format(back) == formats.TORCH_ZIP
    # An explicit --to still wins over the name.
    assert main(["convert", str(src), str(tmp_path / "x.safetensors"), "--to", "pt", "-q"]) == 0
    assert ddpstate.detect_format(tmp_path / "x.safetensors") == formats.TORCH_ZIP


# --------------------------------------------------------------------------- row 4: misnamed file


def test_a_torch_file_named_safetensors_loads_by_its_bytes(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    torch.save({"w": torch.ones(2)}, path)
    assert torch.equal(ddpstate.load(path)["w"].cpu(), torch.ones(2))  # "auto": GPU if any
    assert torch.equal(ddpstate.load(str(path), map_location="cpu")["w"], torch.ones(2))
    net = nn.Linear(2, 1)
    torch.save(net.state_dict(), path)
    ddpstate.load_model_state(nn.Linear(2, 1), path)
    with pytest.raises(CheckpointFormatError, match=r"rename it to \.pt"):
        ddpstate.load(path, mmap=True)


# --------------------------------------------------------------------------- row 8: CUDA asked


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
@pytest.mark.parametrize("where", ["cuda", "cuda:0", 0, torch.device("cuda", 1)])
def test_cuda_map_location_without_cuda_says_so(where: Any, tmp_path: Path) -> None:
    for name in ("c.pt", "c.safetensors"):
        ddpstate.save({"w": torch.ones(2)}, tmp_path / name)
        with pytest.raises(DeviceMapError) as info:
            ddpstate.load(tmp_path / name, map_location=where)
        message = str(info.value)
        assert "CUDA is not available on this machine" in message
        assert "saved on" not in message and "map_location='auto'" in message


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_dict_map_location_to_cuda_without_cuda_says_so(tmp_path: Path) -> None:
    ddpstate.save({"w": torch.ones(2)}, tmp_path / "c.pt")
    with pytest.raises(DeviceMapError, match="CUDA is not available on this machine"):
        ddpstate.load(tmp_path / "c.pt", map_location={"cpu": "cuda:0"})


# --------------------------------------------------------------------------- row 9: shapes


def _classifier(classes: int) -> nn.Module:
    torch.manual_seed(classes)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, classes))


def test_wrong_width_is_shape_mismatch_from_every_load_path(tmp_path: Path) -> None:
    source = _classifier(10)
    ddpstate.save_model_state(source, tmp_path / "m.pt")
    with ddpstate.CheckpointManager(tmp_path / "run") as manager:
        manager.save(1, {"model": source})
        with pytest.raises(ShapeMismatchError, match="ignore_mismatched=True") as restored:
            manager.restore({"model": _classifier(3)})
    with pytest.raises(ShapeMismatchError, match="ignore_mismatched=True") as loaded:
        ddpstate.load_model_state(_classifier(3), tmp_path / "m.pt")
    for info in (restored, loaded):
        assert "'2.weight' (saved [10, 8], model [3, 8])" in str(info.value)


def test_ignore_mismatched_skips_a_resized_head_and_reports_it(tmp_path: Path) -> None:
    source = _classifier(10)
    ddpstate.save_model_state(source, tmp_path / "m.pt")
    target = _classifier(3)
    head = target[2].weight.detach().clone()
    with pytest.warns(UserWarning, match=r"skipped 2 .*'2\.weight' \(saved \[10, 8\]"):
        result = ddpstate.load_model_state(target, tmp_path / "m.pt", ignore_mismatched=True)
    assert sorted(result.missing_keys) == ["2.bias", "2.weight"]
    assert torch.equal(target[0].weight, source[0].weight)
    assert torch.equal(target[2].weight, head)
    with ddpstate.CheckpointManager(tmp_path / "run") as manager:
        manager.save(1, {"model": nn.parallel.DataParallel(source)})
        wrapped = nn.parallel.DataParallel(_classifier(3))
        with pytest.warns(UserWarning, match="skipped 2"):
            assert manager.restore({"model": wrapped}, ignore_mismatched=True) == 1
    assert torch.equal(wrapped.module[0].weight, source[0].weight)


def test_ignore_mismatched_restore_drops_the_optimizer_state_of_skipped_parameters(
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    source = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3))
    optimizer = torch.optim.Adam(source.parameters())
    source(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    with ddpstate.CheckpointManager(tmp_path) as manager:
        manager.save(1, {"model": source, "optimizer": optimizer})
        # Fine-tuning: a resized head, the optimizer listed before the model.
        target = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 5))
        fresh = torch.optim.Adam(target.parameters())
        state: dict[str, Any] = {"optimizer": fresh, "model": target}
        with pytest.warns(UserWarning) as seen:
            assert manager.restore(state, ignore_mismatched=True) == 1
        assert any("dropped the saved optimizer state of 2" in str(w.message) for w in seen)
        skipped = [w for w in seen if "whose shape differs" in str(w.message)]
        # The warning points at the caller's restore(), not at ddpstate's internals.
        assert skipped and {w.filename for w in skipped} == {__file__}
    assert torch.equal(target[0].weight, source[0].weight)
    # The first training step works; the kept parameters resume their Adam state.
    target(torch.randn(2, 4)).sum().backward()
    fresh.step()
    assert int(fresh.state[target[0].weight]["step"]) == 2
    assert int(fresh.state[target[1].weight]["step"]) == 1


# --------------------------------------------------------------------------- row 11: rollback


@pytest.mark.parametrize("existing", [True, False])
def test_saving_an_older_step_is_a_rollback(existing: bool, tmp_path: Path) -> None:
    keep = None if existing else 2
    with ddpstate.CheckpointManager(tmp_path, keep_last=keep) as manager:
        for step in (3, 4, 5):
            manager.save(step, {"x": step})
        assert manager.steps() == ([3, 4, 5] if existing else [4, 5])
        with pytest.warns(UserWarning, match="rollback"):
            manager.save(3, {"x": 33}, rollback=True)
        assert manager.steps() == [3]
        assert manager.latest_step() == 3
        assert (tmp_path / "latest").read_text() == "step_0000000003\n"
        check = verify_checkpoint(tmp_path)
        assert check.ok and check.steps == (3,), check.problems
        state: dict[str, Any] = {"x": None}
        assert manager.restore(state) == 3 and state["x"] == 33
        manager.save(4, {"x": 44})  # and training goes on from there
        assert manager.steps() == [3, 4] and verify_checkpoint(tmp_path).ok
    assert main(["verify", str(tmp_path), "-q"]) == 0


def test_a_lower_step_is_a_rollback_only_after_restoring_it_or_when_asked(tmp_path: Path) -> None:
    # An earlier run's checkpoints in a reused folder.
    with ddpstate.CheckpointManager(tmp_path) as earlier:
        earlier.save(10, {"x": 10})
        earlier.save(20, {"x": 20})
    with ddpstate.CheckpointManager(tmp_path) as manager:
        for step in (1, 10):
            with pytest.raises(InvalidArgumentError) as info:
                manager.save(step, {"x": step})
            message = str(info.value)
            assert "[20]" in message if step == 10 else "[10, 20]" in message
            assert "rollback=True" in message and "restore(step=N)" in message
        assert manager.steps() == [10, 20]
        assert manager.restore({"x": None}) == 20
        with pytest.raises(InvalidArgumentError, match="restored step 20"):
            manager.save(15, {"x": 15})
        # Restoring step 10 makes saving 10 (or above) a rollback.
        assert manager.restore({"x": None}, step=10) == 10
        with pytest.warns(UserWarning, match="rollback"):
            manager.save(11, {"x": 11})
        assert manager.steps() == [10, 11] and verify_checkpoint(tmp_path).ok
    assert main(["verify", str(tmp_path), "-q"]) == 0


def test_a_rollback_whose_latest_write_fails_deletes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ddpstate.manager as manager_module

    with ddpstate.CheckpointManager(tmp_path) as manager:
        for step in (3, 4, 5):
            manager.save(step, {"x": step})
        real = manager_module.storage.atomic_write

        def failing(path: str, *args: Any, **kwargs: Any) -> Any:
            if path.endswith("latest"):
                raise OSError("disk full")
            return real(path, *args, **kwargs)

        monkeypatch.setattr(manager_module.storage, "atomic_write", failing)
        with pytest.warns(UserWarning, match="rollback"), pytest.raises(DDPStateError) as info:
            manager.save(2, {"x": 2}, rollback=True)
        monkeypatch.undo()
        message = str(info.value)
        assert "untouched" not in message and "disk full" in message
        assert "steps [3, 4, 5] are still committed, so restore() takes step 5" in message
        # restore, steps() and verify agree: step 5 is still the newest.
        assert manager.steps() == [2, 3, 4, 5]
        assert manager.restore({"x": None}) == 5
    check = verify_checkpoint(tmp_path)
    assert check.ok and check.steps == (2, 3, 4, 5), check.problems


# --------------------------------------------------------------------------- row 12: meta tensors


def test_meta_tensors_are_refused_at_save(tmp_path: Path) -> None:
    with torch.device("meta"):
        model = nn.Linear(3, 2)
    for name in ("m.pt", "m.safetensors"):
        with pytest.raises(CheckpointFormatError, match=r"obj\['weight'\] is a tensor on the meta"):
            ddpstate.save(model.state_dict(), tmp_path / name)
        with pytest.raises(CheckpointFormatError, match="meta device"):
            ddpstate.save_model_state(model, tmp_path / name)
        assert not (tmp_path / name).exists()
    with ddpstate.CheckpointManager(tmp_path / "run") as manager:
        with pytest.raises(DDPStateError, match=r"state\['model'\]\['weight'\].*meta device"):
            manager.save(1, {"model": model})
        with pytest.raises(DDPStateError, match=r"state\['extra'\]\[0\].*meta device"):
            manager.save(1, {"extra": [torch.empty(2, device="meta")]})
        assert manager.steps() == []


# --------------------------------------------------------------------------- row 13: CLI terms


def test_cli_errors_name_options_not_python_arguments(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    two = tmp_path / "two.pt"
    torch.save({"model": {"w": torch.ones(1)}, "state_dict": {"v": torch.ones(1)}}, two)
    none = tmp_path / "none.pt"
    torch.save({"a": {"w": torch.ones(1)}, "b": {"w": torch.ones(1)}}, none)
    module = tmp_path / "module.pt"
    torch.save({"net": nn.Linear(1, 1)}, module)
    good = tmp_path / "good.pt"
    torch.save({"model": {"module.w": torch.ones(1)}}, good)
    (tmp_path / "taken.pt").write_bytes(b"x")
    runs = [
        ["convert", str(two), "--strip-module"],
        ["convert", str(none), "--strip-module"],
        ["convert", str(module), "--strip-module"],
        ["convert", str(good), str(tmp_path / "taken.pt"), "--strip-module"],
        ["convert", str(good), str(good), "--strip-module"],
        ["inspect", str(module)],
    ]
    expected = ["--key", "--key", "--unsafe", "--force", "--in-place", "--unsafe"]
    for argv, option in zip(runs, expected, strict=True):
        assert main([*argv, "-q"] if argv[0] == "convert" else argv) == 2
        err = capsys.readouterr().err
        assert option in err, (argv, err)
        for python in ("key=", "overwrite=", "in_place=", "unsafe=", "weights_only=False"):
            assert python not in err, (argv, err)


def test_library_errors_still_name_python_arguments(tmp_path: Path) -> None:
    two = tmp_path / "two.pt"
    torch.save({"model": {"w": torch.ones(1)}, "state_dict": {"v": torch.ones(1)}}, two)
    with pytest.raises(DDPStateError, match="key="):
        ddpstate.convert_file(two, strip_prefix="module.")


def test_checked_pickling_writes_what_torch_save_writes() -> None:
    from ddpstate._io.savecheck import save_torch

    state = {"w": torch.arange(4.0), "p": nn.Parameter(torch.ones(1)), "n": [1, "a", None]}
    ours, theirs = io.BytesIO(), io.BytesIO()
    save_torch(state, ours, what="state", where="buffer")
    torch.save(state, theirs)
    ours.seek(0)
    theirs.seek(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        a = torch.load(ours, weights_only=True)
        b = torch.load(theirs, weights_only=True)
    assert a.keys() == b.keys() and a["n"] == b["n"] and torch.equal(a["w"], b["w"])
    assert type(a["p"]) is nn.Parameter


def test_the_command_reads_what_save_writes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "values.pt"
    values = {k: EVERYDAY[k] for k in ("np.float64", "array int64", "Path", "date", "Namespace")}
    ddpstate.save({**values, "w": torch.ones(2)}, path)
    assert main(["verify", str(path), "-q"]) == 0
    assert main(["inspect", str(path)]) == 0
    out = tmp_path / "copy.pt"
    assert main(["convert", str(path), str(out), "-q"]) == 0
    loaded = ddpstate.load(out)
    assert _same(loaded["np.float64"], values["np.float64"]) and loaded["Path"] == values["Path"]
    capsys.readouterr()


def test_every_everyday_global_resolves_here() -> None:
    from ddpstate._io.savecheck import EVERYDAY_GLOBALS, allowed_globals

    named = {name for g in allowed_globals() if isinstance(g, tuple) for name in [g[1]]}
    moved = {n for n in EVERYDAY_GLOBALS if n.startswith(("pathlib._local.", "numpy.core."))}
    assert set(EVERYDAY_GLOBALS) - named <= moved


@pytest.mark.parametrize(
    "bad",
    [f"{__name__}.Color", [["x"]], [Color.RED], [(f"{__name__}.Color",)]],
    ids=["string", "list-in-list", "enum-member", "one-tuple"],
)
def test_a_bad_safe_globals_argument_is_named_not_a_corrupt_file(bad: Any, tmp_path: Path) -> None:
    path = tmp_path / "c.pt"
    ddpstate.save({"c": Color.RED}, path, safe_globals=[Color])
    before = set(map(str, torch.serialization.get_safe_globals()))
    calls = {
        "save": lambda: ddpstate.save({"c": Color.RED}, tmp_path / "d.pt", safe_globals=bad),
        "load": lambda: ddpstate.load(path, safe_globals=bad),
        "load_model_state": lambda: ddpstate.load_model_state(
            nn.Linear(2, 2), path, safe_globals=bad
        ),
        "CheckpointManager": lambda: ddpstate.CheckpointManager(tmp_path / "r", safe_globals=bad),
    }
    for name, call in calls.items():
        with pytest.raises(InvalidArgumentError, match="safe_globals") as info:
            call()
        assert name in str(info.value) or str(path) in str(info.value)
    assert set(map(str, torch.serialization.get_safe_globals())) == before
    assert not (tmp_path / "d.pt").exists()
    assert ddpstate.load(path, safe_globals=[Color])["c"] is Color.RED
