#!/usr/bin/env python3
"""``make test-compat``: the conformance suite and a smoke subset against every torch release of
tools/compat/releases.txt, each in a venv of its own, as users install torch from the registry;
and against the other Pythons of tools/compat/pythons.txt, each with the torch release it names.

One venv per release lives outside the checkout, in ``$AIOLOAD_COMPAT_DIR`` (default
``~/.cache/aioload-compat``), as ``torch-<release>``. A venv whose stamp file matches what it
should hold (the release, the constraints, the lock, the Python) is reused as it is; any other is
(re)installed in place, so an interrupted install is resumed, not redone. aioload is not
installed there: the tests run with ``PYTHONPATH=<checkout>``.

The machine-wide pip configuration (a cap on torch's version) is lifted for these venvs only
(``PIP_CONFIG_FILE=/dev/null``); the machine's local package folders are added back as extra
indexes where they exist. Every package is pinned: the test libraries and torch's open-ended
requirements by tools/compat/constraints.txt, what each torch release pins for itself (CUDA
libraries, triton, sympy) by tools/compat/locks/torch-<release>.txt, written from the first
install of a release that has none (commit it).

Usage: tools/compat/matrix.py [--jobs N] [--release R ...] [--install-only] [--relock]
       [-- extra pytest arguments]
Environment: AIOLOAD_COMPAT_DIR, AIOLOAD_COMPAT_JOBS (releases at once, default 2),
AIOLOAD_COMPAT_RELEASES (a space-separated subset).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
RELEASES = HERE / "releases.txt"
PYTHONS = HERE / "pythons.txt"
SMOKE = HERE / "smoke.txt"
CONSTRAINTS = HERE / "constraints.txt"
LOCKS = HERE / "locks"
STAMP = ".aioload-compat-stamp"
# The test libraries every matrix venv holds (their versions: constraints.txt).
TEST_DEPS = [
    "pytest",
    "pytest-asyncio",
    "pytest-timeout",
    "trio",
    "psutil",
    "httpx",
    "numpy",
    "anyio",
    "uvloop",
    "tqdm",
]
# Where the machine keeps packages on disk; used as extra indexes / find-links where present.
LOCAL_INDEXES = ["/opt/pypi/simple", "/opt/pypi-more/simple"]
LOCAL_WHEELS = ["/opt/wheels"]
INSTALL_TIMEOUT_S = 3600
TEST_TIMEOUT_S = 1800
_print_lock = threading.Lock()


def say(*parts: object) -> None:
    with _print_lock:
        print(*parts, flush=True)


def listed(path: Path) -> list[str]:
    """The non-comment words of a list file, one entry per line."""
    entries = []
    for line in path.read_text().splitlines():
        entry = line.split("#", 1)[0].strip()
        if entry:
            entries.append(entry)
    return entries


def find_python(version: str) -> str:
    """The interpreter of Python ``version`` (``3.12``): pyenv's build of it where pyenv has one
    (the machine images keep theirs there), else ``python<version>`` on the PATH."""
    roots = [os.environ.get("PYENV_ROOT", ""), str(Path.home() / ".pyenv")]
    for root in filter(None, roots):
        builds = sorted(Path(root, "versions").glob(f"{version}.*/bin/python{version}"))
        if builds:
            return str(builds[-1])
    found = shutil.which(f"python{version}")
    if found is None:
        raise FileNotFoundError(f"no Python {version} here (pythons.txt asks for it)")
    return found


def matrix_entries() -> list[str]:
    """releases.txt's releases under this Python, then pythons.txt's (``VERSION RELEASE`` lines)
    as ``RELEASE@VERSION``."""
    entries = listed(RELEASES)
    for line in listed(PYTHONS):
        version, release = line.split()
        entries.append(f"{release}@{version}")
    return entries


def compat_dir() -> Path:
    configured = os.environ.get("AIOLOAD_COMPAT_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "aioload-compat"


@dataclass
class Result:
    release: str
    build: str = "?"
    venv: str = "?"  # warm, installed, or failed
    install_s: float = 0.0
    test_s: float = 0.0
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    error: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.error and self.failed == 0 and self.passed > 0


class Release:
    """One entry of the matrix: a torch release (``2.13.0``), or a torch release under another
    Python (``2.13.0@3.12``, from pythons.txt), each in a venv of its own."""

    def __init__(self, release: str, base: Path) -> None:
        self.release = release
        self.torch, _, self.python_version = release.partition("@")
        self.venv = base / f"torch-{release}"
        self.python = self.venv / "bin" / "python"
        self.lock = LOCKS / f"torch-{release}.txt"
        self.logs = base / "logs"

    @property
    def requirement(self) -> str:
        return f"torch=={self.torch}"

    def interpreter(self) -> str:
        """The Python the venv is made with: this one, or the named version's."""
        return find_python(self.python_version) if self.python_version else sys.executable

    def wanted_stamp(self) -> str:
        digest = hashlib.sha256()
        digest.update(CONSTRAINTS.read_bytes())
        if self.lock.exists():
            digest.update(self.lock.read_bytes())
        return json.dumps(
            {
                "requirement": self.requirement,
                "test_deps": TEST_DEPS,
                "pins": digest.hexdigest(),
                "python": self.python_version or sys.version.split()[0],
            },
            sort_keys=True,
        )

    def is_complete(self) -> bool:
        stamp = self.venv / STAMP
        return self.python.exists() and stamp.exists() and stamp.read_text() == self.wanted_stamp()


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """One process at a time builds a venv (two CI runs on one machine, say)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def pip_env() -> dict[str, str]:
    """The environment of the matrix venvs' pip: the machine's pip configuration (and its cap on
    torch's version) lifted; the pip cache left where it is, so that it is kept between runs."""
    env = dict(os.environ)
    env["PIP_CONFIG_FILE"] = os.devnull
    for name in ("PIP_CONSTRAINT", "PIP_BUILD_CONSTRAINT", "PIP_REQUIRE_VIRTUALENV"):
        env.pop(name, None)
    env.setdefault("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    return env


def pip_sources() -> list[str]:
    args = []
    for index in LOCAL_INDEXES:
        if Path(index).is_dir():
            args += ["--extra-index-url", f"file://{index}"]
    already = os.environ.get("PIP_FIND_LINKS", "").split()
    for wheels in LOCAL_WHEELS:
        if Path(wheels).is_dir() and wheels not in already:
            args += ["--find-links", wheels]
    return args


def run_logged(cmd: list[str], log: Path, timeout: float, env: dict[str, str]) -> int:
    """Run ``cmd`` with its output appended to ``log``; its whole process group is ended if it
    outlives ``timeout``."""
    with log.open("a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        process = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=ROOT,
            start_new_session=True,
        )
        try:
            return process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            out.write(f"\n[matrix] killed after {timeout:.0f} s\n")
            return 124
        except BaseException:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            raise


def ensure_venv(rel: Release, result: Result, relock: bool) -> bool:
    log = rel.logs / f"install-{rel.release}.log"
    with locked(rel.venv.parent / f".torch-{rel.release}.lock"):
        if rel.is_complete() and not relock:
            result.venv = "warm"
            return True
        started = time.monotonic()
        log.write_text("")
        env = pip_env()
        if not rel.python.exists():
            say(f"[{rel.release}] creating {rel.venv}")
            code = run_logged([rel.interpreter(), "-m", "venv", str(rel.venv)], log, 300, env)
            if code != 0:
                result.error = f"venv creation failed (see {log})"
                return False
        (rel.venv / STAMP).unlink(missing_ok=True)
        say(f"[{rel.release}] installing {rel.requirement} and the test libraries (log: {log})")
        pins = ["-c", str(CONSTRAINTS)]
        if rel.lock.exists() and not relock:
            pins += ["-c", str(rel.lock)]
        cmd = [str(rel.python), "-m", "pip", "install", "--progress-bar", "off"]
        cmd += [*pip_sources(), *pins, rel.requirement, *TEST_DEPS]
        code = run_logged(cmd, log, INSTALL_TIMEOUT_S, env)
        if code != 0:
            result.venv = "failed"
            result.error = f"pip install failed with {code} (see {log})"
            return False
        if relock or not rel.lock.exists():
            write_lock(rel, env)
            result.notes.append(f"wrote {rel.lock.relative_to(ROOT)}: commit it")
        (rel.venv / STAMP).write_text(rel.wanted_stamp())
        result.venv = "installed"
        result.install_s = time.monotonic() - started
        return True


def write_lock(rel: Release, env: dict[str, str]) -> None:
    """What this release's install holds beyond constraints.txt: torch and what it pins."""
    frozen = subprocess.run(
        [str(rel.python), "-m", "pip", "freeze", "--all"],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    ).stdout.splitlines()
    shared = {_name(line) for line in listed(CONSTRAINTS)}
    own = [
        line
        for line in frozen
        if "==" in line and _name(line) not in shared and _name(line) not in {"pip"}
    ]
    LOCKS.mkdir(exist_ok=True)
    rel.lock.write_text(
        f"# What torch=={rel.torch} brings, as installed by tools/compat/matrix.py "
        "(--relock rewrites this).\n" + "\n".join(sorted(own, key=str.lower)) + "\n"
    )


def _name(requirement: str) -> str:
    return requirement.split("==", 1)[0].strip().lower().replace("_", "-")


def describe_build(rel: Release) -> str:
    """The installed torch's version and build (CUDA version, or cpu)."""
    probe = subprocess.run(
        [
            str(rel.python),
            "-c",
            "import torch; print(torch.__version__, torch.version.cuda or 'cpu')",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd="/",
    )
    if probe.returncode != 0:
        return "unimportable"
    version, cuda = probe.stdout.split()[-2:]
    return f"{version} ({'cpu' if cuda == 'cpu' else 'cuda ' + cuda})"


def private_shm_prefix() -> list[str]:
    """A command prefix that runs the tests with a /dev/shm of their own (a tmpfs in a mount
    namespace of their own), where the machine allows it (root, or user namespaces): the leak
    checks count the /dev/shm entries a test leaves behind, and two releases tested at once
    (or anything else on the machine) would otherwise see each other's. Empty where it cannot
    be had; the releases then run one at a time."""
    prefix = ["unshare", "--mount", "--propagation", "private", "sh", "-c"]
    script = 'mount -t tmpfs -o mode=1777 tmpfs /dev/shm && exec "$@"'
    try:
        probe = subprocess.run([*prefix, script, "sh", "true"], capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    return [*prefix, script, "sh"] if probe.returncode == 0 else []


def run_tests(
    rel: Release, result: Result, tests: list[str], extra: list[str], prefix: list[str]
) -> None:
    log = rel.logs / f"test-{rel.release}.log"
    junit = rel.logs / f"junit-{rel.release}.xml"
    log.write_text("")
    junit.unlink(missing_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT)
    env.pop("VIRTUAL_ENV", None)
    # The matrix venv's interpreter first, for the tests that start `python` by name.
    env["PATH"] = f"{rel.venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    cmd = [*prefix, str(rel.python), "-m", "pytest", *tests, "-q", "-p", "no:cacheprovider"]
    cmd += [f"--junitxml={junit}", *extra]
    started = time.monotonic()
    code = run_logged(cmd, log, TEST_TIMEOUT_S, env)
    result.test_s = time.monotonic() - started
    try:
        suite = ElementTree.parse(junit).getroot()
        suites = [suite] if suite.tag == "testsuite" else list(suite.iter("testsuite"))
        total = sum(int(s.get("tests", 0)) for s in suites)
        failed = sum(int(s.get("failures", 0)) + int(s.get("errors", 0)) for s in suites)
        skipped = sum(int(s.get("skipped", 0)) for s in suites)
        result.passed, result.failed, result.skipped = total - failed - skipped, failed, skipped
    except (OSError, ElementTree.ParseError):
        result.error = f"pytest exited {code} without a report (see {log})"
        return
    if code not in (0, 1):
        result.error = f"pytest exited {code} (see {log})"
    if not result.ok:
        say(f"[{rel.release}] FAILED; the end of {log}:\n{_summary(log)}")


def _summary(log: Path) -> str:
    """pytest's short summary (or the log's last lines)."""
    lines = log.read_text(errors="replace").splitlines()
    for i, line in enumerate(lines):
        if "short test summary info" in line:
            return "\n".join(lines[i:])[-6000:]
    return "\n".join(lines[-60:])


def one(
    release: str,
    base: Path,
    tests: list[str],
    extra: list[str],
    args: argparse.Namespace,
    prefix: list[str],
) -> Result:
    rel = Release(release, base)
    rel.logs.mkdir(parents=True, exist_ok=True)
    result = Result(release)
    try:
        if not ensure_venv(rel, result, args.relock):
            say(f"[{release}] {result.error}")
            return result
        result.build = describe_build(rel)
        if args.install_only:
            say(f"[{release}] venv {result.venv}: torch {result.build}")
            return result
        say(f"[{release}] testing torch {result.build} (venv {result.venv})")
        run_tests(rel, result, tests, extra, prefix)
    except Exception as exc:  # reported in the table, and the run fails
        result.error = f"{type(exc).__name__}: {exc}"
    say(f"[{release}] {_line(result)}")
    return result


def _line(result: Result) -> str:
    if result.error and not result.passed:
        return f"ERROR: {result.error}"
    text = f"{result.passed} passed, {result.failed} failed, {result.skipped} skipped"
    text += f" in {result.test_s:.0f} s"
    if result.venv == "installed":
        text += f" (installed in {result.install_s:.0f} s)"
    if result.error:
        text += f"; {result.error}"
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=int(os.environ.get("AIOLOAD_COMPAT_JOBS", 2)))
    parser.add_argument("--release", action="append", help="only these releases (repeatable)")
    parser.add_argument("--install-only", action="store_true", help="build the venvs, run nothing")
    parser.add_argument("--relock", action="store_true", help="reinstall and rewrite the locks")
    parser.add_argument("pytest_args", nargs="*", help="after --: extra pytest arguments")
    args = parser.parse_args()

    releases = matrix_entries()
    chosen = args.release or os.environ.get("AIOLOAD_COMPAT_RELEASES", "").split()
    if chosen:
        unknown = sorted(set(chosen) - set(releases))
        if unknown:
            parser.error(f"not in the matrix: {' '.join(unknown)}")
        releases = [r for r in releases if r in chosen]
    tests = ["tests/conformance", *listed(SMOKE)]
    base = compat_dir()
    prefix = [] if args.install_only else private_shm_prefix()
    jobs = max(1, args.jobs)
    if not prefix and not args.install_only and jobs > 1:
        say("no private /dev/shm here (unshare --mount refused): one release at a time")
        jobs = 1
    say(f"torch matrix: {' '.join(releases)}; venvs in {base}; {jobs} at once")
    say(f"tests: {' '.join(tests)}")
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        results = list(
            pool.map(lambda r: one(r, base, tests, args.pytest_args, args, prefix), releases)
        )
    wall = time.monotonic() - started

    say("\ntorch[@python]     build                      venv       result")
    for result in results:
        say(f"{result.release:<18} {result.build:<26} {result.venv:<10} {_line(result)}")
        for note in result.notes:
            say(f"{'':<18} note: {note}")
    say(f"wall time: {wall:.0f} s")
    summary = compat_dir() / "logs" / "summary.json"
    summary.write_text(
        json.dumps({"wall_s": wall, "results": [vars(r) for r in results]}, indent=2)
    )
    if args.install_only:
        return 0 if all(not r.error for r in results) else 1
    passed = sum(r.passed for r in results)
    failed = sum(r.failed for r in results) + sum(1 for r in results if r.error)
    skipped = sum(r.skipped for r in results)
    say(f"compat: {passed} passed, {failed} failed, {skipped} skipped")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
