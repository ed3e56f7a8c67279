"""The ``ddpstate`` command: convert, inspect, diff and verify checkpoint files."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import posixpath
import re
import sys
import traceback
from collections.abc import Sequence
from typing import IO, Any, NoReturn, Optional

import torch

from ddpstate import _crc, formats, storage
from ddpstate._fs import is_remote
from ddpstate._progress import human_bytes
from ddpstate._version import __version__
from ddpstate.convert import StateEdit, convert_file, diff_files, inspect_file, verify_file
from ddpstate.errors import (
    CheckpointAccessError,
    CheckpointFormatError,
    DDPStateError,
    InvalidArgumentError,
)
from ddpstate.formats import DESCRIPTIONS, MANAGER, PT, SAFETENSORS, FormatName, parse_format
from ddpstate.integrations._run_folders import RunFolder, find_run_folder, verify_run_folder

__all__ = ["main"]


_MAIN_EPILOG = """\
examples:
  ddpstate convert ckpt.pt --strip-module          # DataParallel/DDP keys -> plain model keys
  ddpstate convert ckpt.pt model.safetensors --to safetensors --normalize
  ddpstate inspect ckpt.pt                         # structure, dtypes, devices, keys; no data read
  ddpstate diff a.pt b.safetensors --atol 1e-6     # exit 0 when equal, 1 when not
  ddpstate verify ckpt.pt                          # exit 0 when intact, 1 when damaged

Every command reads headers and pickle structure without running any code from
the file; files that name unsafe globals are refused unless --unsafe is given.
Set DDPSTATE_DEBUG=1 to see tracebacks.
"""

_CONVERT_EPILOG = """\
examples:
  ddpstate convert ckpt.pt --strip-module                  # writes ckpt.converted.pt
  ddpstate convert ckpt.pt plain.pt --normalize            # drop module. and _orig_mod. anywhere
  ddpstate convert ckpt.pt --key model.ema --add-prefix net.
  ddpstate convert ckpt.pt --to safetensors                # model weights only -> ckpt.safetensors
  ddpstate convert model.safetensors --to pt               # -> model.pt, a plain state dict
  ddpstate convert dcp_folder/ model.pt                    # consolidate a DCP (FSDP2) folder
  ddpstate convert ckpt.pt out_folder/ --to dcp            # write a DCP folder (loads resharded)
  ddpstate convert ckpt.pt --drop-optimizer --in-place     # shrink a checkpoint for release
  ddpstate convert ckpt.pt model.safetensors --dtype bf16  # floating tensors -> bfloat16
  ddpstate convert ckpt.pt out_dir --to safetensors --max-shard-size 2GB  # HF sharded folder
  ddpstate convert runs/step_0000000100 --key ema --to safetensors   # a manager step's entry
  ddpstate convert out/checkpoint-500 model.pt             # an HF Trainer or Accelerate folder

The model state dict is found the way ddpstate.keys.find_state_dict finds it
(state_dict, model, model_state_dict, ...; --key names it); everything else
(epoch, optimizer, metrics) is kept as it is. Tensor data is copied byte for
byte; the output is written atomically with every storage tagged cpu, and
fsynced before it is renamed into place (--no-fsync skips that for scratch
copies: then a power loss, not a crash of this process, can leave DST empty).
"""

_INSPECT_EPILOG = """\
examples:
  ddpstate inspect ckpt.pt
  ddpstate inspect model.safetensors --json | python -m json.tool
  ddpstate inspect dcp_folder/                     # keys, shapes, dtypes from .metadata only
  ddpstate inspect out/checkpoint-500              # a training folder: model, files and roles
  ddpstate inspect runs/exp1                       # a manager directory: its newest committed step
  ddpstate inspect out/                            # a folder of checkpoints: its newest one
"""

_DIFF_EPILOG = """\
examples:
  ddpstate diff dp_ckpt.pt plain.pt              # module. prefixes are ignored by default
  ddpstate diff a.pt b.pt --raw-keys --atol 1e-5
  ddpstate diff lightning.ckpt plain.pt --key state_dict --strip-prefix model.
  ddpstate diff hf_model_dir/ plain.safetensors  # a sharded folder (index + shards)

