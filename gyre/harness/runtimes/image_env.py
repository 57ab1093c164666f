"""The ``ENV`` of an image unpacked to a root file system, for runtimes that do not apply it
themselves (bubblewrap on ``apptainer build --sandbox`` output).

Apptainer writes the OCI config's ``Env`` into ``/.singularity.d/env/10-docker2singularity.sh``
as ``export NAME="VALUE"`` (older builds) or ``export NAME="${NAME:-"VALUE"}"`` (newer), VALUE
shell-escaped (backslash, double quote, backtick, dollar). Parsed here, never sourced: the file
comes from the image and must not run on the host. Lines of other shapes are skipped.
"""

from __future__ import annotations

import re
from pathlib import Path

SCRIPT = ".singularity.d/env/10-docker2singularity.sh"
_PLAIN = re.compile(r'^export ([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"\s*$')
_DEFAULTED = re.compile(r'^export ([A-Za-z_][A-Za-z0-9_]*)="\$\{\1:-"((?:[^"\\]|\\.)*)"\}"\s*$')
_UNESCAPE = re.compile(r'\\([\\"`$])')


def image_environment(rootfs: str | Path) -> dict[str, str]:
    """NAME -> VALUE of the image's ENV; empty when the root has no such file."""
    path = Path(rootfs) / SCRIPT
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        m = _DEFAULTED.match(line) or _PLAIN.match(line)
        if m:
            out[m.group(1)] = _UNESCAPE.sub(r"\1", m.group(2))
    return out
