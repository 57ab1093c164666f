"""Process helpers shared by the harness runner and the evaluator: the environment a child sees,
resource limits, and killing a whole process group."""

from __future__ import annotations

import os
import signal
import sys
from typing import Iterable, Mapping

from gyre.config import env as config_env

# Applied in the child between fork and exec by a tiny interpreter rather than a ``preexec_fn``:
# preexec_fn runs Python in a forked copy of a multi-threaded process (the head runs asyncio plus
# thread pools) and can deadlock on a lock some other thread held at fork time.
_LIMIT_CODE = (
    "import os, resource, sys\n"
    "for name, value in zip(('RLIMIT_CPU', 'RLIMIT_AS', 'RLIMIT_FSIZE'), map(int, sys.argv[1:4])):\n"
    "    if value > 0:\n"
    # CPU: SIGXCPU at the soft limit names the cause; SIGKILL 5 s later if it is ignored.
    "        hard = value + 5 if name == 'RLIMIT_CPU' else value\n"
    "        resource.setrlimit(getattr(resource, name), (value, hard))\n"
    "try:\n"
    "    os.execvp(sys.argv[4], sys.argv[4:])\n"
    "except OSError as e:\n"
    "    sys.stderr.write(f'gyre: cannot run {sys.argv[4]!r}: {e}\\n')\n"
    "    sys.exit(127)\n"
)


def with_limits(argv: list[str], *, cpu_s: int = 0, memory_mb: int = 0, fsize_mb: int = 0) -> list[str]:
    """``argv`` wrapped so that it runs under the given rlimits (0 = no limit); unchanged if none.
    The wrapper execs the command, so the pid (and the process group) stay the same."""
    if not (cpu_s or memory_mb or fsize_mb):
        return list(argv)
    return [sys.executable, "-S", "-c", _LIMIT_CODE, str(int(cpu_s)), str(int(memory_mb) << 20),
            str(int(fsize_mb) << 20), *argv]


def child_env(pass_env: Iterable[str], extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Only the named variables of Gyre's own environment, plus ``extra``: a harness must not
    inherit the job's secrets or Gyre's settings."""
    out = {}
    for name in pass_env:
        value = config_env(name)
        if value is not None:
            out[name] = value
    out.update(extra or {})
    return out


def parse_env_list(items: Iterable[str]) -> dict[str, str]:
    """``["K=V", ...]`` from the configuration into a dict, with a clear error."""
    out = {}
    for item in items:
        key, sep, value = str(item).partition("=")
        if not sep or not key:
            raise ValueError(f"harness.env: {item!r} is not KEY=VALUE")
        out[key] = value
    return out


def kill_group(pgid: int, sig: int = signal.SIGKILL) -> bool:
    """Signal every process of a group; False when the group is already gone."""
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # a member changed user (setuid); nothing more we may do
        return False


def signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"
