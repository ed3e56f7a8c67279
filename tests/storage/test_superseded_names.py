"""A save over a URL checkpoint deletes only what lies inside that checkpoint.

After committing, a save deletes the files the replaced checkpoint's manifest lists. The
manifest is a claim of whatever last wrote the target (another tool, a copied or crafted
checkpoint), so a listed name that leaves the folder is never deleted: an absolute path,
which ``posixpath.join`` turns into a path on the local disk (deleted recursively before),
or a ``..`` part (a literal key on S3, a parent folder on other stores).
"""

from __future__ import annotations

import json
from pathlib import Path

import fsspec

from ddpstate.storage import staged_folder
from tests.s3server import S3Server, s3_server  # noqa: F401 - the fixture


def test_a_replaced_manifest_cannot_name_files_outside_the_checkpoint(
    s3_server: S3Server,  # noqa: F811
    tmp_path: Path,
) -> None:
    """The old manifest lists a local file and a sibling object: both survive the save."""
    opts = s3_server.storage_options
    bucket = s3_server.new_bucket()
    fs = s3_server.filesystem()
    victim = tmp_path / "victim" / "keep.txt"
    victim.parent.mkdir()
    victim.write_text("precious")
    fs.pipe(f"{bucket}/other/keep.pt", b"precious")
    fs.pipe(f"{bucket}/ckpt/model.pt", b"old")
    listed = {str(victim.parent): {}, "../other/keep.pt": {}, "model.pt": {}}
    fs.pipe(f"{bucket}/ckpt/manifest.json", json.dumps({"files": listed}).encode())

    target = f"s3://{bucket}/ckpt"
    with staged_folder(target, storage_options=opts) as staged:
        with fsspec.open(f"{staged.path}/model.pt", "wb", **opts) as f:
            f.write(b"new")
        staged.commit(json.dumps({"files": {"model.pt": {}}}).encode())

    assert victim.read_text() == "precious"
    fs.invalidate_cache()
    assert fs.cat(f"{bucket}/other/keep.pt") == b"precious"
    assert not fs.exists(f"{bucket}/ckpt/model.pt")  # the replaced checkpoint's own file
