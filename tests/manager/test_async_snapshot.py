"""Async saves write what sync saves write: tensors that share a storage stay shared."""

from __future__ import annotations

import json
import struct
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import ddpstate
from ddpstate.storage import wait_for_freed

_ALIASES = "ddpstate.aliases"


class _Tied(nn.Module):
    """An embedding tied to the output head (4 MiB), as language models do."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(1024, 1024)
        self.head = nn.Linear(1024, 1024, bias=False)
        self.head.weight = self.embed.weight


def _save(folder: Path, state: dict[str, Any], fmt: str, async_save: bool) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tie warning (once per process)
        manager = ddpstate.CheckpointManager(folder, format=fmt, async_save=async_save)
        manager.save(1, state)
        manager.close()
    wait_for_freed()
    return folder / "step_0000000001"


def _safetensors_aliases(path: Path) -> Any:
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    return json.loads(header.get("__metadata__", {}).get(_ALIASES, "{}"))


@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_async_save_of_a_tied_model_writes_what_the_sync_save_writes(
    fmt: str, tmp_path: Path
) -> None:
    """Regression: the snapshot deduplicated by id(), but state_dict() returns a new tensor
    per key, so an async save wrote the tied 4 MiB weight twice (8.39 MB against 4.20 MB)
    and the safetensors file lost its alias entry."""
    torch.manual_seed(0)
    model = _Tied()
    suffix = ".safetensors" if fmt == "safetensors" else ".pt"
    sync = _save(tmp_path / "sync", {"model": model}, fmt, async_save=False) / f"model{suffix}"
    done = _save(tmp_path / "async", {"model": model}, fmt, async_save=True) / f"model{suffix}"
    assert done.stat().st_size == sync.stat().st_size < 5_000_000
    if fmt == "safetensors":
        assert _safetensors_aliases(done) == _safetensors_aliases(sync) != {}
    else:
        loaded = torch.load(done, weights_only=True)
        assert loaded["head.weight"].untyped_storage().data_ptr() == (
            loaded["embed.weight"].untyped_storage().data_ptr()
        )
    restored = _Tied()
    ddpstate.CheckpointManager(tmp_path / "async", format=fmt).restore({"model": restored})
    assert torch.equal(restored.embed.weight, model.embed.weight)
    assert restored.head.weight is restored.embed.weight


class _Views(nn.Module):
    """Parameters and a buffer that are views of one 1 MiB storage at other offsets/shapes."""

    def __init__(self) -> None:
        super().__init__()
        flat = torch.arange(1 << 18, dtype=torch.float32)
        self.all = nn.Parameter(flat)
        self.tail = nn.Parameter(flat[1 << 17 :])
        self.register_buffer("grid", flat[: 1 << 16].view(256, 256))


@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_async_save_keeps_views_of_one_storage_as_the_sync_save_does(
    fmt: str, tmp_path: Path
) -> None:
    """Views that share a storage at other offsets and shapes: torch.save writes the storage
    once, and so does the async save's snapshot (1.75 MiB before); safetensors writes each
    view's bytes, in both. Files of the same size either way."""
    model = _Views()
    suffix = ".safetensors" if fmt == "safetensors" else ".pt"
    state = {"model": model, "epoch": 3}
    sync = _save(tmp_path / "sync", state, fmt, async_save=False) / f"model{suffix}"
    done = _save(tmp_path / "async", state, fmt, async_save=True) / f"model{suffix}"
    assert done.stat().st_size == sync.stat().st_size
    if fmt == "pt":
        assert sync.stat().st_size < 1_200_000
        loaded = torch.load(done, weights_only=True)
        assert len({t.untyped_storage().data_ptr() for t in loaded.values()}) == 1
    else:
        loaded = ddpstate.load(done)
    for key, view in model.state_dict().items():
        assert torch.equal(loaded[key], view), key


