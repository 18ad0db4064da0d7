"""`python -m autotune.probe.fork_server MODEL [MODEL_PATH]`: CPU probes forked, not started.

A CPU probe of a tiny model spends about half its wall time importing torch, transformers and
its model's class (docs/development.md, "Where the suite's time goes"). This process imports
them once, as the worker would (its environment is the probe's: `probe_env`, whose OMP and
malloc settings the libraries read as they load), then forks one child per probe. A child
is what `python -m autotune.probe.worker REQUEST RESULT` would be a few seconds later: its
own session (process group), its parent's death as SIGKILL, its log on stdout and stderr,
the probe's tag in the environment it passes on, and `worker.main` run on the request. Its
anonymous RSS, the CPU probe's device figure, holds the same imports a started worker's would.

Never for a GPU probe: CUDA must be initialised in the probe's own process, as the trainer's
is, and a GPU probe's minutes make an import's seconds irrelevant (runners/forking.py decides).

Protocol, one JSON object per line. In, on stdin: {"id", "request", "result", "log", "tag",
"cwd"}. Out, on stdout: {"ready": true} once the imports are done (or {"error": "..."} and the
process exits), {"id", "pid"} per child forked (or {"id", "error"} when the fork failed),
{"exited": pid, "returncode"} per child reaped (Popen's convention: -N for a child killed by
signal N). On EOF on stdin, or when the driver that started it is gone (also while it imports),
it kills its children and exits at once, with no interpreter teardown.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import select
import signal
import sys
import threading
import traceback

from autotune.files import open_log
from autotune.process_tag import PROBE_TAG_ENV, die_with_parent

PARENT_CHECK_S = 0.1  # how often it looks whether its driver is still there


def preload(model: str, model_path: str | None) -> None:
    """Import what a built-in probe's worker imports (worker.run_request), its model's
    transformers class included; then freeze the heap so children copy no page for it."""
    import torch  # noqa: F401

    from autotune.probe.measure import meter, oom  # noqa: F401
    from autotune.probe.modeling.models import load_model_config, model_class
    from autotune.probe.step import training  # noqa: F401
    from autotune.probe.worker import quiet_libraries

    quiet_libraries()
    config = load_model_config(model, model_path)
    cls = model_class(config)
    mapping = getattr(cls, "_model_mapping", None)  # an Auto class: import the one it builds
    if mapping is not None and type(config) in mapping:
        mapping[type(config)]
    gc.collect()
    gc.freeze()


def flush_output() -> None:
    """What the child printed, into its log, before it ends without the interpreter's exit."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def run_child(message: dict[str, str], server_pid: int, own_fds: tuple[int, ...]) -> None:
    """In a forked child: become the probe's worker, then exit with its code (never returns)."""
    code = 1
    try:
        os.setsid()
        die_with_parent(server_pid)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in own_fds:
            os.close(fd)
        os.chdir(message["cwd"])  # the driver's, as a started worker inherits it
        log = open_log(message["log"])
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.environ[PROBE_TAG_ENV] = message["tag"]  # for every process the probe starts
        from autotune.probe import worker

        sys.argv = [worker.__file__, message["request"], message["result"]]
        code = worker.main(sys.argv[1:])
    except SystemExit as exc:  # as the interpreter ends on one
        if isinstance(exc.code, int) or exc.code is None:
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
    except KeyboardInterrupt:  # as the interpreter ends on one: killed by SIGINT
        traceback.print_exc()
        flush_output()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:
        traceback.print_exc()
    finally:
        flush_output()
        os._exit(code)


def serve(requests_fd: int, replies_fd: int, driver_pid: int) -> None:
    """Fork a child per request, report each child's pid and exit code, until stdin closes or
    the driver is gone; then kill the children still running."""
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # its wake-up fd ends the select at once
    signal.set_wakeup_fd(wake_write)
    own_fds = (requests_fd, replies_fd, wake_read, wake_write)
    server_pid = os.getpid()
    children: set[int] = set()
    pending = b""

    def reply(message: dict[str, object]) -> None:
        os.write(replies_fd, (json.dumps(message) + "\n").encode())

    try:
        while os.getppid() == driver_pid:
            readable, _, _ = select.select([requests_fd, wake_read], [], [], PARENT_CHECK_S)
            if wake_read in readable:
                os.read(wake_read, 4096)
            while children:
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                children.discard(pid)
                reply({"exited": pid, "returncode": os.waitstatus_to_exitcode(status)})
            if requests_fd not in readable:
                continue
            chunk = os.read(requests_fd, 1 << 16)
            if not chunk:
                break  # the driver closed our stdin: it is done with us
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                message = json.loads(line)
                try:
                    pid = os.fork()
                except OSError as exc:  # a pids or memory limit: the driver starts a process
                    reply({"id": message["id"], "error": str(exc)})
                    continue
                if pid == 0:
                    run_child(message, server_pid, own_fds)
                children.add(pid)
                reply({"id": message["id"], "pid": pid})
    finally:
        for pid in children:  # by group, and by pid: a child may not have made its group yet
            for kill in (os.killpg, os.kill):
                with contextlib.suppress(OSError):
                    kill(pid, signal.SIGKILL)


def watch_driver(driver_pid: int, done: threading.Event) -> None:
    """While the server imports (seconds): end it at once when its driver is gone."""
    while not done.wait(PARENT_CHECK_S):
        if os.getppid() != driver_pid:
            os._exit(1)


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2):
        print("usage: python -m autotune.probe.fork_server MODEL [MODEL_PATH]", file=sys.stderr)
        return 2
    driver_pid = os.getppid()
    requests_fd, replies_fd = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):  # a stray print must not end up in the protocol
        os.dup2(null, fd)
    os.close(null)
    imported = threading.Event()
    watcher = threading.Thread(target=watch_driver, args=(driver_pid, imported), daemon=True)
    watcher.start()
    try:
        preload(argv[0], argv[1] if len(argv) == 2 and argv[1] else None)
    except Exception as exc:  # the driver starts its probes as processes instead
        os.write(replies_fd, (json.dumps({"error": f"{type(exc).__name__}: {exc}"}) + "\n")
                 .encode())
        os._exit(1)
    finally:
        imported.set()
        watcher.join()  # one thread left when it forks
    os.write(replies_fd, b'{"ready": true}\n')
    try:
        serve(requests_fd, replies_fd, driver_pid)
    finally:  # no interpreter teardown (a second, with torch loaded): the driver may be gone
        os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
