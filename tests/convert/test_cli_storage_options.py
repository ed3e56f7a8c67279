"""URLs on the command line: fsspec options from --storage-option, the environment, AWS variables.

Against the real S3-compatible server (moto on 127.0.0.1): with no credentials anywhere the
command says so in one line naming the URL and what to set (exit 2), and each documented way
of giving them (options, ``DDPSTATE_STORAGE_OPTIONS``, the AWS variables) then works.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ddpstate.cli import STORAGE_OPTIONS_ENV, main
from tests.s3server import S3Server, s3_server  # noqa: F401 - the fixture

# Every place botocore looks for credentials, emptied (the instance metadata service too:
# only loopback addresses in tests).
_CREDENTIALS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE")


@pytest.fixture()
def no_credentials(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    # fsspec keeps a filesystem per set of options, with the credentials it found then:
    # each test (like each command) starts from none.
    s3fs = pytest.importorskip("s3fs")
    s3fs.S3FileSystem.clear_instance_cache()
    for name in (*_CREDENTIALS, "AWS_ENDPOINT_URL", STORAGE_OPTIONS_ENV, "DDPSTATE_DEBUG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    yield
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture()
def url(s3_server: S3Server, tmp_path: Path) -> str:  # noqa: F811 - the fixture
    local = tmp_path / "m.pt"
    torch.save({"w": torch.arange(4.0)}, local)
    bucket = s3_server.new_bucket()
    s3_server.filesystem().put(str(local), f"{bucket}/run/m.pt")
    return f"s3://{bucket}/run/m.pt"


def test_missing_credentials_are_one_line_naming_the_url_and_what_to_set(
    s3_server: S3Server,  # noqa: F811 - the fixture
    url: str,
    no_credentials: None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The endpoint from the environment, as before this option existed; no credentials.
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint_url)
    for command in (["verify", url, "-q"], ["inspect", url]):
        assert main(command) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"ddpstate: error: {url}: no credentials"), err
        for fix in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"):
            assert fix in err[0]
        assert "--storage-option key=... --storage-option secret=..." in err[0]
        assert "unexpected" not in err[0] and "please report" not in err[0]


def test_storage_options_from_flags_the_environment_and_aws_variables(
    s3_server: S3Server,  # noqa: F811 - the fixture
    url: str,
    no_credentials: None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    endpoint = s3_server.endpoint_url
    flags = [f"endpoint_url={endpoint}", "key=testing", "secret=testing"]
    assert main(["verify", url, "-q", *(f"--storage-option={f}" for f in flags)]) == 0
    assert capsys.readouterr().out.startswith(f"ok: {url} (torch.save zip, 1 tensors")

    # A JSON value: client_kwargs is a dict (the endpoint given the way docs/cli.md shows).
    monkeypatch.setenv(STORAGE_OPTIONS_ENV, '{"key": "testing", "secret": "testing"}')
    kwargs = f'client_kwargs={{"endpoint_url": "{endpoint}", "region_name": "eu-west-1"}}'
    assert main(["inspect", url, "--storage-option", kwargs]) == 0
    assert "w     float32  [4]" in capsys.readouterr().out

    # The flag wins over the environment: a wrong secret there, the right one on the line.
    monkeypatch.setenv(STORAGE_OPTIONS_ENV, f'{{"endpoint_url": "{endpoint}", "secret": "x"}}')
    assert main(["verify", url, "-q", "--storage-option", "secret=testing", "--storage-option",
                 "key=testing"]) == 0  # fmt: skip
    capsys.readouterr()

    # No option at all: the AWS variables botocore reads.
    monkeypatch.delenv(STORAGE_OPTIONS_ENV)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    assert main(["diff", url, url, "-q"]) == 0
    assert "equal: 1 shared tensors compared" in capsys.readouterr().out


def test_bad_storage_options_are_usage_errors(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    local = tmp_path / "m.pt"
    torch.save({"w": torch.ones(2)}, local)
    assert main(["verify", str(local), "-q", "--storage-option", "no-equals-sign"]) == 2
    assert "'no-equals-sign' is not KEY=VALUE" in capsys.readouterr().err
    monkeypatch.setenv(STORAGE_OPTIONS_ENV, "[1, 2]")
    assert main(["verify", str(local), "-q"]) == 2
    err = capsys.readouterr().err
    assert f"${STORAGE_OPTIONS_ENV} must hold a JSON object" in err and "[1, 2]" in err


@pytest.mark.slow
def test_options_the_filesystem_refuses_and_an_unreachable_store_are_one_line_to_fix(
    s3_server: S3Server,  # noqa: F811 - the fixture
    url: str,
    no_credentials: None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An option s3fs does not take, a dict option given as text, a closed endpoint: each was
    "unexpected TypeError/AttributeError/EndpointConnectionError ... please report it"."""
    good = [f"endpoint_url={s3_server.endpoint_url}", "key=testing", "secret=testing"]
    with socket.socket() as probe:  # a loopback port nothing listens on once it is closed
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    cases = {
        "bogus=1": "its fsspec filesystem refused the storage options (",
        "client_kwargs=not-a-dict": "its fsspec filesystem refused the storage options (",
        f"endpoint_url=http://127.0.0.1:{closed}": "the store cannot be reached (",
    }
    for option, said in cases.items():
        flags = [f"--storage-option={f}" for f in (*good, option)]
        assert main(["verify", url, "-q", *flags]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"ddpstate: error: {url}: {said}"), err
        assert "ddpstate: error: unexpected" not in err[0] and "please report" not in err[0]
    monkeypatch.setenv(STORAGE_OPTIONS_ENV, '{"bogus": 1}')
    assert main(["inspect", url, *(f"--storage-option={f}" for f in good)]) == 2
    assert f"${STORAGE_OPTIONS_ENV} against" in capsys.readouterr().err