class _Experts(nn.Module):
    """10,000 small tensors as MoE layers hold them, plus ties and views of shared storages."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ParameterList(nn.Parameter(torch.randn(4, 3)) for _ in range(9_990))
        shared = torch.randn(64)
        self.register_buffer("whole", shared)
        self.register_buffer("upper", shared[32:])  # a view at an offset of the same storage
        self.register_buffer("grid", torch.randn(8, 4).t())  # its whole storage, transposed
        self.register_buffer("step", torch.tensor(7, dtype=torch.int64))
        self.register_buffer("empty", torch.empty(0))
        self.register_buffer("halfs", torch.randn(5, dtype=torch.float16))
        self.register_buffer("conj", torch.randn(3, dtype=torch.complex64).conj())
        self.tied = self.experts[0]  # registered twice: one parameter under two keys
        self.register_buffer("bools", torch.rand(6) > 0.5)


def test_async_save_of_10000_small_tensors_sharing_storages_round_trips_exactly(
    tmp_path: Path,
) -> None:
    """The snapshot copies a tensor that is its whole storage straight into its buffer and
    rebuilds only the other views: every value, dtype, stride and tie comes back as saved,
    also after the live tensors changed under the write (issue 42)."""
    torch.manual_seed(0)
    model = _Experts()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    with ddpstate.CheckpointManager(tmp_path, async_save=True) as manager:
        manager.save(1, {"model": model, "extra": {"view": model.whole[:8], "n": 3}})
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(1.0)  # the write in flight must not see this
            model.whole.add_(1.0)
    file = tmp_path / "step_0000000001" / "model.pt"
    loaded = torch.load(file, weights_only=True)
    assert loaded.keys() == expected.keys()
    for key, value in expected.items():
        assert loaded[key].dtype == value.dtype and loaded[key].stride() == value.stride(), key
        assert torch.equal(loaded[key], value.resolve_conj()), key
    for view, whole in (("upper", "whole"), ("tied", "experts.0")):
        assert loaded[view].untyped_storage().data_ptr() == (
            loaded[whole].untyped_storage().data_ptr()
        )
    extra = torch.load(tmp_path / "step_0000000001" / "extra.pt", weights_only=True)
    assert torch.equal(extra["view"], expected["whole"][:8]) and extra["n"] == 3


def test_the_snapshot_runs_with_the_garbage_collector_held_off() -> None:
    """Regression (issue 42): the snapshot makes a few objects per tensor, none in a cycle, and
    the cyclic collector's passes over them took about a third of an async save() call with
    25,000 tensors. The collector is off while the state is taken and copied, on after."""
    import gc

    from ddpstate._manager.snapshot import Snapshot

    seen: list[bool] = []

    class Counter:
        def state_dict(self) -> dict[str, Any]:
            seen.append(gc.isenabled())
            return {"n": torch.tensor(3)}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            pass

    assert gc.isenabled()
    entries, _ = Snapshot().collect({"counter": Counter()}, snapshot=True)
    assert seen == [False] and gc.isenabled()
    assert torch.equal(entries["counter"].value["n"], torch.tensor(3))


class _GcProbe:
    """A stateful entry that notes whether the cyclic collector is on when it is restored."""

    def __init__(self) -> None:
        self.seen: list[bool] = []

    def state_dict(self) -> dict[str, Any]:
        return {"n": torch.tensor(3)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        import gc

        self.seen.append(gc.isenabled())


def test_sync_save_and_restore_hold_the_garbage_collector_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression (issue 42): pickling and unpickling 25,000 tensors make objects none of which
    is in a cycle, and the collector's passes over them were about a fifth of a sync save and
    of a restore. The collector is off while the step's files are written and loaded, on after."""
    import gc

    from ddpstate._manager.writer import StepWriter

    written: list[bool] = []
    write_file = StepWriter.write_file

    def spy(self: StepWriter, *args: Any) -> dict[str, Any]:
        written.append(gc.isenabled())
        return write_file(self, *args)

    monkeypatch.setattr(StepWriter, "write_file", spy)
    probe = _GcProbe()
    with ddpstate.CheckpointManager(tmp_path) as manager:
        manager.save(1, {"probe": probe})
        assert written and not any(written) and gc.isenabled()
        assert manager.restore({"probe": probe}) == 1
    assert probe.seen == [False] and gc.isenabled()


def test_the_snapshot_copies_every_tensor_in_one_batched_call_per_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Regression (issue 42): the snapshot made one copy_ call per tensor from Python (25,640
    for the MoE-shaped state). It now queues the copies and runs them in one
    torch._foreach_copy_ per source device, whatever their dtypes; the copies equal the state."""
    from ddpstate._manager.snapshot import Snapshot

    calls: list[int] = []
    foreach_copy = torch._foreach_copy_

    def counting(buffers: list[torch.Tensor], sources: list[torch.Tensor], **kwargs: Any) -> None:
        calls.append(len(sources))
        foreach_copy(buffers, sources, **kwargs)

    monkeypatch.setattr(torch, "_foreach_copy_", counting)
    torch.manual_seed(0)
    model = _Experts()
    snapshot = Snapshot()
    for _ in range(2):  # the second save reuses the first one's buffers
        entries, events = snapshot.collect({"model": model}, snapshot=True)
        copied = entries["model"].value
        for key, value in model.state_dict().items():
            assert torch.equal(copied[key], value.resolve_conj()), key
            assert not copied[key].requires_grad, key
    assert events == [] and len(calls) == 2 and calls[0] == calls[1] >= 9_990


def test_an_async_save_refuses_meta_tensors_naming_them(tmp_path: Path) -> None:
    """Regression: an async save's snapshot tried to copy a meta tensor and raised torch's
    NotImplementedError ("Cannot copy out of meta tensor"); it now refuses it as the sync
    save does, naming the key, and writes nothing."""
    with torch.device("meta"):
        model = nn.Linear(3, 2)
    with ddpstate.CheckpointManager(tmp_path, async_save=True) as manager:
        with pytest.raises(ddpstate.DDPStateError, match=r"state\['model'\]\['weight'\].*meta"):
            manager.save(1, {"model": model})
        with pytest.raises(ddpstate.DDPStateError, match=r"state\['extra'\]\[0\].*meta device"):
            manager.save(1, {"extra": [torch.empty(2, device="meta")]})
        assert manager.steps() == []
