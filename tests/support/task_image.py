"""A small NL2RepoBench-shaped task image, built offline from files already on this machine.

The root filesystem holds Debian's own Python (``/usr/bin/python3.11`` from the python3.11
package, its standard library and the shared libraries its modules link), pytest and its
pure-Python dependencies copied from Gyre's environment, ``/bin/sh``, and ``/workspace`` with the
task's hidden tests, as the benchmark's images have them. Files are hard-linked where the cache
shares a file system with /usr (fast; the rootfs is only ever mounted read-only), else copied.

The result is an unpacked image root filesystem (Apptainer's sandbox format minus its metadata),
which the bwrap runtime runs; ``apptainer build x.sif DIR`` or ``mksquashfs DIR x.sqsh`` would turn
it into the other runtimes' formats. Built once per cache key under ``$GYRE_TEST_IMAGE_CACHE``
(default: the system temp dir).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PYTHON = "/usr/bin/python3.11"
STDLIB = Path("/usr/lib/python3.11")
_SKIP_STDLIB = {"test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "pydoc_data",
                "config-3.11-x86_64-linux-gnu", "__pycache__", "site-packages", "dist-packages"}
PYTEST_PACKAGES = ("pytest", "_pytest", "pluggy", "iniconfig", "packaging", "pygments", "py")

MINI_TESTS = '''\
from mini import add, sub, mul, div


def test_add():
    assert add(2, 3) == 5


def test_sub():
    assert sub(5, 3) == 2


def test_mul():
    assert mul(4, 3) == 12


def test_div():
    assert div(8, 2) == 4
'''


def available() -> str | None:
    """Why the test image cannot be built here, or None."""
    if not Path(PYTHON).exists() or not STDLIB.is_dir():
        return f"{PYTHON} (Debian's python3.11) is not installed"
    if shutil.which("ldd") is None:
        return "ldd is not installed"
    return None


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _put(root: Path, host_path: str) -> None:
    """Host file at the same path under root (symlinks in its path resolved)."""
    real = os.path.realpath(host_path)
    for p in {host_path, real}:
        target = root / p.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.exists():
            _link_or_copy(real, str(target))


def _libs(binaries: list[str]) -> set[str]:
    out = subprocess.run(["ldd", *binaries], capture_output=True, text=True).stdout
    return set(re.findall(r"(/\S+\.so[^\s:]*)", out))


def _build(root: Path, hidden_tests: dict[str, str]) -> None:
    for d in ("usr/bin", "usr/lib", "usr/lib64", "usr/sbin", "etc", "tmp", "workspace"):
        (root / d).mkdir(parents=True, exist_ok=True)
    for link, target in (("bin", "usr/bin"), ("lib", "usr/lib"), ("lib64", "usr/lib64"), ("sbin", "usr/sbin")):
        os.symlink(target, root / link)
    # the interpreter, its standard library, and every library its binaries link
    shutil.copytree(STDLIB, root / "usr/lib/python3.11", copy_function=_link_or_copy,
                    ignore=lambda d, names: [n for n in names if n in _SKIP_STDLIB or n.endswith(".pyc")])
    dynload = [str(p) for p in (STDLIB / "lib-dynload").glob("*.so")]
    sh = os.path.realpath("/bin/sh")
    for lib in sorted(_libs([PYTHON, sh, *dynload])):
        _put(root, lib)
    _link_or_copy(PYTHON, str(root / "usr/bin/python3.11"))
    os.symlink("python3.11", root / "usr/bin/python3")
    os.symlink("python3", root / "usr/bin/python")
    _link_or_copy(sh, str(root / "usr/bin/sh"))
    # pytest, pure Python, from Gyre's own environment
    site = root / "usr/lib/python3/dist-packages"
    site.mkdir(parents=True)
    for name in PYTEST_PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            continue
        origin = Path(spec.origin)
        if origin.name == "__init__.py":
            shutil.copytree(origin.parent, site / name, copy_function=_link_or_copy,
                            ignore=shutil.ignore_patterns("__pycache__"))
        else:
            _link_or_copy(str(origin), str(site / origin.name))
        try:  # the dist-info too: pytest reads its plugins' metadata
            info = Path(importlib.metadata.distribution(name)._path)
            shutil.copytree(info, site / info.name, copy_function=_link_or_copy)
        except (importlib.metadata.PackageNotFoundError, AttributeError, FileExistsError):
            pass
    (root / "usr/bin/pytest").write_text("#!/usr/bin/python3\nimport sys\nfrom pytest import console_main\n"
                                         "sys.exit(console_main())\n")
    os.chmod(root / "usr/bin/pytest", 0o755)
    (root / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000::/tmp:/bin/sh\n")
    # the image's /workspace: the hidden tests (and a file of the original repository)
    for rel, text in hidden_tests.items():
        p = root / "workspace" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    (root / "workspace" / "README.md").write_text("the original repository's readme\n")


def build_image_dir(task: str = "mini", hidden_tests: dict[str, str] | None = None,
                    cache: str | os.PathLike | None = None) -> Path:
    """``<image_dir>/<task>/`` holding the root filesystem; returns image_dir."""
    hidden = hidden_tests or {"tests/test_mini.py": MINI_TESTS}
    key = hashlib.sha256(repr((sorted(hidden.items()), Path(__file__).read_bytes(), sys.version)).encode()).hexdigest()[:12]
    base = Path(cache or os.environ.get("GYRE_TEST_IMAGE_CACHE") or tempfile.gettempdir()) / f"gyre-test-images-{key}"
    if (base / task / "usr/bin/python3").exists():
        return base
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=base.parent if base.parent.exists() else None))
    try:
        _build(tmp / task, hidden)
        os.chmod(tmp, 0o755)
        try:
            os.rename(tmp, base)
        except OSError:  # built by another process meanwhile
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return base


def nl2repo_suite(root: Path, task: str = "mini", count: int = 4) -> Path:
    """A suite shaped like the published repository: test_files/<task>/ with the four files and
    no tests (they are in the image)."""
    d = root / "test_files" / task
    d.mkdir(parents=True)
    (d / "start.md").write_text("Write mini.py with add, sub, mul and div.\n")
    (d / "test_commands.json").write_text('["pip install -e .", "pytest --continue-on-collection-errors tests"]')
    (d / "test_case_count.txt").write_text(f"{count}\n")
    (d / "test_files.json").write_text('["tests"]')
    return root


if __name__ == "__main__":
    print(build_image_dir())
