"""One interpreter for the Python of a batch of read-only checks (fleetcuda's interpreter server).

Started by the batch shell (plan/planner.batch_command) once per Python that its checks run, as
`python - DIR N <<'FLEETCUDA_PY'`: it imports torch once, then for each request forks a child that runs
that command as a fresh `python ARGS` would, with the caller's environment, working directory and
stdin/stdout/stderr (opened through /proc/<caller>/fd, so a pipe stays the caller's pipe). Forking after
`import torch` is what PyTorch's own DataLoader workers do: torch starts no CUDA context on import, and
each check that uses the GPU initialises CUDA in its own child. A check therefore costs a fork, not an
interpreter start and a torch import, and no check sees what another one did: each child is a copy.

Protocol (files in DIR, a private directory of the batch): the caller (the `fc_py` shell function) writes
its request to `q.<pid>` (its working directory, its argv, its environment, NUL-separated), makes the
FIFO `r.<pid>`, writes `<pid>` to `in.N` and reads one line from `r.<pid>`: the exit status, or
`fallback`, after which it runs the real interpreter itself. Anything this server cannot reproduce
exactly falls back: an option other than -c/-m/-/a script, an environment that differs in what Python
or torch read at start-up (PYTHON*, LD_*, LC_*, LANG, HOME, TORCH_*), a torch that failed to import
here, or a caller stream that cannot be reopened. Standard library only.
"""

from __future__ import annotations

import os
import signal
import sys

# What Python (or torch, at import) reads at start-up: a request whose environment differs here falls back.
STARTUP_PREFIXES = ("PYTHON", "LD_", "LC_", "TORCH_", "PYTORCH_", "OMP_", "MKL_", "KMP_", "OPENBLAS_", "GOMP_")
# Linux's limits on what an exec takes: past them the real interpreter fails to start (E2BIG), so it runs.
MAX_ARG_STRLEN = 131072
STARTUP_NAMES = ("LANG", "HOME")


def startup_view(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(STARTUP_PREFIXES) or k in STARTUP_NAMES}


def parse_request(data: bytes) -> tuple[str, str, list[str], dict[str, str]]:
    """(token, umask, argv after the interpreter, environment) from
    `token NUL umask NUL argc NUL argv... NUL NAME=value NUL ...`."""
    fields = data.split(b"\0")
    if fields and fields[-1] == b"":
        fields.pop()
    words = [os.fsdecode(f) for f in fields]
    token, umask, argc = words[0], words[1], int(words[2])
    argv = words[3:3 + argc]
    env = {}
    for item in words[3 + argc:]:
        name, sep, value = item.partition("=")
        if sep:
            env[name] = value
    return token, umask, argv, env


def plan_run(argv: list[str]) -> tuple[str, str, list[str]] | None:
    """How `python ARGV` runs: ("code", text, sys.argv), ("stdin", "", sys.argv), ("module", name, sys.argv),
    ("script", path, sys.argv); None for anything else (options this server does not reproduce)."""
    if not argv:
        return None  # the interactive interpreter
    first = argv[0]
    if first == "-c" and len(argv) >= 2:
        return ("code", argv[1], ["-c", *argv[2:]])
    if first == "-m" and len(argv) >= 2:
        return ("module", argv[1], [argv[1], *argv[2:]])
    if first == "-":
        return ("stdin", "", ["-", *argv[1:]])
    if first.startswith("-"):
        return None
    return ("script", first, argv)


def run_child(how: tuple[str, str, list[str]], env: dict[str, str]) -> int:
    """In the forked child: become `python ARGS` and run it; its exit status (see finish)."""
    import runpy
    import types

    kind, what, args = how
    os.environ.clear()
    os.environ.update(env)
    sys.argv = args
    if kind == "script":
        sys.path[0] = os.path.dirname(os.path.abspath(what))
    else:
        sys.path[0] = os.getcwd() if kind == "module" else ""
    try:
        if kind == "module":
            runpy.run_module(what, run_name="__main__", alter_sys=True)
        else:
            if kind == "stdin":
                source: str | bytes = sys.stdin.read()
                filename = "<stdin>"
            elif kind == "code":
                source, filename = what, "<string>"
            else:
                with open(what, "rb") as f:
                    source, filename = f.read(), what
            code = compile(source, filename, "exec")
            module = types.ModuleType("__main__")  # a fresh __main__, as a new interpreter has
            if kind == "script":
                module.__file__ = what
            sys.modules["__main__"] = module
            exec(code, module.__dict__)  # noqa: S102  (running the check is the point)
    except SystemExit as exc:
        return _exit_code(exc)
    except BaseException as exc:  # as the interpreter does: its excepthook, without this server's frame
        tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        return -signal.SIGINT if isinstance(exc, KeyboardInterrupt) else 1
    return 0


