"""What a harness and an evaluation may see, and in which runtime they run.

A task whose image is found locally runs in that image (its harness and its evaluation, each a
fresh instance); every other task runs on the host root inside bubblewrap (``harness.sandbox =
"auto"`` uses it where ``bwrap`` exists; ``"none"`` is an explicit opt-out that warns).

Inside, a harness sees (paths inside the instance):

    /workspace          its own workspace (read-write)
    /task               the public copy of its task (start.md, commands, counts; no tests)
    /gyre-lib           the harness scripts shipped with Gyre (reference and answer agents) and
                        this launcher, copied alone: not the gyre package, whose builtin suites
                        hold hidden tests
    system directories  read-only (host: /usr, a few files of /etc, the Python prefix and venv;
                        image: its own root)

and nothing else: not other workspaces, not the run directory, not /root or /home, not other
processes (own pid namespace), not the engine key (a private file in the host's /tmp; the
instance has its own /tmp). The network is the instance's own loopback; the proxy is reached
through a Unix socket mounted into it and relayed to 127.0.0.1:PORT inside, so the harness's
OPENAI_BASE_URL keeps its shape. Mount, pid, user, ipc and uts namespaces hold as root too: none
of it rests on file modes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from gyre.config import ConfigError, ImageRuntime, Sandbox, env as config_env
from gyre.harness.limits import kernel_counts_per_namespace, kernel_process_cap
from gyre.harness.runtimes import ImageRef, Instance, Launch, Mount, Runtime, get_runtime
from gyre.harness.runtimes.image_env import image_environment

log = logging.getLogger(__name__)

# top-level paths: an image's own folders are read-only, so mount points are made at the root
WORKSPACE, TASK, LIB, OUT = "/workspace", "/task", "/gyre-lib", "/gyre-out"
SOCKET = "/run/gyre/proxy.sock"
INIT = f"{LIB}/gyre_sandbox_init.py"
_LIB_FILES = ("reference_agent.py", "answer_agent.py")  # stdlib-only harnesses shipped with Gyre
# A container client's own settings (never APPTAINERENV_* & co., which would reach inside).
_CLIENT_ENV = ("PATH", "HOME", "USER", "LOGNAME", "XDG_RUNTIME_DIR", "TMPDIR", "LANG",
               "APPTAINER_CACHEDIR", "APPTAINER_TMPDIR", "APPTAINER_CONFIGDIR", "SINGULARITY_CACHEDIR",
               "SINGULARITY_TMPDIR", "ENROOT_DATA_PATH", "ENROOT_RUNTIME_PATH", "ENROOT_CACHE_PATH",
               "ENROOT_CONFIG_PATH", "ENROOT_TEMP_PATH", "CONTAINERS_CONF", "CONTAINERS_STORAGE_CONF",
               "DOCKER_HOST", "DOCKER_CONFIG")
_AUTO_ORDER = ("bwrap", "apptainer", "singularity", "enroot")  # file-based images, found in image_dir


_IGNORE_TERM = ("import os, signal, sys\n"
                "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                "os.execv(sys.argv[1], sys.argv[1:])\n")


class SandboxError(ConfigError):
    """A sandbox or runtime that was asked for cannot be used; the message says how to fix it."""


class UnsandboxedWarning(UserWarning):
    pass


class UnboundedWarning(UserWarning):
    """A node limit asked for in [harness] that the chosen runtime cannot hold."""


@dataclass(frozen=True)
class SandboxConfig:
    sandbox: str = "auto"        # tasks without an image: auto (bwrap where it exists) | bwrap | none
    runtime: str = "auto"        # images: auto (by file in image_dir) | bwrap | apptainer | singularity | enroot | podman | docker
    image_dir: str = ""          # where SIF / squashfs / unpacked rootfs images live
    image_python: str = "python3"  # the interpreter inside task images (runs the launcher)
    network: str = "proxy"       # proxy: loopback + the proxy socket | host: the host's network
    binds: tuple = ()            # extra read-only host paths "SRC[:DST]" a harness needs (its venv)
    tmpfs_mb: int = 0            # size of the instance's /tmp and of its /dev/shm (bwrap); 0 = unsized

    @classmethod
    def from_config(cls, h) -> "SandboxConfig":
        return cls(sandbox=h.sandbox, runtime=h.runtime, image_dir=h.image_dir,
                   image_python=h.image_python, network=h.sandbox_network, binds=tuple(h.sandbox_binds),
                   tmpfs_mb=h.tmpfs_mb)


def host_user_namespace() -> str:
    """This process's user namespace (``user:[INODE]``): the launcher inside compares its own."""
    return os.readlink("/proc/self/ns/user")


