"""The installed ``ddpstate`` console script, run in subprocesses: outputs, exit codes, errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import ddpstate
import ddpstate.convert
import ddpstate.errors
from ddpstate import _crc, formats, keys
from tests.payloads import RunsCommand
from tests.samples import RESNET20, data_offset

SAMPLE = RESNET20
EXE = shutil.which("ddpstate")


def run(*args: Any, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run the installed command; every call imports torch, so tests keep calls few."""
    assert EXE is not None, "the ddpstate console script is not installed (pip install -e .)"
    full_env = {k: v for k, v in os.environ.items() if k != "DDPSTATE_DEBUG"}
    full_env.update(env or {})
    return subprocess.run(
        [EXE, *map(str, args)], capture_output=True, text=True, timeout=120, env=full_env
    )


def assert_error(proc: subprocess.CompletedProcess[str], *fragments: str) -> None:
    """Exit 2, exactly one line on stderr starting 'ddpstate: error:', no traceback."""
    assert proc.returncode == 2, proc
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddpstate: error: "), proc.stderr
    assert "Traceback" not in proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 2)


@pytest.fixture()
def nested(tmp_path: Path) -> tuple[Path, Net, Any]:
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    net.fc(net.bn(net.conv(torch.randn(2, 3, 3, 3))).flatten(1)).sum().backward()
    opt.step()
    ckpt = {
        "epoch": 5,
        "state_dict": nn.DataParallel(net).state_dict(),
        "optimizer": opt.state_dict(),
    }
    path = tmp_path / "ckpt.pt"
    torch.save(ckpt, path)
    return path, net, ckpt


def test_help_version_and_bad_flags(tmp_path: Path) -> None:
    help_text = run("convert", "--help")
    assert help_text.returncode == 0 and "examples:" in help_text.stdout
    assert "--strip-module" in help_text.stdout and "--to {pt,safetensors,dcp}" in help_text.stdout
    version = run("--version")
    assert version.returncode == 0 and version.stdout.startswith("ddpstate ")
    # The CRC-32 library in use is part of the version line (issue 42).
    assert version.stdout.endswith(f"(torch {torch.__version__}, crc32: {_crc.IMPLEMENTATION})\n")
    assert_error(run("convert", "x.pt", "--strip-module", "--normalize"), "not allowed with")


def test_convert_strip_module_derives_dst_and_refuses_to_overwrite(
    nested: tuple[Path, Net, Any], tmp_path: Path
) -> None:
    path, _, ckpt = nested
    proc = run("convert", path, "--strip-module")
    dst = tmp_path / "ckpt.converted.pt"
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"wrote {dst} ") and proc.stderr == ""
    out = torch.load(dst, weights_only=True)
    expected = keys.strip_prefix(ckpt["state_dict"])
    assert list(out["state_dict"]) == list(expected) and out["epoch"] == 5
    Net().load_state_dict(out["state_dict"])
    assert len(out["optimizer"]["state"]) == 6
    for index, want in ckpt["optimizer"]["state"].items():
        assert torch.equal(
            out["optimizer"]["state"][index]["momentum_buffer"], want["momentum_buffer"]
        )

    before = dst.read_bytes()
    assert_error(run("convert", path, dst, "--strip-module"), str(dst), "--force")
    assert dst.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["ckpt.converted.pt", "ckpt.pt"]


def test_no_fsync_writes_the_same_bytes_and_is_refused_in_place(
    nested: tuple[Path, Net, Any], tmp_path: Path
) -> None:
    path, _, _ = nested
    durable = run("convert", path, tmp_path / "durable.pt", "--strip-module")
    fast = run("convert", path, tmp_path / "fast.pt", "--strip-module", "--no-fsync")
    assert durable.returncode == 0 and fast.returncode == 0, fast.stderr
    assert (tmp_path / "fast.pt").read_bytes() == (tmp_path / "durable.pt").read_bytes()
    before = path.read_bytes()
    assert_error(run("convert", path, "--in-place", "--strip-module", "--no-fsync"), "--in-place")
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt", "durable.pt", "fast.pt"]


def test_convert_to_safetensors_says_what_it_left_out(nested: tuple[Path, Net, Any]) -> None:
    path, net, _ = nested
    proc = run("convert", path, "--to", "safetensors", "--strip-module")
    assert proc.returncode == 0, proc.stderr
    assert "left out of the safetensors file" in proc.stdout
    assert "epoch, optimizer" in proc.stdout
    from ddpstate._io.safetensors_io import read_safetensors

    loaded = read_safetensors(path.with_suffix(".safetensors"))
    for key, value in net.state_dict().items():
        assert torch.equal(loaded[key], value)


def test_importing_ddpstate_does_not_import_torch() -> None:
    code = "import sys, ddpstate; print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