Exit status: 0 when the model state dicts are equal within --atol, 1 when not.
"""

_VERIFY_EPILOG = """\
examples:
  ddpstate verify ckpt.pt && cp ckpt.pt /backup/
  ddpstate verify runs/exp1/step_0000001200        # one CheckpointManager checkpoint
  ddpstate verify runs/exp1                         # every committed step; the one restore() takes
  ddpstate verify dcp_folder/                       # .metadata parses, every shard file whole
  ddpstate verify out/checkpoint-500                # HF Trainer / Accelerate: each file, manifest
  ddpstate verify out/                              # a Trainer output_dir: every checkpoint-N
  ddpstate verify project/checkpoints/              # Accelerate: every checkpoint_N
  ddpstate verify ckpt_dir/                         # a Lightning dirpath: every .ckpt
  ddpstate verify s3://bucket/runs/exp1 --storage-option endpoint_url=http://127.0.0.1:9000

Exit status: 0 when intact, 1 when something is wrong (one line per problem). In a
folder of checkpoints, each is listed ok or BAD and the one resuming takes is named;
leftovers of killed saves and a `latest` behind the newest step are notes.
URLs: fsspec options from --storage-option and $DDPSTATE_STORAGE_OPTIONS (a JSON
object); for S3 also AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL.
"""


_SRC_HELP = (
    "checkpoint file, Hugging Face sharded folder or torch.distributed.checkpoint folder "
    "(a path or an fsspec URL)"
)
#: A JSON object of fsspec options for every URL a command opens (--storage-option wins).
STORAGE_OPTIONS_ENV = "DDPSTATE_STORAGE_OPTIONS"


class _UsageError(Exception):
    """A command-line mistake; printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        where = self.prog.split(" ", 1)[1] if " " in self.prog else ""
        hint = f" (see {self.prog} --help)"
        raise _UsageError(f"{where + ': ' if where else ''}{message}{hint}")


def _add_common(parser: argparse.ArgumentParser, *, progress: bool = True) -> None:
    parser.add_argument(
        "--storage-option", "--storage_option", action="append", default=[],
        type=_storage_option, metavar="KEY=VALUE", dest="storage_option",
        help="an fsspec option for URLs (s3://, gs://, ...), repeatable; VALUE is read as "
        "JSON when it parses (true, 3, {...}), else as a string, e.g. --storage-option "
        "'client_kwargs={\"endpoint_url\": \"http://127.0.0.1:9000\"}'; given over the "
        f"JSON object in ${STORAGE_OPTIONS_ENV}",
    )  # fmt: skip
    parser.add_argument(
        "--unsafe",
        action="store_true",
        help="load with torch.load(weights_only=False), torch's full unpickler: it runs the "
        "code a file's pickle names; only for files you trust",
    )
    if progress:
        parser.add_argument("-q", "--quiet", action="store_true", help="no progress bar on stderr")


def _add_key_options(parser: argparse.ArgumentParser) -> None:
    """The model-key options convert and diff share: which state dict, and one rename rule."""
    rule = parser.add_mutually_exclusive_group()
    rule.add_argument(
        "--strip-module", "--strip_module", action="store_const", const="module.",
        dest="strip_prefix", help="remove the 'module.' prefix DataParallel/DDP add",
    )  # fmt: skip
    rule.add_argument(
        "--add-module", "--add_module", action="store_const", const="module.",
        dest="add_prefix", help="add 'module.' (to load into a DataParallel/DDP-wrapped model)",
    )  # fmt: skip
    rule.add_argument(
        "--strip-prefix", "--strip_prefix", metavar="P",
        help="remove prefix P (ending in '.', e.g. '_orig_mod.')",
    )  # fmt: skip
    rule.add_argument(
        "--add-prefix", "--add_prefix", metavar="P", help="add prefix P (ending in '.')"
    )
    rule.add_argument(
        "--normalize", action="store_true",
        help="remove every wrapper prefix (module., _orig_mod.) wherever torch puts them",
    )  # fmt: skip
    parser.add_argument(
        "--on-collision", "--on_collision", choices=("error", "keep_existing", "keep_prefixed"),
        default="error",
        help="when the rule makes two keys equal: fail (default), keep the entry that had the "
        "plain key, or keep the renamed one",
    )  # fmt: skip
    parser.add_argument(
        "--key", metavar="PATH",
        help="dotted path of the model state dict in the checkpoint, e.g. 'model.ema'; in a "
        "training folder, first the entry or weights file (a manager step's 'ema')",
    )  # fmt: skip


