"""Run the fault and bad-input campaign at scale and print what it found.

    python -m tests.faults.campaign --crash-trials 200 --corrupt-per-format 500 \\
        --fuzz-cases 1000 --seed 0 --json /tmp/faults-campaign.json

Every category uses the functions the CI tests in ``tests/faults/`` use (one
implementation: the CI runs fewer trials with fixed seeds). Each category runs in
its own forked worker process, so a crash of the interpreter (a segfault in a
reader) is reported as a defect instead of ending the campaign. The exit status
is 0 when no category found a defect, 1 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Optional

import ddpstate
from ddpstate.convert import convert_file
from tests.faults import _harness as h


@dataclasses.dataclass
class Config:
    """What to run, and how much of it."""

    crash_trials: int
    corrupt_per_format: int
    cli_per_format: int
    fuzz_cases: int
    write_failures: int
    rank_trials: int
    seed: int
    workdir: Path


def _rng(config: Config, name: str) -> random.Random:
    return random.Random(f"{config.seed}-{name}")


def _progress(name: str, done: int, total: int) -> None:
    if done % max(1, total // 10) == 0 or done == total:
        print(f"  {name}: {done}/{total}", file=sys.stderr, flush=True)


def crashes(config: Config) -> h.Tally:
    """SIGKILL at random delays and random os calls, spread over every kind of write."""
    tally = h.Tally()
    per_kind = math.ceil(config.crash_trials / len(h.CRASH_KINDS))
    for kind in h.CRASH_KINDS:
        cal = h.calibrate_crash(kind, config.workdir / "crash-calibrate")
        rng = _rng(config, f"crash-{kind}")
        for i in range(per_kind):
            trial = h.crash_trial(kind, config.workdir / "crash", rng, cal)
            tally.add(trial)
            if trial.verdicts.get("killed") == "mid-write":
                tally.outcomes[f"{kind}: killed mid-write"] += 1
            _progress(f"crash {kind}", i + 1, per_kind)
    return tally


def corrupt(config: Config, fmt: str) -> h.Tally:
    """Random truncations and bit flips of one format, through every operation."""
    tally = h.Tally()
    original = h.make_original(fmt, config.workdir / f"original-{fmt}", seed=7)
    rng = _rng(config, f"corrupt-{fmt}")
    for i in range(config.corrupt_per_format):
        tally.add(h.corrupt_trial(original, config.workdir / f"corrupt-{fmt}", rng))
        _progress(f"corrupt {fmt}", i + 1, config.corrupt_per_format)
    return tally


def corrupt_cli(config: Config) -> h.Tally:
    """A sample of damaged files through the installed `ddpstate` command."""
    tally = h.Tally()
    for fmt in h.FORMATS:
        original = h.make_original(fmt, config.workdir / f"cli-original-{fmt}", seed=7)
        rng = _rng(config, f"cli-{fmt}")
        for i in range(config.cli_per_format):
            for result in h.cli_corrupt_trial(original, config.workdir / f"cli-{fmt}", rng):
                tally.add_cli(result)
            _progress(f"cli {fmt}", i + 1, config.cli_per_format)
    return tally


def fuzz(config: Config) -> h.Tally:
    """Generated safetensors headers, torch zip/pickle structures and mutated legacy files,
    plus the 1 TiB claims."""
    tally = h.Tally()
    kinds = sorted(h.FUZZERS)
    per_kind = math.ceil(config.fuzz_cases / len(kinds))
    for kind in kinds:
        rng = _rng(config, f"fuzz-{kind}")
        for i in range(per_kind):
            trial = h.fuzz_case(kind, rng, config.workdir / "fuzz")
            tally.add(trial)
            _progress(f"fuzz {kind}", i + 1, per_kind)
    for maker, suffix in ((h.huge_safetensors, ".safetensors"), (h.huge_torch_zip, ".pt")):
        src = config.workdir / f"huge{suffix}"
        maker(src)
        trial = h.Trial("fuzz", f"1 TiB claim{suffix}", "generated", 0)
        ops: list[tuple[str, Callable[[], Any]]] = [
            ("load", lambda: ddpstate.load(str(src), map_location="cpu")),  # noqa: B023
            ("convert", lambda: convert_file(str(src), f"{src}.out", overwrite=True)),  # noqa: B023
        ]
        for op, fn in ops:
            res = h.run_op(fn)
            trial.note(op, res)
            trial.verdicts[f"1 TiB claim {op}"] = res.kind
            if res.kind != "refused" or res.rss_growth > 64 << 20:
                trial.defects.append(f"{op}: {res.kind}, RSS +{res.rss_growth >> 20} MiB")
        tally.add(trial)
    return tally


def write_failures(config: Config) -> h.Tally:
    """Saves failing at random bytes (ENOSPC, EIO), on close/fsync, rename, and real EFBIG."""
    tally = h.Tally()
    rng = _rng(config, "write-failures")
    for i in range(config.write_failures):
        tally.add(h.write_failure_trial(rng, config.workdir / "write-failure"))
        _progress("write failures", i + 1, config.write_failures)
    return tally


def malicious(config: Config) -> h.Tally:
    """Every payload in every container, through the API and all four commands."""
    tally = h.Tally()
    for container in h.MALICIOUS_CONTAINERS:
        for name in sorted(h.malicious_payloads(Path("m"))):
            tally.add(h.malicious_trial(container, name, config.workdir / f"mal-{container}"))
    return tally


def lost_ranks(config: Config) -> h.Tally:
    """Lost and late ranks on real gloo groups, cycling through save, load and restore."""
    tally = h.Tally()
    for i in range(config.rank_trials):
        op = h.LOST_RANK_OPS[i % len(h.LOST_RANK_OPS)]
        folder = config.workdir / f"ranks-{i}"
        tally.add(h.lost_rank_trial(op, folder, timeout=2.0))
        shutil.rmtree(folder, ignore_errors=True)
        _progress("lost ranks", i + 1, config.rank_trials)
    return tally


def _isolated(
    name: str, fn: Callable[[], h.Tally], workdir: Path, limit: float = 900.0
) -> dict[str, Any]:
    """Run one category in a forked worker; a worker that dies or runs past ``limit``
    seconds is a defect, not the end of the campaign."""
    out = workdir / ("result-" + "".join(c if c.isalnum() else "-" for c in name) + ".json")
    started = time.monotonic()

    def body() -> None:
        try:
            tally = fn()
            # Not dataclasses.asdict: it rebuilds a Counter from (key, value) pairs.
            data = {f.name: getattr(tally, f.name) for f in dataclasses.fields(tally)}
            data["outcomes"] = dict(tally.outcomes)
        except BaseException:
            data = {"trials": 0, "unhandled": 1, "examples": [traceback.format_exc()]}
        try:
            out.write_text(json.dumps(data, default=str))
        except BaseException:
            traceback.print_exc()
            raise

    pid = h._fork(body)
    status = h._wait(pid, limit)
    seconds = time.monotonic() - started
    if status is None:  # stuck where SIGALRM cannot reach (inside C code)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return {
            "trials": 0,
            "data_lost": 0,
            "hangs": 1,
            "unhandled": 0,
            "other": 0,
            "outcomes": {},
            "examples": [f"the worker was still running after {limit:.0f} s and was killed"],
            "seconds": seconds,
        }
    if not out.exists():
        return {
            "trials": 0,
            "data_lost": 0,
            "hangs": 0,
            "unhandled": 1,
            "other": 0,
            "outcomes": {},
            "examples": [f"the worker died: wait status {status}"],
            "seconds": seconds,
        }
    data: dict[str, Any] = json.loads(out.read_text())
    data["seconds"] = seconds
    return data


def _table(results: dict[str, dict[str, Any]]) -> str:
    head = ("category", "trials", "data lost", "hangs", "unhandled", "other defects", "seconds")
    rows: list[tuple[str, ...]] = [head]
    for name, r in results.items():
        rows.append(
            (
                name,
                str(r.get("trials", 0)),
                str(r.get("data_lost", 0)),
                str(r.get("hangs", 0)),
                str(r.get("unhandled", 0)),
                str(r.get("other", 0)),
                f"{r.get('seconds', 0.0):.0f}",
            )
        )
    total = [sum(int(row[i]) for row in rows[1:]) for i in range(1, 6)]
    rows.append(("total", *map(str, total), f"{sum(r['seconds'] for r in results.values()):.0f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = []
    for i, row in enumerate(rows):
        numbers = [c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)]
        cells = [row[0].ljust(widths[0]), *numbers]
        lines.append("| " + " | ".join(cells) + " |")
        if i == 0:
            lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parse the options, run every category, print the table and outcome counts."""
    parser = argparse.ArgumentParser(prog="python -m tests.faults.campaign", description=__doc__)
    parser.add_argument("--crash-trials", type=int, default=200)
    parser.add_argument("--corrupt-per-format", type=int, default=500)
    parser.add_argument(
        "--cli-per-format",
        type=int,
        default=25,
        help="damaged files per format run through the console script (4 commands; 1 for a folder)",
    )
    parser.add_argument("--fuzz-cases", type=int, default=1000)
    parser.add_argument("--write-failures", type=int, default=100)
    parser.add_argument(
        "--rank-trials",
        type=int,
        default=3,
        help="lost/late rank trials (cycling save, load, restore; ~10 s each)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write every count and example here")
    parser.add_argument("--workdir", type=Path, help="scratch folder (default: a temp dir)")
    args = parser.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="ddpstate-faults-"))
    workdir.mkdir(parents=True, exist_ok=True)
    config = Config(
        crash_trials=args.crash_trials,
        corrupt_per_format=args.corrupt_per_format,
        cli_per_format=args.cli_per_format,
        fuzz_cases=args.fuzz_cases,
        write_failures=args.write_failures,
        rank_trials=args.rank_trials,
        seed=args.seed,
        workdir=workdir,
    )
    categories: list[tuple[str, Callable[[], h.Tally]]] = [
        ("crash (SIGKILL)", lambda: crashes(config)),
        *[(f"corrupt {fmt}", lambda fmt=fmt: corrupt(config, fmt)) for fmt in h.FORMATS],
        ("corrupt via CLI", lambda: corrupt_cli(config)),
        ("fuzz", lambda: fuzz(config)),
        ("write failures", lambda: write_failures(config)),
        ("malicious pickles", lambda: malicious(config)),
        ("lost/late ranks", lambda: lost_ranks(config)),
    ]
    started = time.monotonic()
    results: dict[str, dict[str, Any]] = {}
    for name, fn in categories:
        print(f"{name} ...", file=sys.stderr, flush=True)
        results[name] = _isolated(name, fn, workdir)
    table = _table(results)
    print(table)
    for name, r in results.items():
        print(f"\n{name}:")
        for outcome, count in sorted(r.get("outcomes", {}).items()):
            print(f"  {count:6d}  {outcome}")
        if r.get("max_seconds"):
            print(f"  longest wait for a BarrierTimeoutError: {r['max_seconds']:.2f} s")
        if r.get("max_rss_growth"):
            print(f"  largest RSS growth of one operation: {r['max_rss_growth'] / 2**20:.1f} MiB")
        for example in r.get("examples", []):
            print(f"  DEFECT: {example}")
    defects = sum(
        r.get(k, 0) for r in results.values() for k in ("data_lost", "hangs", "unhandled", "other")
    )
    print(f"\n{time.monotonic() - started:.0f} s; defects: {defects}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "command": " ".join([parser.prog, *(argv or sys.argv[1:])]),
                    "config": {k: str(v) for k, v in dataclasses.asdict(config).items()},
                    "results": results,
                    "table": table,
                    "defects": defects,
                },
                indent=2,
                default=str,
            )
        )
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if defects == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