def _exit_code(exc: SystemExit) -> int:
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def finish(code: int) -> None:
    """What the interpreter does at exit that a check can see, then os._exit (a full finalization with torch
    loaded costs seconds, every call): non-daemon threads joined, atexit handlers, files the program left open
    in its namespace flushed, stdout and stderr flushed (a failing stdout: its message, status 120), and after
    an unhandled KeyboardInterrupt death by SIGINT (130)."""
    import atexit
    import io
    import threading
    import traceback

    try:
        threading._shutdown()  # type: ignore[attr-defined]
    except Exception:
        pass
    atexit._run_exitfuncs()
    main = sys.modules.get("__main__")
    for value in list(vars(main).values()) if main is not None else []:
        if isinstance(value, io.IOBase) and not value.closed:
            try:
                value.flush()
            except Exception:
                pass
    status = code
    for stream in (sys.stdout, sys.stderr):
        if stream is None or stream.closed:  # as the interpreter: a closed one is not flushed
            continue
        try:
            stream.flush()
        except Exception as exc:
            if stream is sys.stdout:
                try:
                    sys.stderr.write(f"Exception ignored in: {stream!r}\n"
                                     + "".join(traceback.format_exception_only(type(exc), exc)))
                    sys.stderr.flush()
                except Exception:
                    pass
                status = 120 if status == 0 else status
    if status == -signal.SIGINT:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(status & 0xFF)


def open_streams(pid: int) -> list[int] | None:
    """The caller's stdin, stdout, stderr and working directory, opened here (a pipe stays the caller's pipe); None
    if one cannot be, or is a file whose offset the caller shares with what it runs (output appended or written
    after the shell's own; stdin read past its start), which a reopened file would not share."""
    import stat

    fds: list[int] = []
    try:
        for n in (0, 1, 2):
            fds.append(os.open(f"/proc/{pid}/fd/{n}", os.O_RDONLY if n == 0 else os.O_WRONLY))
            if stat.S_ISREG(os.fstat(fds[-1]).st_mode) and (n > 0 or _offset(pid, 0) != 0):
                raise OSError("a regular file")
        fds.append(os.open(f"/proc/{pid}/cwd", os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)))
    except OSError:
        for fd in fds:
            os.close(fd)
        return None
    return fds


def _offset(pid: int, fd: int) -> int:
    with open(f"/proc/{pid}/fdinfo/{fd}") as f:
        for line in f:
            if line.startswith("pos:"):
                return int(line.split()[1])
    return -1


def _become_streams(fds: list[int], umask: str) -> None:
    """The caller's streams as fds 0, 1, 2 (stdout and stderr under this interpreter's own objects, made at
    start-up with the same locale as a new interpreter's; a module imported here may hold them; stdin anew, as
    it may now be a file), its working directory and umask."""
    *streams, cwd = fds
    for n, fd in enumerate(streams):
        os.dup2(fd, n)
        os.close(fd)
    os.fchdir(cwd)
    os.close(cwd)
    os.umask(int(umask, 8))
    os.closerange(3, 1 << 16)  # the server's inbox and wake-up pipe are not the check's
    stdin = sys.__stdin__
    sys.stdin = open(0, closefd=False, encoding=stdin.encoding if stdin else None,  # noqa: SIM115
                     errors=stdin.errors if stdin else None)
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__


