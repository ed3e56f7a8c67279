"""map_location: "auto", devices, dicts and callables, on files whose tensors claim CUDA."""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from ddpstate.checkpoint import load
from ddpstate.errors import DDPStateError
from ddpstate.location import place_all, resolve_map_location
from tests.samples import RESNET20

SAMPLE = RESNET20


def _save_tagged(obj: Any, path: Path, tag: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.save ``obj`` with every storage recorded as living on ``tag`` (no GPU needed)."""
    with monkeypatch.context() as patch:
        patch.setattr(torch.serialization, "location_tag", lambda storage: tag)
        torch.save(obj, path)
    with zipfile.ZipFile(path) as archive:
        pickled = archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))
    assert tag.encode() in pickled and b"cpu" not in pickled


@pytest.fixture()
def cuda_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    state = {"w": torch.arange(6.0).reshape(2, 3), "n": torch.tensor(7)}
    files = {}
    for tag in ("cuda:0", "cuda:7"):
        files[tag] = tmp_path / f"{tag.replace(':', '')}.pt"
        _save_tagged(state, files[tag], tag, monkeypatch)
    return files


def test_resolve_auto_is_this_ranks_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    expected = torch.device("cuda", 1 % max(torch.cuda.device_count(), 1))
    assert resolve_map_location("auto") == (
        expected if torch.cuda.is_available() else torch.device("cpu")
    )
    assert resolve_map_location() == resolve_map_location("auto")


def test_resolve_other_forms() -> None:
    assert resolve_map_location(None) is None
    assert resolve_map_location("cpu") == torch.device("cpu")
    assert resolve_map_location(torch.device("cuda", 3)) == torch.device("cuda", 3)
    assert resolve_map_location(2) == torch.device("cuda", 2)
    assert resolve_map_location({"cuda:7": torch.device("cpu")}) == {"cuda:7": "cpu"}

    def fn(storage: torch.UntypedStorage, location: str) -> torch.UntypedStorage:
        return storage

    assert resolve_map_location(fn) is fn
    for bad in ("gpu0", {"cuda:0": "nowhere"}, {0: "cpu"}, 3.5):
        with pytest.raises(DDPStateError, match="map_location"):
            resolve_map_location(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("tag", ["cuda:0", "cuda:7"])
@pytest.mark.parametrize("where", ["auto", "cpu", "dict"])
def test_cuda_tagged_files_load_on_cpu(cuda_files: dict[str, Path], tag: str, where: str) -> None:
    if where == "dict":
        map_location: Any = {tag: "cpu"}
    else:
        map_location = where
    if where == "auto" and torch.cuda.is_available():
        pytest.skip("'auto' means the local GPU on a CUDA machine; covered by the CPU case")
    state = load(cuda_files[tag], map_location=map_location)
    assert state["w"].device.type == "cpu"
    assert torch.equal(state["w"], torch.arange(6.0).reshape(2, 3))
    assert state["n"].item() == 7


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error message")
def test_cuda_file_without_mapping_names_the_fix(cuda_files: dict[str, Path]) -> None:
    with pytest.raises(DDPStateError, match="map_location='auto'"):
        load(cuda_files["cuda:7"], map_location=None)
    # A dict that does not cover the saved location leaves it on CUDA, so it fails the same way.
    with pytest.raises(DDPStateError, match="CUDA device"):
        load(cuda_files["cuda:7"], map_location={"cuda:0": "cpu"})


def test_callable_map_location_sees_the_saved_tag(cuda_files: dict[str, Path]) -> None:
    seen: list[str] = []

    def to_cpu(storage: torch.UntypedStorage, location: str) -> torch.UntypedStorage:
        seen.append(location)
        return storage

    state = load(cuda_files["cuda:7"], map_location=to_cpu)
    assert set(seen) == {"cuda:7"}
    assert state["w"].device.type == "cpu"


@pytest.mark.skipif(not SAMPLE.exists(), reason="needs the shared legacy sample file")
@pytest.mark.parametrize("where", ["auto", "cpu", {"cuda:0": "cpu"}])
def test_legacy_sample_tagged_cuda0_loads_on_cpu(where: Any) -> None:
    if where == "auto" and torch.cuda.is_available():
        pytest.skip("'auto' means the local GPU on a CUDA machine")
    state = load(SAMPLE, map_location=where)
    weights = state["state_dict"]
    assert all(t.device.type == "cpu" for t in weights.values())
    assert len(weights) > 50 and state["best_prec1"] > 90


def test_place_all_keeps_sharing_and_metadata() -> None:
    import collections

    shared = torch.ones(3)
    sd: Any = collections.OrderedDict(a=shared, b=shared, c=[shared, (torch.zeros(1),)])
    sd._metadata = {"": {"version": 1}}
    seen: list[str] = []

    def spy(storage: torch.UntypedStorage, location: str) -> torch.UntypedStorage:
        seen.append(location)
        return storage

    out = place_all(sd, "cpu", spy)
    assert out["a"] is out["b"] is out["c"][0]
    assert out._metadata == {"": {"version": 1}}
    assert seen == ["cpu", "cpu"]  # one call per distinct tensor


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: checks 'auto' -> cuda:N")
def test_auto_lands_on_local_rank_gpu(
    cuda_files: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOCAL_RANK", str(torch.cuda.device_count() - 1))
    state = load(cuda_files["cuda:7"], map_location="auto")
    assert state["w"].device == torch.device("cuda", torch.cuda.device_count() - 1)
