"""A real S3-compatible server (moto's standalone server) on 127.0.0.1, for the remote tests."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest


@dataclass(frozen=True)
class S3Server:
    """Where the server listens and how to reach it through s3fs.

    Attributes:
        endpoint_url: ``http://127.0.0.1:<port>``.
        storage_options: What ``ddpstate.save``/``load`` pass to fsspec/s3fs.
    """

    endpoint_url: str
    storage_options: dict[str, Any]

    def filesystem(self) -> Any:
        """A fresh s3fs filesystem talking to this server."""
        import s3fs

        return s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options)

    def new_bucket(self) -> str:
        """Create an empty bucket with a random name and return the name."""
        name = f"ddpstate-{secrets.token_hex(4)}"
        self.filesystem().mkdir(name)
        return name


def storage_options_for(endpoint_url: str) -> dict[str, Any]:
    """s3fs options for a local moto server: dummy credentials, fixed region."""
    return {
        "key": "testing",
        "secret": "testing",
        "endpoint_url": endpoint_url,
        "client_kwargs": {"region_name": "eu-west-1"},
    }


@pytest.fixture(scope="module")
def s3_server() -> Iterator[S3Server]:
    """Start moto's S3 server on a free port of 127.0.0.1 for one test module."""
    pytest.importorskip("s3fs")
    server_mod = pytest.importorskip("moto.server")
    # boto reads these when nothing else is configured; keep the real ones out of reach.
    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    os.environ["AWS_ACCESS_KEY_ID"] = "testing"
    os.environ["AWS_SECRET_ACCESS_KEY"] = "testing"
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        url = f"http://{host}:{port}"
        yield S3Server(url, storage_options_for(url))
    finally:
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
