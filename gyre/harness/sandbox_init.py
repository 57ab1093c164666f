"""The first program inside a sandbox or task image: standard library only, Python 3.6+.

It is mounted alone (with the harness scripts) into an instance, so it must not import Gyre.

    sandbox_init.py [--nproc N --host-userns ID] [--forward PORT=SOCKET] -- ARGV...
        With --nproc, first cap the tasks (processes and threads) of this uid at N with
        RLIMIT_NPROC: in the sandbox's own user namespace the kernel counts the sandbox alone.
        ID is the host's user namespace (``readlink /proc/self/ns/user`` there): in that same
        namespace (a runtime that made none) the cap would count every process of the user on
        the node, so it is left unset, with a line on stderr saying so.
        Listen on 127.0.0.1:PORT of the instance's own loopback and relay each connection to
        the Unix socket SOCKET (the host's end leads to the proxy), then run ARGV (the harness)
        and exit with its status. The instance has no other network.

    sandbox_init.py [--nproc N --host-userns ID] --commands FILE --out DIR [--workdir DIR]
        Run each argv of the JSON list FILE in turn, without a shell (NL2RepoBench's official
        runner splits each command with shlex and executes it), stdout into DIR/cmd-N.out and
        stderr into DIR/cmd-N.err, and the exit status into DIR/cmd-N.rc once it ends, so that a
        time limit reached later keeps what earlier commands printed.

    sandbox_init.py [--nproc N --host-userns ID] --copy-tree SRC DST
        Copy SRC (the image's /workspace: the hidden tests) to DST, links kept as links.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading


def _pump(src, dst):
    try:
        while True:
            data = src.recv(65536)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (dst, src):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _relay(client, path):
    upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        upstream.connect(path)
    except OSError:
        client.close()
        upstream.close()
        return
    threading.Thread(target=_pump, args=(client, upstream), daemon=True).start()
    _pump(upstream, client)
    client.close()
    upstream.close()


def forward(port, path):
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", port))
    srv.listen(128)

    def accept():
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=_relay, args=(c, path), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()


def run_harness(argv):
    box, pending, passed = [], [], set()

    # handlers before the child starts: it then begins with default dispositions (bwrap was
    # started with TERM ignored), and a TERM here is passed on, once (Gyre repeats it until one
    # lands): the harness gets its grace period. One that comes before the child exists waits for it.
    def on_signal(n, f):
        if n in passed:
            return
        passed.add(n)
        if box:
            box[0].send_signal(n)
        else:
            pending.append(n)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    try:
        child = subprocess.Popen(argv)
    except OSError as e:
        sys.stderr.write("gyre sandbox: cannot run %r: %s\n" % (argv[0], e))
        return 127
    box.append(child)
    for n in pending:
        child.send_signal(n)
    rc = child.wait()
    if rc < 0:  # died of a signal: die of the same one, so the status reads the same outside
        signal.signal(-rc, signal.SIG_DFL)
        os.kill(os.getpid(), -rc)
    return rc


def run_commands(commands_file, out, workdir, command_timeout=0.0):
    with open(commands_file) as f:
        commands = json.load(f)
    for i, argv in enumerate(commands):
        # stdout and stderr apart: the official runner reads stdout alone when a command succeeds
        with open(os.path.join(out, "cmd-%d.out" % i), "wb") as fo, \
                open(os.path.join(out, "cmd-%d.err" % i), "wb") as fe:
            try:
                child = subprocess.Popen(argv, cwd=workdir, stdin=subprocess.DEVNULL, stdout=fo, stderr=fe)
            except OSError as e:
                fe.write(("exec %s: %s\n" % (argv[0], e)).encode())
                rc = 127
            else:
                try:
                    rc = child.wait(timeout=command_timeout or None)
                except subprocess.TimeoutExpired:  # eval.command_timeout_s: this command only
                    child.kill()
                    rc = child.wait()
                    fe.write(("gyre: command stopped at eval.command_timeout_s = %g\n" % command_timeout).encode())
        with open(os.path.join(out, "cmd-%d.rc" % i), "w") as fh:
            fh.write(str(rc))
    return 0


def cap_processes(n, host_userns=None):
    """RLIMIT_NPROC, set here, inside: the kernel (5.14+) counts it per user namespace, so it
    bounds this sandbox's tasks alone; set outside it would count every process of Gyre's user.
    False (and unset) where this is the host's own user namespace."""
    import resource
    if host_userns is not None and _own_userns() in (None, host_userns):
        sys.stderr.write("gyre sandbox: no user namespace of its own is known (the runtime made none, or no "
                         "/proc): the process cap (RLIMIT_NPROC) is not set\n")
        return False
    _, hard = resource.getrlimit(resource.RLIMIT_NPROC)
    if hard != resource.RLIM_INFINITY:
        n = min(n, hard)
    resource.setrlimit(resource.RLIMIT_NPROC, (n, n))
    return True


def _own_userns():
    try:
        return os.readlink("/proc/self/ns/user")
    except OSError:  # no /proc
        return None


def _process_cap(args):
    """The leading ``--nproc N [--host-userns ID]``, applied; the arguments after it."""
    if args[:1] != ["--nproc"]:
        return args
    n, args = int(args[1]), args[2:]
    host = None
    if args[:1] == ["--host-userns"]:
        host, args = args[1], args[2:]
    cap_processes(n, host)
    return args


def main(args):
    args = _process_cap(args)
    if args[:1] in (["--copy-tree"], ["--commands"]):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # bwrap was started with TERM ignored
    if args[:1] == ["--copy-tree"]:
        shutil.copytree(args[1], args[2], symlinks=True, dirs_exist_ok=True) if sys.version_info >= (3, 8) \
            else shutil.copytree(args[1], args[2], symlinks=True)
        return 0
    if args[:1] == ["--commands"]:
        opts = dict(zip(args[0::2], args[1::2]))
        return run_commands(opts["--commands"], opts["--out"], opts.get("--workdir") or os.getcwd(),
                            float(opts.get("--command-timeout") or 0))
    while args and args[0] == "--forward":
        port, _, path = args[1].partition("=")
        try:
            forward(int(port), path)
        except OSError as e:  # the harness still runs; its calls fail and say why
            sys.stderr.write("gyre sandbox: cannot relay the proxy on 127.0.0.1:%s: %s\n" % (port, e))
        args = args[2:]
    if args[:1] == ["--"]:
        args = args[1:]
    if not args:
        sys.stderr.write("gyre sandbox: nothing to run\n")
        return 2
    return run_harness(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