class Server:
    def __init__(self, directory: str, number: str, preload: list[str]):
        self.dir = directory
        self.inbox = os.path.join(directory, f"in.{number}")
        self.env = startup_view(dict(os.environ))
        self.usable = self._preload(preload)
        self.children: dict[int, tuple[str, str]] = {}  # child pid -> (caller pid, its token)
        self.seen: set[str] = set()  # tokens served

    def _preload(self, modules: list[str]) -> bool:
        import importlib
        import importlib.util

        # (The batch starts this server with its stdout and stderr on /dev/null: a warning goes nowhere.)
        try:
            for name in modules:
                if importlib.util.find_spec(name) is not None:
                    importlib.import_module(name)
        except BaseException:
            return False  # every check runs as a fresh interpreter would, and fails as it would
        finally:
            for stream in (sys.stdout, sys.stderr):
                stream.flush()  # nothing of the server's own is left in a buffer a child would flush
        # A forked child cannot use CUDA that its parent started: then nothing is shared.
        torch = sys.modules.get("torch")
        return not (torch is not None and torch.cuda.is_initialized())

    def note(self, token: str, kind: str, line: str) -> None:
        """The answer as a file too (`t.TOKEN` started, `s.TOKEN` the status): the caller reads it when the FIFO
        line does not come (seen under load: a caller waiting on a line that never arrived)."""
        path = os.path.join(self.dir, f"{kind}.{token}")
        try:
            with open(path + ".tmp", "w") as f:
                f.write(line + "\n")
            os.replace(path + ".tmp", path)
        except OSError:
            pass

    def answer(self, caller: str, line: str) -> None:
        try:
            fd = os.open(os.path.join(self.dir, f"r.{caller}"), os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            return  # the caller is gone
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)

    def serve_one(self, caller: str, said: str) -> None:
        try:
            with open(os.path.join(self.dir, f"q.{caller}"), "rb") as f:
                token, umask, argv, env = parse_request(f.read())
            int(umask, 8)
        except (OSError, ValueError, IndexError):
            self.answer(caller, "fallback")  # (no token to answer with: an untokened fallback is always safe)
            return
        if token != said:
            return  # a request file of another call of that caller: not this one's
        self.seen.add(token)
        how = plan_run(argv)
        words = [*argv, *(f"{k}={v}" for k, v in env.items())]
        exact = (how is not None and self.usable and startup_view(env) == self.env
                 and all(len(os.fsencode(w)) < MAX_ARG_STRLEN for w in words)
                 and sum(len(os.fsencode(w)) + 9 for w in words) < os.sysconf("SC_ARG_MAX"))
        fds = open_streams(int(caller)) if exact else None
        if how is None or fds is None:
            self.note(token, "s", "fallback")
            self.answer(caller, f"{token} fallback")
            return
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            for sig in (signal.SIGCHLD, signal.SIGTERM):
                signal.signal(sig, signal.SIG_DFL)
            code = 1
            try:
                _become_streams(fds, umask)
                code = run_child(how, env)
            finally:
                finish(code)
        for fd in fds:
            os.close(fd)
        self.children[pid] = (caller, token)
        self.note(token, "t", "started")
        self.answer(caller, f"{token} started")  # from here on a server that dies is not a reason to run it again

    def reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            who = self.children.pop(pid, None)
            if who is not None:
                caller, token = who
                # As the shell says it (os.waitstatus_to_exitcode is Python 3.9's: targets may have 3.8).
                code = 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
                self.note(token, "s", str(code))
                self.answer(caller, f"{token} {code}")

    def serve(self) -> None:
        import select
        import shutil

        def stop(*_: object) -> None:  # the batch's timeout, stop.sh, or the batch gone: leave nothing behind
            shutil.rmtree(self.dir, ignore_errors=True)
            os._exit(0)

        signal.signal(signal.SIGTERM, stop)
        parent = os.getppid()
        _term_with_parent()
        inbox = os.open(self.inbox, os.O_RDWR)  # read and write: never EOF while callers come and go
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        buf = b""
        while True:
            ready, _, _ = select.select([inbox, wake_r], [], [], 0.5)
            if os.getppid() != parent:
                stop()
            if not ready:
                self.reap()  # (a wake-up that did not come: children are reaped on every timeout too)
            if wake_r in ready:
                os.read(wake_r, 512)
                self.reap()
            if inbox not in ready:
                continue
            buf += os.read(inbox, 4096)
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                words = line.decode(errors="replace").split()
                if words == ["exit"]:
                    return
                # `PID TOKEN`, said again by a caller still waiting: each token is served once.
                if len(words) == 2 and words[0].isdigit() and words[1] not in self.seen:
                    self.serve_one(words[0], words[1])
            self.reap()


def _term_with_parent() -> None:
    """SIGTERM when the batch shell dies (a lost connection: it dies of SIGPIPE, and its timeout, which kills
    the group only when the time is up, exits with it). Linux's prctl; elsewhere the loop's parent check."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def main(argv):
    """pyserver.py DIR N [MODULE...] LABEL: serve DIR/in.N, MODULEs imported first; LABEL names the run."""
    if len(argv) < 3 or not argv[1].isdigit():
        print("usage: pyserver.py DIR N [MODULE...] LABEL", file=sys.stderr)
        return 2
    Server(argv[0], argv[1], argv[2:-1]).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
