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
STARTUP_PREFIXES = ("PYTHON", "LD_", "LC_", "TORCH_")
STARTUP_NAMES = ("LANG", "HOME")


def startup_view(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(STARTUP_PREFIXES) or k in STARTUP_NAMES}


def parse_request(data: bytes) -> tuple[str, list[str], dict[str, str]]:
    """(cwd, argv after the interpreter, environment) from `cwd NUL argc NUL argv... NUL NAME=value NUL ...`."""
    fields = data.split(b"\0")
    if fields and fields[-1] == b"":
        fields.pop()
    words = [os.fsdecode(f) for f in fields]
    cwd, argc = words[0], int(words[1])
    argv = words[2:2 + argc]
    env = {}
    for item in words[2 + argc:]:
        name, sep, value = item.partition("=")
        if sep:
            env[name] = value
    return cwd, argv, env


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


def _exit_code(exc: SystemExit) -> int:
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def run_child(how: tuple[str, str, list[str]], cwd: str, env: dict[str, str]) -> int:
    """In the forked child: become `python ARGS` and run it; the exit status."""
    import runpy
    import traceback
    import types

    kind, what, args = how
    if cwd:
        os.chdir(cwd)
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
            return 0
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
        return 0
    except SystemExit as exc:
        return _exit_code(exc)
    except BaseException as exc:  # as the interpreter does: the traceback, without this server's frame
        tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
        traceback.print_exception(type(exc), exc, tb)
        return 1


def open_streams(pid: int) -> list[int] | None:
    """The caller's stdin, stdout and stderr, opened here (a pipe stays the caller's pipe); None if one cannot be."""
    fds: list[int] = []
    try:
        for n in (0, 1, 2):
            fds.append(os.open(f"/proc/{pid}/fd/{n}", os.O_RDONLY if n == 0 else os.O_WRONLY))
    except OSError:
        for fd in fds:
            os.close(fd)
        return None
    return fds


def _become_streams(fds: list[int]) -> None:
    """The caller's streams as fds 0, 1, 2, under this interpreter's own sys.stdin/stdout/stderr objects (made
    at start-up with the same locale, as a new interpreter's are; a module imported here may hold them)."""
    for n, fd in enumerate(fds):
        os.dup2(fd, n)
        os.close(fd)
    os.closerange(3, 1 << 16)  # the server's inbox and wake-up pipe are not the check's
    sys.stdin, sys.stdout, sys.stderr = sys.__stdin__, sys.__stdout__, sys.__stderr__


class Server:
    def __init__(self, directory: str, number: str, preload: list[str]):
        self.dir = directory
        self.inbox = os.path.join(directory, f"in.{number}")
        self.env = startup_view(dict(os.environ))
        self.usable = self._preload(preload)
        self.children: dict[int, str] = {}  # child pid -> caller pid

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

    def answer(self, caller: str, line: str) -> None:
        try:
            fd = os.open(os.path.join(self.dir, f"r.{caller}"), os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            return  # the caller is gone
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)

    def serve_one(self, caller: str) -> None:
        try:
            with open(os.path.join(self.dir, f"q.{caller}"), "rb") as f:
                cwd, argv, env = parse_request(f.read())
        except (OSError, ValueError, IndexError):
            self.answer(caller, "fallback")
            return
        how = plan_run(argv)
        fds = open_streams(int(caller)) if how is not None and self.usable and startup_view(env) == self.env else None
        if how is None or fds is None:
            self.answer(caller, "fallback")
            return
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                _become_streams(fds)
                code = run_child(how, cwd, env)

                import atexit

                atexit._run_exitfuncs()
            finally:
                for stream in (sys.stdout, sys.stderr):
                    try:
                        stream.flush()
                    except Exception:
                        pass
                os._exit(code)
        for fd in fds:
            os.close(fd)
        self.children[pid] = caller

    def reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            caller = self.children.pop(pid, None)
            if caller is not None:
                # As the shell says it (os.waitstatus_to_exitcode is Python 3.9's: targets may have 3.8).
                code = 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
                self.answer(caller, str(code))

    def serve(self) -> None:
        import select

        inbox = os.open(self.inbox, os.O_RDWR)  # read and write: never EOF while callers come and go
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        buf = b""
        while True:
            ready, _, _ = select.select([inbox, wake_r], [], [])
            if wake_r in ready:
                os.read(wake_r, 512)
                self.reap()
            if inbox not in ready:
                continue
            buf += os.read(inbox, 4096)
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                word = line.decode(errors="replace").strip()
                if word == "exit":
                    return
                if word.isdigit():
                    self.serve_one(word)
            self.reap()


def main(argv):
    """pyserver.py DIR N [MODULE...] LABEL: serve DIR/in.N, MODULEs imported first; LABEL names the run."""
    if len(argv) < 3 or not argv[1].isdigit():
        print("usage: pyserver.py DIR N [MODULE...] LABEL", file=sys.stderr)
        return 2
    Server(argv[0], argv[1], argv[2:-1]).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
