"""Every file ddpstate writes opens with plain torch in a process where ddpstate cannot import."""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import pathlib
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import ddpstate
from ddpstate.errors import DDPStateError, UnsafeCheckpointError

# The child blocks `import ddpstate`, loads each file both ways and reports what it read.
_CHILD = r"""
import importlib, json, sys
sys.modules["ddpstate"] = None  # any global naming ddpstate now fails to resolve
import torch

def resolve(name):
    module, _, attr = name.rpartition(".")
    while True:
        try:
            obj = importlib.import_module(module)
            break
        except ImportError:
            module, _, outer = module.rpartition(".")
            attr = outer + "." + attr
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj

report = {}
for path in sys.argv[1:]:
    torch.load(path, weights_only=False)
    names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    with torch.serialization.safe_globals([resolve(n) for n in names]):
        loaded = torch.load(path, weights_only=True)
    keys = sorted(map(str, loaded)) if isinstance(loaded, dict) else []
    report[path] = {"globals": names, "keys": keys}
print(json.dumps(report))
"""

EVERYDAY: dict[str, Any] = {
    "np_scalar": np.float32(0.5),
    "np_int": np.int64(7),
    "np_array": np.arange(6, dtype=np.float64).reshape(2, 3),
    "np_bool_array": np.array([True, False]),
    "path": pathlib.Path("/data/run"),
    "pure_path": pathlib.PurePosixPath("a/b"),
    "when": datetime.datetime(2024, 5, 6, 7, 8, tzinfo=datetime.timezone.utc),
    "day": datetime.date(2024, 1, 31),
    "span": datetime.timedelta(hours=3),
    "args": argparse.Namespace(lr=0.1, name="exp", steps=[1, 2]),
    "ordered": collections.OrderedDict([("b", 1), ("a", 2.0)]),
    "set": {1, 2, 3},
    "complex": 1 + 2j,
    "bytes": b"\x00\x01",
}


def _open_without_ddpstate(files: list[Path], cwd: Path) -> dict[str, Any]:
    script = cwd / "child.py"
    script.write_text(_CHILD)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, str(script), *map(str, files)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    report: dict[str, Any] = json.loads(done.stdout)
    return report


@pytest.mark.slow
def test_save_save_model_state_and_manager_steps_open_with_plain_torch(tmp_path: Path) -> None:
    files: list[Path] = []
    model = nn.DataParallel(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    everything = {**EVERYDAY, "model": model.state_dict(), "optim": opt.state_dict()}
    ddpstate.save(everything, tmp_path / "all.pt")
    files.append(tmp_path / "all.pt")
    ddpstate.save_model_state(model, tmp_path / "weights.pt")
    files.append(tmp_path / "weights.pt")
    sampler = ddpstate.ResumableDistributedSampler(range(10), num_replicas=1, rank=0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    with ddpstate.CheckpointManager(tmp_path / "run") as manager:
        manager.save(
            1,
            {"model": model, "optimizer": opt, "scheduler": sched, "sampler": sampler, **EVERYDAY},
        )
    step_files = sorted((tmp_path / "run").glob("step_*/*.pt"))
    assert len(step_files) >= 3  # the entries and every rank's RNG states
    files.extend(step_files)
    report = _open_without_ddpstate(files, tmp_path)
    assert sorted(report) == sorted(map(str, files))
    for path, seen in report.items():
        assert not [g for g in seen["globals"] if g.startswith("ddpstate")], path
    assert "np_array" in report[str(tmp_path / "all.pt")]["keys"]
    assert "0.weight" in report[str(tmp_path / "weights.pt")]["keys"]


def test_a_defaultdict_is_refused_at_save_naming_its_path_and_the_fix(tmp_path: Path) -> None:
    counts = collections.defaultdict(int, {"a": 3})
    with pytest.raises(UnsafeCheckpointError) as info:
        ddpstate.save({"stats": {"counts": counts}}, tmp_path / "s.pt")
    text = str(info.value)
    assert "obj['stats']['counts']" in text and "dict(" in text
    assert not (tmp_path / "s.pt").exists()
    with ddpstate.CheckpointManager(tmp_path / "run") as manager:
        with pytest.raises(DDPStateError, match=r"state\['stats'\]\['counts'\] is a coll"):
            manager.save(1, {"stats": {"counts": counts}})
        manager.save(1, {"stats": {"counts": dict(counts)}})  # the fix it names
        state: dict[str, Any] = {"stats": None}
        assert manager.restore(state) == 1
    assert state["stats"] == {"counts": {"a": 3}}


def test_a_file_written_with_the_old_defaultdict_rebuilder_still_loads(tmp_path: Path) -> None:
    import pickle

    from ddpstate._io import savecheck

    class _OldPickler(pickle.Pickler):  # how ddpstate wrote a defaultdict before
        def reducer_override(self, obj: Any) -> Any:
            if type(obj) is collections.defaultdict:
                return savecheck._rebuild_defaultdict, ("list", dict(obj))
            return NotImplemented

    import types

    old = types.SimpleNamespace(Pickler=_OldPickler, __name__="pickle")
    path = tmp_path / "old.pt"
    torch.save({"d": collections.defaultdict(list, {"x": [1]})}, path, pickle_module=old)
    loaded = ddpstate.load(path)["d"]
    assert type(loaded) is collections.defaultdict and loaded.default_factory is list
    assert loaded["x"] == [1] and loaded["new"] == []
