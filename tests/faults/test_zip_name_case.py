"""A second ``data.pkl`` whose name differs only in case.

torch's zip reader (miniz) looks records up ignoring ASCII case, so ``<archive>/DATA.PKL``
is a second copy of ``data.pkl`` to torch: which one it loads depends on where the copy
lies in the directory (checked here). ddpstate refuses a name twice in the directory; it
refuses names equal but for case the same way, in every reader.
"""

from __future__ import annotations

import io
import pickle
import zipfile
from pathlib import Path

import pytest
import torch

from tests.faults.test_one_reader import assert_corrupt_everywhere


def _with_upper_copy(path: Path, n_tensors: int, copy_first: bool) -> None:
    buf = io.BytesIO()
    torch.save({f"t{i}": torch.ones(2) for i in range(n_tensors)}, buf)
    saved = zipfile.ZipFile(buf)
    items = [(info.filename, saved.read(info)) for info in saved.infolist()]
    folder = items[0][0].split("/")[0]
    copy = (f"{folder}/DATA.PKL", pickle.dumps({"other": 1}, protocol=2))
    items.insert(0 if copy_first else len(items), copy)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as out:
        for name, data in items:
            out.writestr(name, data)


@pytest.mark.parametrize("copy_first", [True, False])
@pytest.mark.parametrize("n_tensors", [1, 3])
def test_a_data_pkl_copy_differing_in_case_is_refused_everywhere(
    n_tensors: int, copy_first: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "case.pt"
    _with_upper_copy(src, n_tensors, copy_first)
    loaded = torch.load(src, weights_only=True)
    assert ("other" in loaded) == (not copy_first)  # torch picks the copy by position
    assert_corrupt_everywhere(src, tmp_path, capsys)