def host_python() -> str:
    """Gyre's interpreter by its resolved folder: the sandbox binds resolved paths, so a
    virtualenv reached through a symlink (``.venv -> elsewhere/venv``) must be run as
    ``elsewhere/venv/bin/python`` there. Only the folder is resolved: the venv's ``python`` link
    itself leads to the base interpreter, which would run without the venv."""
    exe = Path(sys.executable)
    return str(exe.parent.resolve() / exe.name)


@dataclass(frozen=True)
class Placement:
    """Where one task runs here: in its image, on the host in a sandbox, or bare on the host."""
    kind: str                    # image | sandbox | host
    runtime: Runtime | None
    image: ImageRef | None
    scorable: bool
    reason: str | None           # why not scorable (or why not in its image)

    @property
    def label(self) -> str:
        if self.kind == "image":
            return f"{self.runtime.name}: {self.image.location}"
        return "bwrap (host root)" if self.kind == "sandbox" else "host (no sandbox)"


class Environments:
    """Decides each task's placement (cached) and builds its instances. Picklable (submitit)."""

    def __init__(self, config: SandboxConfig | None = None):
        self.config = config or SandboxConfig()
        c = self.config
        if c.runtime != ImageRuntime.AUTO:
            try:
                get_runtime(c.runtime)
            except ValueError as e:
                raise SandboxError(f"harness.runtime: {e}") from None
        if c.sandbox not in tuple(Sandbox):
            raise SandboxError(f"harness.sandbox: {c.sandbox!r}; use auto, bwrap or none")
        self._host: Runtime | None = None
        if c.sandbox != Sandbox.NONE:
            rt = get_runtime("bwrap")
            why = rt.missing()
            if why is None:
                self._host = rt
            elif c.sandbox == Sandbox.BWRAP:
                raise SandboxError(f"harness.sandbox = bwrap but {why}; install it (Debian: apt-get "
                                   f"install bubblewrap) or set harness.sandbox = none")
        if self._host is None:
            why = "harness.sandbox = none" if c.sandbox == Sandbox.NONE else "bubblewrap (bwrap) is not installed"
            warnings.warn(f"harnesses and task commands run WITHOUT a sandbox ({why}): they can read "
                          f"each other's workspaces, keys and the hidden tests", UnsandboxedWarning, stacklevel=2)
        self._places: dict[str, Placement] = {}
        self._lib: tuple[int, Path] | None = None
        self._warned: set[str] = set()

    @property
    def host_backend(self) -> str:
        return self._host.name if self._host else "none"

    def __getstate__(self):
        return {"config": self.config, "_host": self._host, "_places": self._places, "_lib": None,
                "_warned": set()}

    # -- placement ---------------------------------------------------------------------------
    def _runtimes(self) -> list[Runtime]:
        name = self.config.runtime
        if name != "auto":
            return [get_runtime(name)]
        return [get_runtime(n) for n in _AUTO_ORDER]

    def locate(self, task) -> tuple[ImageRef | None, Runtime | None, str]:
        """The task's image as a local artefact, the runtime that runs it, or why none."""
        reasons = []
        for rt in self._runtimes():
            ref, why = rt.locate(task.image, task.name, self.config.image_dir)
            if ref is None:
                reasons.append(why)
                continue
            missing = rt.missing()
            if missing is None:
                return ref, rt, ""
            reasons.append(f"{ref.location} found but {missing}")
        if self.config.runtime != ImageRuntime.AUTO or any(" found but " in r for r in reasons):
            return None, None, "; ".join(reasons)
        d, t = self.config.image_dir or "DIR", task.name
        where = (f"no {d}/{t}.sif, {d}/{t}.sqsh or unpacked {d}/{t}/" if self.config.image_dir
                 else "harness.image_dir is not set")
        return None, None, (f"{where} (e.g. `apptainer build {d}/{t}.sif docker://{task.image}`; "
                            f"see docs/tasks-and-sandboxes.md)")

    def host_place(self) -> Placement:
        """Where Gyre's own interpreter runs user code that belongs to no task image (a reward
        function, gyre.harness.reward): on the host root in bubblewrap, or bare under ``none``."""
        return Placement("sandbox" if self._host else "host", self._host, None, True, None)

    def place(self, task) -> Placement:
        p = self._places.get(task.name)
        if p is None:
            p = self._places[task.name] = self._place(task)
        return p

    def _place(self, task) -> Placement:
        why = None
        if task.image:
            ref, rt, why = self.locate(task)
            if ref is not None:
                return Placement("image", rt, ref, True, None)
        kind = "sandbox" if self._host else "host"
        if task.scorable:  # tests shipped with the suite: scored on the host root
            return Placement(kind, self._host, None, True, None)
        return Placement(kind, self._host, None, False,
                         f"needs image {task.image}: {why}" if task.image else "no tests and no image")

    # -- what goes inside --------------------------------------------------------------------
    def lib_dir(self) -> Path:
        """The harness scripts and the launcher, copied alone into a private folder (per process)."""
        if self._lib is None or self._lib[0] != os.getpid() or not self._lib[1].is_dir():
            d = Path(tempfile.mkdtemp(prefix="gyre-lib-"))
            here = Path(__file__).resolve().parent
            (d / "gyre" / "harness").mkdir(parents=True)
            (d / "gyre" / "__init__.py").write_text("")
            (d / "gyre" / "harness" / "__init__.py").write_text("")
            for name in _LIB_FILES:
                shutil.copyfile(here / name, d / "gyre" / "harness" / name)
            shutil.copyfile(here / "sandbox_init.py", d / "gyre_sandbox_init.py")
            os.chmod(d, 0o755)  # read by the uid the instance runs as
            self._lib = (os.getpid(), d)
        return self._lib[1]

    def _host_python_mounts(self) -> tuple[list[Mount], list[str]]:
        """The interpreter Gyre runs under (prefix and venv), read-only, with the gyre package and
        anything else private masked where it lies inside them."""
        roots = {Path(sys.base_prefix).resolve(), Path(sys.prefix).resolve(),
                 Path(os.path.realpath(sys.executable)).parent.parent}
        for b in self.config.binds:
            src = str(b).split(":", 1)[0]
            roots.add(Path(src).resolve())
        # /usr is mounted anyway; "/" (an interpreter installed there) would mount everything
        roots = {r for r in roots if not str(r).startswith("/usr/") and r not in (Path("/usr"), Path("/"))
                 and r.exists()}
        mounts = [Mount(str(r), str(r)) for r in sorted(roots)]
        for b in self.config.binds:  # an explicit destination (other than the source: "/x:/x" is "/x")
            src, _, dst = str(b).partition(":")
            resolved = str(Path(src).resolve())
            if dst and dst != resolved:
                mounts = [m for m in mounts if not (m.dst == resolved and m.src == m.dst)]
                mounts.append(Mount(resolved, dst))
        return mounts, []

    def masks(self, extra: list[Path]) -> list[str]:
        """Private host folders that lie inside a read-only system mount: hidden under a tmpfs."""
        import gyre  # the package folder itself (hidden from harnesses)
        private = [Path(gyre.__file__).resolve().parent, *[p.resolve() for p in extra]]
        mounts, _ = self._host_python_mounts()
        bound = [Path(m.src) for m in mounts] + [Path("/usr")]
        return sorted({str(p) for p in private if any(p != b and p.is_relative_to(b) for b in bound)})

    def _python_inside(self, place: Placement) -> str:
        return host_python() if place.kind != "image" else self.config.image_python

    # -- limits that bound the node ----------------------------------------------------------
    def unbounded(self, place: Placement, max_processes: int) -> list[str]:
        """The node limits asked for (``harness.tmpfs_mb``, ``max_processes``) that ``place``'s
        runtime cannot hold, each naming its key and the fix."""
        if place.kind == "host":  # no sandbox at all: said once, loudly, at start (UnsandboxedWarning)
            return []
        why = place.runtime.unbounded(self.config.tmpfs_mb, max_processes)
        if max_processes and not kernel_counts_per_namespace() and not place.runtime.caps_pids:
            why.append(f"harness.max_processes = {max_processes}: this kernel ({os.uname().release}) counts "
                       f"RLIMIT_NPROC per user over the whole node, so no sandbox gets the kernel's process cap "
                       f"and the harness's process poll alone holds (evaluation commands are not capped); "
                       f"Linux 5.14+, or podman/docker (--pids-limit), hold it")
        return why

    def warn_unbounded(self, place: Placement, max_processes: int) -> None:
        """Warn once per process of each limit ``place`` cannot hold (never silently ignored)."""
        for why in self.unbounded(place, max_processes):
            if why not in self._warned:
                self._warned.add(why)
                warnings.warn(why, UnboundedWarning, stacklevel=2)

    def instance(self, place: Placement, argv: list[str], mounts: list[Mount], env: dict[str, str],
                 *, name: str, private: list[Path], network: bool = False, workdir: str = WORKSPACE,
                 max_processes: int = 0) -> Instance:
        all_mounts = [Mount(str(self.lib_dir()), LIB), *mounts]
        masks: list[str] = []
        if place.kind == "sandbox":
            py_mounts, _ = self._host_python_mounts()
            all_mounts = py_mounts + all_mounts
            masks = self.masks(private)
            env.setdefault("PATH", os.pathsep.join(
                [str(Path(host_python()).parent), "/usr/local/bin", "/usr/bin", "/bin"]))
        elif place.kind == "image" and place.runtime.name == "bwrap":
            # bwrap applies no image config: the image's own ENV (a conda PATH, say), as the
            # official containers have it, under what Gyre sets itself
            for k, v in image_environment(place.image.location).items():
                env.setdefault(k, v)
            env.setdefault("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
        return Instance(argv=argv, workdir=workdir, mounts=all_mounts, env=env, network=network,
                        image=place.image if place.kind == "image" else None, masks=masks, name=name,
                        tmpfs_mb=self.config.tmpfs_mb,
                        process_cap=kernel_process_cap(max_processes) if max_processes else 0)

    def launcher(self, place: Placement, max_processes: int = 0) -> list[str]:
        """argv prefix that runs the in-instance launcher; with ``max_processes``, one that first
        caps the instance's tasks (RLIMIT_NPROC) where it has a user namespace of its own."""
        if place.kind == "host":  # Gyre's own namespace: RLIMIT_NPROC would count all its user's processes
            return [sys.executable, "-S", str(self.lib_dir() / "gyre_sandbox_init.py")]
        argv = [self._python_inside(place), "-S", INIT]
        if max_processes and kernel_counts_per_namespace():
            # the kernel refuses a fork past the cap at once (it exempts the host's root: there the
            # harness's poll alone holds); the launcher checks the namespace is not the host's
            argv += ["--nproc", str(kernel_process_cap(max_processes)), "--host-userns", host_user_namespace()]
        return argv

    def launch(self, place: Placement, inst: Instance) -> Launch:
        if place.kind == "host":  # no sandbox: the instance's paths are host paths
            return Launch(inst.argv, inst.env)
        rt = place.runtime
        la = rt.launch(inst)
        prog = shutil.which(la.argv[0])
        if prog:
            la.argv[0] = prog
        if rt.name == "bwrap":
            # bwrap itself dies of SIGTERM and takes the instance with it at once: it ignores TERM
            # (the launcher inside restores it for the harness), so a harness keeps its grace period
            la.argv = [sys.executable, "-S", "-c", _IGNORE_TERM, *la.argv]
        if rt.name != "bwrap":  # a container client needs its own basics; the instance does not see them
            client = {k: v for k in _CLIENT_ENV if (v := config_env(k)) is not None}
            la.env = {**client, **la.env}
        return la


# -- running a launch --------------------------------------------------------------------------

def run_steps(steps: list[list[str]], env: dict[str, str], *, check: bool) -> None:
    for argv in steps:
        r = subprocess.run(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, timeout=600)
        if check and r.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({r.returncode}): {r.stdout.decode(errors='replace')[-500:]}")


async def run_steps_async(steps: list[list[str]], env: dict[str, str], *, check: bool) -> None:
    await asyncio.to_thread(run_steps, steps, env, check=check)


# -- the proxy, through one Unix socket per execution -------------------------------------------

MAX_RELAY_CONNECTIONS = 64  # per execution: its calls in flight (proxy.max_calls_in_flight) plus idle keep-alives


class ProxyBridge:
    """A Unix socket on the host, relayed to the proxy's TCP address. Mounted alone into one
    instance; the folder holding it is private to Gyre's user and outside every sandbox. At most
    ``max_connections`` are relayed at once: beyond, a new one is closed at once (said once in
    the log), so one harness holding thousands cannot exhaust the head's file descriptors."""

    def __init__(self, base_url: str, max_connections: int = MAX_RELAY_CONNECTIONS):
        self.max_connections, self.open, self.refused = max_connections, 0, 0
        u = urlsplit(base_url)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or (443 if u.scheme == "https" else 80)
        if self.host in ("0.0.0.0", "::"):
            self.host = "127.0.0.1"
        # inside: the same port on the instance's own loopback (a privileged port cannot be bound
        # by the instance's unprivileged user: then a fixed high one)
        self.inner_port = self.port if self.port >= 1024 else 18080
        self.inner_url = urlunsplit((u.scheme or "http", f"127.0.0.1:{self.inner_port}", u.path, u.query, u.fragment))
        self._dir = Path(tempfile.mkdtemp(prefix="gyre-px-"))  # short: socket paths are limited to 108 bytes
        self.path = self._dir / "p.sock"
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> "ProxyBridge":
        self._server = await asyncio.start_unix_server(self._handle, path=str(self.path))
        os.chmod(self.path, 0o777)  # connectable by the instance's uid; the folder is 0700 outside
        return self

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.open >= self.max_connections:
            self.refused += 1
            if self.refused == 1:
                log.warning("a harness holds %d connections to the proxy at once; further ones are closed "
                            "(at most %d per execution)", self.open, self.max_connections)
            writer.close()
            return
        self.open += 1
        try:
            await self._relay(reader, writer)
        finally:
            self.open -= 1

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection(self.host, self.port)
        except OSError:
            writer.close()
            return

        async def pump(r, w):
            try:
                while data := await r.read(65536):
                    w.write(data)
                    await w.drain()
            except (OSError, asyncio.CancelledError):
                pass
            finally:
                try:
                    w.close()
                except OSError:
                    pass

        await asyncio.gather(pump(reader, up_w), pump(up_r, writer))

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            try:
                await asyncio.wait_for(self._server.wait_closed(), 2)
            except asyncio.TimeoutError:
                pass
        shutil.rmtree(self._dir, ignore_errors=True)