def test_key_rewrites_on_the_command_line(
    nested: tuple[Path, Net, Any], tmp_path: Path
) -> None:
    path, net, ckpt = nested
    st_src = tmp_path / "dp.safetensors"
    from safetensors.torch import save_file

    save_file(dict(nn.DataParallel(net).state_dict()), st_src)
    for src, dst in ((path, tmp_path / "plain.pt"), (st_src, tmp_path / "plain.safetensors")):
        argv = ["-m", "ddpstate", "convert", str(src), str(dst)]
        proc = subprocess.run(
            [sys.executable, *argv, "--strip-module"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr
    out = torch.load(tmp_path / "plain.pt", weights_only=True)
    assert list(out["state_dict"]) == list(keys.strip_prefix(ckpt["state_dict"]))
    from safetensors.torch import load_file

    plain = load_file(tmp_path / "plain.safetensors")
    for key, value in net.state_dict().items():
        assert torch.equal(plain[key], value)


def test_inspect_table_and_json(nested: tuple[Path, Net, Any]) -> None:
    path, _, ckpt = nested
    table = run("inspect", path)
    assert table.returncode == 0, table.stderr
    assert "prefixes   module." in table.stdout and "model      'state_dict'" in table.stdout
    assert "module.conv.weight" in table.stdout and "[4, 3, 3, 3]" in table.stdout
    assert "optimizer state:" in table.stdout
    data = json.loads(run("inspect", path, "--json").stdout)
    assert data["format"] == formats.TORCH_ZIP
    assert data["devices"] == {"cpu": len(ckpt["state_dict"]) + 6}
    assert [t["name"] for t in data["tensors"]] == list(ckpt["state_dict"])


@pytest.mark.slow
def test_diff_and_verify_exit_codes(nested: tuple[Path, Net, Any], tmp_path: Path) -> None:
    path, net, _ = nested
    torch.save(net.state_dict(), tmp_path / "plain.pt")
    same = run("diff", path, tmp_path / "plain.pt")
    assert same.returncode == 0 and "equal:" in same.stdout
    changed = net.state_dict()
    changed["fc.bias"] = changed["fc.bias"] + 0.5
    torch.save(changed, tmp_path / "changed.pt")
    diff = run("diff", path, tmp_path / "changed.pt", "--json")
    assert diff.returncode == 1
    result = json.loads(diff.stdout)
    assert (
        result["different_values"] == ["fc.bias"]
        and abs(result["max_abs_diff"]["fc.bias"] - 0.5) < 1e-6
    )

    assert run("verify", path).returncode == 0
    raw = bytearray(path.read_bytes())
    raw[data_offset(path, "/data/1")[0]] ^= 0x01
    (tmp_path / "flipped.pt").write_bytes(bytes(raw))
    bad = run("verify", tmp_path / "flipped.pt")
    assert bad.returncode == 1 and "BAD:" in bad.stdout and "CRC-32" in bad.stdout


def test_error_paths_leave_no_output(tmp_path: Path) -> None:
    assert_error(
        run("convert", tmp_path / "missing.pt", "--strip-module"), "missing.pt", "no such file"
    )
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    debug = run("inspect", tmp_path / "notes.txt", env={"DDPSTATE_DEBUG": "1"})
    assert debug.returncode == 2 and "Traceback" in debug.stderr  # DDPSTATE_DEBUG=1 shows it
    last = debug.stderr.strip().splitlines()[-1]
    assert last.startswith("ddpstate: error: ") and "not a checkpoint" in last

    torch.save({"module.w": torch.ones(1000)}, tmp_path / "full.pt")
    (tmp_path / "cut.pt").write_bytes((tmp_path / "full.pt").read_bytes()[:-300])
    assert_error(run("convert", tmp_path / "cut.pt", "--strip-module"), "cut.pt", "truncated")
    cut_verify = run("verify", tmp_path / "cut.pt")
    assert cut_verify.returncode == 1 and "truncated" in cut_verify.stdout

    torch.jit.save(torch.jit.script(nn.Linear(2, 2)), tmp_path / "scripted.pt")
    assert_error(run("convert", tmp_path / "scripted.pt", "--strip-module"), "TorchScript")

    assert sorted(os.listdir(tmp_path)) == ["cut.pt", "full.pt", "notes.txt", "scripted.pt"]


def test_unsafe_pickle_refused_then_run_only_with_unsafe(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    evil = tmp_path / "evil.pt"
    torch.save({"state_dict": {"module.w": torch.ones(2)}, "hook": RunsCommand(marker)}, evil)
    assert_error(run("convert", evil, "--strip-module"), "posix.system", "--unsafe")
    assert not (tmp_path / "evil.converted.pt").exists()
    assert not marker.exists()
    # --unsafe is torch's full unpickler, as the user asked by name: the file's code runs.
    shown = run("inspect", evil, "--unsafe")
    assert shown.returncode == 0 and "unsafe     posix.system" in shown.stdout
    assert marker.exists()
    converted = run("convert", evil, "--strip-module", "--unsafe")
    assert converted.returncode == 0, converted.stderr
    assert "1 key(s) renamed" in converted.stdout


def test_in_place_and_real_dataparallel_sample(tmp_path: Path) -> None:
    if not SAMPLE.exists():
        pytest.skip(f"sample checkpoint not found at {SAMPLE}")
    proc = run("convert", SAMPLE, tmp_path / "resnet20.pt", "--strip-module")
    assert proc.returncode == 0, proc.stderr
    assert "97 key(s) renamed in 'state_dict'" in proc.stdout
    again = run("convert", tmp_path / "resnet20.pt", "--in-place", "--strip-module")
    assert again.returncode == 0 and "nothing to change" in again.stdout

    model = resnet20()
    state = torch.load(tmp_path / "resnet20.pt", weights_only=True)["state_dict"]
    model.load_state_dict(state)  # strict: every key and shape matches the plain model
    original = torch.load(SAMPLE, map_location="cpu", weights_only=True)["state_dict"]
    for key, value in model.state_dict().items():
        if key.endswith("num_batches_tracked"):
            continue  # not in the 2018 file; load_state_dict leaves the default
        assert torch.equal(value, original["module." + key]), key
    model.eval()
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 10)


# ResNet-20 for CIFAR-10 as in the sample's source repository (He et al. 2016,
# option A shortcuts: stride-2 subsampling plus zero channel padding).
class _Shortcut(nn.Module):
    def __init__(self, planes: int) -> None:
        super().__init__()
        self.pad = planes // 4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.pad(x[:, :, ::2, ::2], (0, 0, 0, 0, self.pad, self.pad))


class _Block(nn.Module):
    def __init__(self, in_planes: int, planes: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_planes != planes:
            self.shortcut = _Shortcut(planes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class _ResNet(nn.Module):
    def __init__(self, blocks: int = 3) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        layers, in_planes = [], 16
        for planes, stride in ((16, 1), (32, 2), (64, 2)):
            stage = []
            for i in range(blocks):
                stage.append(_Block(in_planes, planes, stride if i == 0 else 1))
                in_planes = planes
            layers.append(nn.Sequential(*stage))
        self.layer1, self.layer2, self.layer3 = layers
        self.linear = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.layer3(self.layer2(self.layer1(out)))
        return self.linear(out.mean(dim=(2, 3)))


def resnet20() -> nn.Module:
    """The plain (unwrapped) ResNet-20 whose DataParallel weights the sample holds."""
    return _ResNet(3)


def test_option_names_never_rewrite_paths(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from ddpstate.cli import _cli_terms, main

    folder = tmp_path / "key=a"
    folder.mkdir()
    missing = folder / "nothere.pt"
    assert main(["verify", str(missing)]) == 2
    assert f"{missing}: no such file" in capsys.readouterr().err
    src = tmp_path / "run_key=7.pt"
    torch.save({"w": torch.zeros(1)}, src)
    assert main(["convert", str(src), str(folder / "o.pt"), "--key", "in_place=True"]) == 2
    err = capsys.readouterr().err
    assert "no entry 'in_place=True'" in err and "--key model.state_dict" in err
    # Paths the user did not type (found inside a folder) are left alone too.
    text = "cannot read /data/key=b/unsafe=True/x.pt (key='model')"
    assert _cli_terms(text) == "cannot read /data/key=b/unsafe=True/x.pt (--key model)"


def test_an_error_about_an_argument_names_its_option(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from ddpstate.cli import _ARGUMENT_FLAGS, _cli_terms, main

    src = tmp_path / "ck.pt"
    torch.save({"epoch": 3, "model": {"module.w": torch.zeros(1)}}, src)
    # keys.find_state_dict's message says "pass the key of the model state dict";
    # the error carries argument="key", so the command names --key.
    assert main(["convert", str(src), "--key", "epoch", "--strip-module", "-q"]) == 2
    err = capsys.readouterr().err
    assert "not a state dict" in err and err.rstrip().endswith("(--key)"), err
    with pytest.raises(ddpstate.errors.StateDictNotFoundError) as info:
        ddpstate.convert_file(src, edit=ddpstate.convert.StateEdit(key="epoch"))
    assert info.value.argument == "key"
    with pytest.raises(ddpstate.errors.CheckpointExistsError) as exists:
        ddpstate.convert_file(src, src)
    assert exists.value.argument == "in_place" and _ARGUMENT_FLAGS["in_place"] == "--in-place"
    # Only the value the option sets is rewritten: weights_only=True is torch's own call.
    text = "it names globals torch.load(weights_only=True) refuses: pass --unsafe (unsafe=True)"
    assert (
        _cli_terms(text) == "it names globals torch.load(weights_only=True) refuses: pass --unsafe"
    )


def test_a_file_needing_safe_globals_is_explained_in_command_terms(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from ddpstate.cli import main

    # A dict subclass pickles by its own global: torch's weights-only loader refuses it.
    src = tmp_path / "odd.pt"
    torch.save({"w": torch.ones(2), "meta": _Meta(a=1)}, src)
    for command in ("inspect", "verify", "convert"):
        assert main([command, str(src)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("ddpstate: error: ") and "\n" not in err, err
        assert "_Meta" in err and "--unsafe" in err, err
        # Python arguments appear only inside the Python call the message spells out.
        assert "weights_only=" not in err, err
        assert err.count("safe_globals=") == 1 and "ddpstate.load(path, safe_globals=" in err, err


class _Meta(dict):  # type: ignore[type-arg]
    """A dict subclass: pickled by its own global, so weights_only refuses it."""