def _key_rule(args: argparse.Namespace) -> dict[str, Any]:
    """The key options as :func:`ddpstate.convert.convert_file`/``diff_files`` arguments."""
    return {
        name: getattr(args, name)
        for name in ("strip_prefix", "add_prefix", "normalize", "on_collision", "key")
    }


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="ddpstate",
        description="Convert, inspect, compare and verify PyTorch checkpoint files.",
        epilog=_MAIN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # The CRC-32 library decides how fast every check runs: a bug report should say which.
    version = f"ddpstate {__version__} (torch {torch.__version__}, crc32: {_crc.IMPLEMENTATION})"
    parser.add_argument("--version", action="version", version=version)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True
    for add in (_add_convert, _add_inspect, _add_diff, _add_verify):
        add(commands)
    return parser


def _command(
    commands: Any, name: str, func: Any, epilog: str, help: str, description: str
) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = commands.add_parser(
        name, help=help, description=description, epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.set_defaults(func=func)
    return parser


def _add_convert(commands: Any) -> None:
    convert = _command(
        commands, "convert", _cmd_convert, _CONVERT_EPILOG,
        help="rewrite keys or format; tensors stay memory-mapped",
        description="Rewrite a checkpoint's model keys or format: torch.load (memory-mapped), "
        "then torch.save; memory does not grow with the file.",
    )  # fmt: skip
    convert.add_argument("src", metavar="SRC", help=_SRC_HELP)
    convert.add_argument(
        "dst",
        metavar="DST",
        nargs="?",
        help="file to write (default: derived from SRC, e.g. ckpt.converted.pt); the folder "
        "to write with --to dcp",
    )
    _add_key_options(convert)
    convert.add_argument(
        "--to", type=_output_format, metavar="{pt,safetensors,dcp}",
        help="output format (default: from DST's suffix, .safetensors or .pt/.pth/.bin/.ckpt, "
        "else the source's; pt for a DCP folder); safetensors keeps the model state dict "
        "only; dcp writes a torch.distributed.checkpoint folder; 'torch' and 'pth' also "
        "name pt",
    )  # fmt: skip
    convert.add_argument(
        "--max-shard-size", "--max_shard_size", metavar="SIZE",
        help="write DST as a folder of safetensors shards of at most SIZE (e.g. 2GB, 500MB, "
        "1.5GiB, or bytes) plus model.safetensors.index.json: the Hugging Face sharded layout",
    )  # fmt: skip
    convert.add_argument(
        "--dtype", choices=("bf16", "fp16", "fp32"),
        help="cast floating tensors to this dtype (integer and bool buffers such as "
        "num_batches_tracked are kept), one tensor in memory at a time",
    )  # fmt: skip
    convert.add_argument(
        "--drop-optimizer", "--drop_optimizer", action="store_true",
        help="leave optimizer state out of the output",
    )  # fmt: skip
    convert.add_argument(
        "--in-place", "--in_place", action="store_true", help="replace SRC (atomically)"
    )
    convert.add_argument("--force", action="store_true", help="overwrite an existing DST")
    convert.add_argument(
        "--no-fsync", "--no_fsync", action="store_true",
        help="do not fsync DST: as fast as cp and still atomic if the process dies, but a power "
        "loss can leave DST empty (not with --in-place)",
    )  # fmt: skip
    _add_common(convert)


def _add_inspect(commands: Any) -> None:
    inspect = _command(
        commands, "inspect", _cmd_inspect, _INSPECT_EPILOG,
        help="describe a checkpoint from its headers only",
        description="Show format, sizes, dtypes, devices, wrapper prefixes, structure and keys. "
        "Reads headers and the pickle structure only, never tensor data.",
    )  # fmt: skip
    inspect.add_argument("src", metavar="SRC", help=_SRC_HELP)
    inspect.add_argument("--json", action="store_true", help="print JSON instead of a table")
    _add_common(inspect, progress=False)


def _add_diff(commands: Any) -> None:
    diff = _command(
        commands, "diff", _cmd_diff, _DIFF_EPILOG,
        help="compare two checkpoints' model weights",
        description="Compare the model state dicts of two checkpoints: keys only in one, "
        "shape/dtype mismatches, and the largest absolute difference per tensor.",
    )  # fmt: skip
    diff.add_argument("a", metavar="A", help="first checkpoint file (or sharded folder)")
    diff.add_argument("b", metavar="B", help="second checkpoint file (or sharded folder)")
    _add_key_options(diff)
    diff.add_argument(
        "--raw-keys", "--raw_keys", action="store_true",
        help="compare keys as stored (default: ignore wrapper prefixes)",
    )  # fmt: skip
    diff.add_argument(
        "--atol", type=_non_negative_float, default=0.0, metavar="X",
        help="absolute tolerance: differences up to X count as equal (default 0)",
    )  # fmt: skip
    diff.add_argument("--json", action="store_true", help="print JSON")
    _add_common(diff)


def _add_verify(commands: Any) -> None:
    verify = _command(
        commands, "verify", _cmd_verify, _VERIFY_EPILOG,
        help="check a checkpoint file or CheckpointManager folder is intact",
        description="Read a checkpoint end to end: every record present, of the right size, "
        "and matching its CRC-32 (torch.save files). For a CheckpointManager step folder or "
        "directory: the manifest (commit marker), every file's size and CRC-32, the latest "
        "pointer, and the step restore() takes. For a Hugging Face sharded folder: every shard "
        "as above, every key in exactly the shard its index names, and the index's total_size. "
        "For a Lightning dirpath, an Accelerate checkpoints/ folder or a Trainer output_dir: "
        "each checkpoint, and the one the integration resumes from.",
    )  # fmt: skip
    verify.add_argument(
        "src", metavar="SRC",
        help="checkpoint file, CheckpointManager step folder or directory, Hugging Face "
        "sharded folder, torch.distributed.checkpoint folder, or a folder of a framework's "
        "checkpoints (a path or an fsspec URL)",
    )  # fmt: skip
    verify.add_argument("--json", action="store_true", help="print JSON")
    _add_common(verify)


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a number >= 0")
    return value


def _storage_option(text: str) -> tuple[str, Any]:
    key, equals, value = text.partition("=")
    if not equals or not key:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not KEY=VALUE (e.g. endpoint_url=http://...)"
        )
    try:
        return key, json.loads(value)
    except ValueError:  # not JSON: a plain string, as most options are
        return key, value


def _storage_options(args: argparse.Namespace) -> Optional[dict[str, Any]]:
    """The fsspec options: ``$DDPSTATE_STORAGE_OPTIONS``, then each ``--storage-option``."""
    options: dict[str, Any] = {}
    raw = os.environ.get(STORAGE_OPTIONS_ENV, "")
    if raw.strip():
        try:
            loaded = json.loads(raw)
        except ValueError as exc:
            loaded = exc
        if not isinstance(loaded, dict):
            raise _UsageError(
                f"${STORAGE_OPTIONS_ENV} must hold a JSON object of fsspec options, such as "
                f'\'{{"endpoint_url": "http://127.0.0.1:9000"}}\', not {raw!r}'
            )
        options.update(loaded)
    options.update(args.storage_option)
    return options or None


def _output_format(text: str) -> FormatName:
    try:
        return parse_format(text, allowed=(PT, SAFETENSORS, formats.DCP), what="--to")
    except InvalidArgumentError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _print_json(result: Any, out: IO[str], status: int) -> int:
    print(json.dumps(result.to_dict(), indent=2), file=out)
    return status


def _table(title: str, rows: Sequence[Sequence[str]]) -> list[str]:
    """``title``, then ``rows`` indented, each column as wide as its widest cell."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    cells = [
        "".join(f"{c:<{w}}  " for c, w in zip(row[:-1], widths, strict=True)) + row[-1]
        for row in rows
    ]
    return [title] + [f"  {line}".rstrip() for line in cells]


def _list(items: Sequence[str], limit: int = 8) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f", ... ({len(items)} in all)" if len(items) > limit else "")


# --------------------------------------------------------------------------- commands


def _cmd_convert(args: argparse.Namespace, out: IO[str]) -> int:
    if args.in_place and args.dst is not None:
        raise _UsageError("convert: pass DST or --in-place, not both (see ddpstate convert --help)")
    if args.in_place and args.no_fsync:
        raise _UsageError(
            "convert: --in-place replaces the only copy of SRC and needs fsync; drop "
            "--no-fsync or name a DST (see ddpstate convert --help)"
        )
    edit = StateEdit(**_key_rule(args), drop_optimizer=args.drop_optimizer, dtype=args.dtype)
    result = convert_file(
        args.src,
        args.dst,
        edit=edit,
        format=args.to,
        max_shard_size=args.max_shard_size,
        in_place=args.in_place,
        overwrite=args.force,
        weights_only=not args.unsafe,
        progress=not args.quiet,
        fsync=not args.no_fsync,
        storage_options=_storage_options(args),
    )
    if not result.written:
        print(f"{result.dst}: nothing to change; left as it is", file=out)
    else:
        where = ""
        if result.state_dict_path is not None:
            where = f" in '{result.state_dict_path}'" if result.state_dict_path else ""
            where = f"; {result.renamed} key(s) renamed{where}"
        print(
            f"wrote {result.dst} ({DESCRIPTIONS[result.dst_format]}, {result.tensors} tensors, "
            f"{human_bytes(result.bytes_copied)} of tensor data{where})",
            file=out,
        )
    if result.left_out:
        print(
            f"left out of the safetensors file (it holds the model state dict only): "
            f"{_list(result.left_out)}",
            file=out,
        )
    if result.dropped:
        print(f"dropped: {_list(result.dropped)}", file=out)
    for note in result.notes:
        print(f"note: {note}", file=out)
    return 0


def _about_run(run: RunFolder, shown: str) -> str:
    """``inspect``'s note on a folder of checkpoints: what it holds, which one is ``shown``."""
    names = ", ".join(posixpath.basename(p) for p in run.checkpoints)
    which = "its own model" if run.own_files else f"its newest, {posixpath.basename(shown)}"
    return (
        f"{run.path}: {run.what} with {names}; shown: {which} (`ddpstate verify` names the "
        f"one resume takes)"
    )


def _cmd_inspect(args: argparse.Namespace, out: IO[str]) -> int:
    opts = _storage_options(args)
    run = _run_folder(args.src, opts)
    # A folder of checkpoints shows its newest; one with a model of its own, that model.
    src = run.checkpoints[-1] if run is not None and not run.own_files else args.src
    info = inspect_file(src, weights_only=not args.unsafe, storage_options=opts)
    if run is not None:
        info = dataclasses.replace(info, notes=(_about_run(run, src), *info.notes))
    if args.json:
        return _print_json(info, out, 0)
    dtypes = ", ".join(f"{d} {human_bytes(n)}" for d, n in sorted(info.dtype_bytes.items()))
    devices = ", ".join(f"{d} ({n} storages)" for d, n in sorted(info.devices.items()))
    lines = [
        f"file       {info.path}",
        f"format     {DESCRIPTIONS.get(info.format, info.format)}, {human_bytes(info.file_size)}",
        f"tensors    {info.tensor_count} ({human_bytes(info.tensor_bytes)}): {dtypes or '-'}",
        f"devices    {devices or '-'}",
        f"prefixes   {' '.join(info.prefixes) or '(none)'}",
    ]
    if info.state_dict_path is not None:
        model = f"'{info.state_dict_path}'" if info.state_dict_path else "the whole file"
        lines.append(f"model      {model} ({len(info.tensors)} keys)")
    if info.unsafe_globals:
        lines.append(f"unsafe     {_list(info.unsafe_globals)}")
    if info.structure:
        lines += _table("structure", info.structure)
    for note in info.notes:
        lines.append(f"note: {note}")
    for problem in info.problems:
        lines.append(f"warning: {problem} (run `ddpstate verify`)")
    if info.tensors:
        shown = [
            (str(list(t.shape)), str(t.nbytes)) if t.device else ("", "") for t in info.tensors
        ]
        rows = [(t.name, t.dtype, *more) for t, more in zip(info.tensors, shown, strict=True)]
        lines += _table("keys", [("name", "dtype", "shape", "bytes"), *rows])
    print("\n".join(lines), file=out)
    return 0


def _cmd_diff(args: argparse.Namespace, out: IO[str]) -> int:
    result = diff_files(
        args.a, args.b, raw_keys=args.raw_keys, atol=args.atol, weights_only=not args.unsafe,
        progress=not args.quiet, storage_options=_storage_options(args), **_key_rule(args),
    )  # fmt: skip
    if args.json:
        return _print_json(result, out, 0 if result.equal else 1)
    lines = list(result.notes)
    for side, only in (("A", result.only_a), ("B", result.only_b)):
        if only:
            lines.append(f"only in {side} ({len(only)}): {_list(only)}")
    for key, a, b in result.mismatched:
        lines.append(f"mismatch {key}: A has {a}, B has {b}")
    for key in result.different_values:
        lines.append(f"differs  {key}: max |A-B| = {result.max_abs_diff[key]:.6g}")
    worst = max(result.max_abs_diff.values(), default=0.0)
    verdict = "equal" if result.equal else "different"
    lines.append(
        f"{verdict}: {len(result.max_abs_diff)} shared tensors compared, largest |A-B| = "
        f"{worst:.6g} (atol {result.atol:g})"
    )
    print("\n".join(lines), file=out)
    return 0 if result.equal else 1


def _run_folder(src: str, opts: Optional[dict[str, Any]]) -> Optional[RunFolder]:
    """A framework's folder of checkpoints at ``src``, when ``src`` is no checkpoint itself."""
    if not storage.isdir(src, storage_options=opts):
        return None
    try:
        kind = formats.detect_format(src, storage_options=opts)
    except CheckpointFormatError:
        return find_run_folder(src, opts)
    # A Trainer's output_dir also holds the model save_model() wrote: a training folder too.
    if kind in (formats.HF_TRAINER, formats.ACCELERATE):
        return find_run_folder(src, opts, own_files=True)
    return None


def _cmd_verify(args: argparse.Namespace, out: IO[str]) -> int:
    opts = _storage_options(args)
    run = _run_folder(args.src, opts)
    checks: dict[str, Any] = {
        "weights_only": not args.unsafe, "progress": not args.quiet, "storage_options": opts
    }  # fmt: skip
    result = verify_run_folder(run, **checks) if run else verify_file(args.src, **checks)
    if args.json:
        return _print_json(result, out, 0 if result.ok else 1)
    kind = DESCRIPTIONS.get(result.format, "unreadable") if result.format else "unreadable"
    if run is not None:
        kind = run.what
    if result.ok:
        counted = "" if result.format == MANAGER else f"{result.tensors} tensors, "
        checked = "read and checked" if result.format != formats.DCP else "read; sizes checked"
        print(
            f"ok: {result.path} ({kind}, {counted}{human_bytes(result.bytes_read)} {checked})",
            file=out,
        )
    else:
        print(f"BAD: {result.path} ({kind}): {len(result.problems)} problem(s)", file=out)
        for problem in result.problems:
            print(f"  - {problem}", file=out)
    if result.checkpoints:
        rows = [
            ("ok" if good else "BAD", name, "<- resume" if name == result.resume_from else "")
            for name, good in result.checkpoints.items()
        ]
        print("\n".join(_table("checkpoints", rows)), file=out)
    for note in result.notes:
        print(f"note: {note}", file=out)
    return 0 if result.ok else 1


# --------------------------------------------------------------------------- entry point


# How a library message spells a Python argument -> the option that does the same.
_FLAGS = {
    "key=": "--key",  # followed by the value, if any: key='model.ema' -> --key model.ema
    "in_place=True": "--in-place",
    "overwrite=True": "--force",
    "unsafe=True": "--unsafe",
    "weights_only=False": "--unsafe",
    "on_collision=": "--on-collision",
}
# The argument an error carries (DDPStateError.argument) -> its option.
_ARGUMENT_FLAGS = {spelled.split("=")[0]: flag for spelled, flag in _FLAGS.items()}
# One pattern from the table: a spelling counts only where it starts a word that is not
# part of a path (no letter, digit, _ . / \\ - or : before it).
_SPELLED = re.compile(
    r"(?<![\w./\\:-])(?:"
    + "|".join(
        re.escape(s) + (r"(?:'[^']*'|\"[^\"]*\")?" if s.endswith("=") else r"\b") for s in _FLAGS
    )
    + ")"
)
# Fixes a message gives in Python terms, said as a command-line user makes them: a pickled
# module's .state_dict(); safe_globals, which no option takes (a Python-only way, named so).
_STATE_DICT = "pass --unsafe (only for files you trust) to read its parameters"
_CLI_PHRASES = {
    "load it with --unsafe and call .state_dict()": _STATE_DICT,
    "load it with --unsafe and use its .state_dict()": _STATE_DICT,
    "which weights_only=True refuses": "which torch's weights-only loader refuses",
    "allow just these by name: safe_globals=[...] (ddpstate.load, CheckpointManager(..., "
    "safe_globals=[...]))": "allow just these by name from Python, ddpstate.load(path, "
    "safe_globals=[...]) (no ddpstate command takes them)",
}


def _flag(match: re.Match[str]) -> str:
    for spelled, flag in _FLAGS.items():
        if match[0].startswith(spelled):
            value = match[0][len(spelled) :]
            return f"{flag} {value[1:-1]}" if value else flag
    raise AssertionError(match[0])  # the pattern matches only the table's spellings


def _cli_terms(message: str, typed: Sequence[str] = (), argument: Optional[str] = None) -> str:
    """``message`` naming options, not Python arguments (``typed`` values kept verbatim)."""
    masks: dict[str, str] = {}
    for i, value in enumerate(sorted(set(typed), key=len, reverse=True)):
        if len(value) > 1 and not value.startswith("-") and value in message:
            masks[f"\x00{i}\x00"] = value
            message = message.replace(value, f"\x00{i}\x00")
    message = _SPELLED.sub(_flag, message)
    for flag in set(_FLAGS.values()):
        message = message.replace(f"{flag} ({flag})", flag)  # "pass --force (overwrite=True)"
    for python_terms, command_terms in _CLI_PHRASES.items():
        message = message.replace(python_terms, command_terms)
    named = _ARGUMENT_FLAGS.get(argument or "")
    if named is not None and named not in message:
        message += f" ({named})"
    for mask, value in masks.items():
        message = message.replace(mask, value)
    return message


def _one_line(exc: BaseException, typed: Sequence[str] = ()) -> str:
    text = " ".join(str(exc).split())
    if isinstance(exc, DDPStateError):
        text = _cli_terms(text, typed, exc.argument)
    return text or type(exc).__name__


# botocore's errors for credentials it cannot find or use (by name: botocore is s3fs's, optional).
_NO_CREDENTIALS = ("NoCredentialsError", "PartialCredentialsError", "NoAuthTokenError")


# botocore's errors for an endpoint it cannot reach (by name, as above).
_UNREACHABLE = ("EndpointConnectionError", "ConnectTimeoutError", "ConnectionClosedError")


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and the exceptions it was raised from or during, each once."""
    chain: list[BaseException] = []
    cause: Optional[BaseException] = exc
    while cause is not None and cause not in chain:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    return chain


def _store_error(
    exc: BaseException, urls: Sequence[str], options_given: bool
) -> Optional[DDPStateError]:
    """``exc`` as one line naming the URL and the fix: an unreachable store, refused options.

    An option the filesystem does not take (``bogus=1``, ``client_kwargs=text``) fails
    inside fsspec or botocore as a TypeError or AttributeError, which is the user's to fix.
    """
    if not urls:
        return None
    url = " / ".join(dict.fromkeys(urls))
    unreachable = [e for e in _chain(exc) if type(e).__name__ in _UNREACHABLE]
    if unreachable:
        return CheckpointAccessError(
            f"{url}: the store cannot be reached ({_one_line(unreachable[0])}); check "
            f"endpoint_url (--storage-option endpoint_url=..., AWS_ENDPOINT_URL) and the network"
        )
    if options_given and isinstance(exc, (TypeError, AttributeError)):
        return InvalidArgumentError(
            f"{url}: its fsspec filesystem refused the storage options ({_one_line(exc)}); "
            f"check each --storage-option KEY=VALUE and ${STORAGE_OPTIONS_ENV} against that "
            f"filesystem's options (VALUE is read as JSON when it parses, e.g. "
            f'\'client_kwargs={{"region_name": "us-east-1"}}\')'
        )
    return None


def _credentials_error(exc: BaseException, urls: Sequence[str]) -> Optional[CheckpointAccessError]:
    """``exc`` as one line naming the URL and what to set, when it is a credential failure."""
    if not urls:
        return None
    chain = _chain(exc)
    found = [e for e in chain if type(e).__name__ in _NO_CREDENTIALS]
    missing = bool(found)
    # s3fs, gcsfs...: a refusal by the store, which names no local file (a local one does).
    found += [
        e
        for e in chain
        if isinstance(e, PermissionError)
        and not isinstance(e, DDPStateError)
        and e.filename is None
    ]
    if not found:
        return None
    url = " / ".join(dict.fromkeys(urls))
    what = "no credentials were found" if missing else "access was refused"
    if urls[0].startswith(("s3://", "s3a://")):
        fix = (
            "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), and "
            "AWS_ENDPOINT_URL for an S3-compatible server, or pass --storage-option key=... "
            "--storage-option secret=... --storage-option endpoint_url=..."
        )
    else:
        fix = "set the credentials its fsspec filesystem reads, or pass them with --storage-option"
    return CheckpointAccessError(
        f"{url}: {what} ({_one_line(found[0])}); {fix} (or ${STORAGE_OPTIONS_ENV})"
    )


def _urls(args: argparse.Namespace) -> list[str]:
    """The fsspec URLs among a command's paths."""
    named = (getattr(args, name, None) for name in ("src", "dst", "a", "b"))
    return [text for text in named if isinstance(text, str) and is_remote(text)]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the ``ddpstate`` command line; returns the exit status.

    Args:
        argv: The arguments after the program name (default: ``sys.argv[1:]``).

    Returns:
        0 on success; 1 when ``diff`` finds differences or ``verify`` finds
        damage; 2 on any error (printed as one line ``ddpstate: error: ...``
        on stderr; ``DDPSTATE_DEBUG=1`` adds the traceback).

    Example:
        >>> from ddpstate.cli import main
        >>> main(["--version"])  # doctest: +ELLIPSIS
        ddpstate ...
        0
    """
    debug = os.environ.get("DDPSTATE_DEBUG", "") not in ("", "0")
    typed = list(sys.argv[1:] if argv is None else argv)  # kept verbatim in messages
    parser = _build_parser()
    urls: list[str] = []
    options_given = bool(os.environ.get(STORAGE_OPTIONS_ENV, "").strip())
    try:
        args = parser.parse_args(argv)
        options_given = options_given or bool(getattr(args, "storage_option", None))
        urls = _urls(args)
        return int(args.func(args, sys.stdout))
    except SystemExit as exc:  # --help and --version end here
        return exc.code if isinstance(exc.code, int) else 0
    except KeyboardInterrupt:
        print("ddpstate: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `ddpstate inspect big.pt | head`: the reader left; not an error.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except Exception as raised:
        if debug:
            traceback.print_exc()
        # Said in option terms already.
        access = _credentials_error(raised, urls) or _store_error(raised, urls, options_given)
        text = str(access) if access is not None else _one_line(raised, typed)
        if access is None and not isinstance(
            raised, (_UsageError, DDPStateError, ValueError, OSError)
        ):
            text = (
                f"unexpected {type(raised).__name__}: {text} (set DDPSTATE_DEBUG=1 for the "
                "traceback, and please report it)"
            )
        print(f"ddpstate: error: {text}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
