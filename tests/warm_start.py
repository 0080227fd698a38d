"""A warm start for the tests' training processes: one process per pytest worker imports torch, accelerate and
DeepSpeed once (about 3 of the 6 seconds a short training launch takes on 2 cores) and forks a child for each
run; the child is a process of its own (its own process group, AcceleratorState, stdout, stderr and exit
status), as if `python SCRIPT ARGS` had started it after those imports.

Only for what the fixtures `train` and `scenario` launch (tests/conftest.py): the tests of a fresh interpreter
(what a process imports at start-up, the `.pth` activation, launchers, kills) start real processes. The fix is
never imported here, so a run without it (a reference) stays without it.

    python tests/warm_start.py    # serves: one JSON request a line on stdin, one JSON answer a line on stdout
"""

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# What every run would import first; nothing here may start a Python thread or ask the machine anything a test
# checks (py-cpuinfo's subprocess, bitsandbytes).
# Beyond the first four, what a short training here imports later (found by comparing sys.modules before and after
# one): torch's compiler modules, transformers, the op builders' setuptools, DeepSpeed's optimizers and MoE layers.
# (DeepSpeed's own import brings transformers, wherever the fix is imported.)
PRELOAD = ("torch", "accelerate", "accelerate.accelerator", "deepspeed", "torch._dynamo", "torch._export",
           "torch.utils.cpp_extension", "networkx", "transformers", "huggingface_hub",
           "deepspeed.ops.op_builder.all_ops", "deepspeed.runtime.zero.muon", "deepspeed.module_inject",
           "deepspeed.moe.layer")


def _child(request):
    """In the forked child: become `python SCRIPT ARGS` in its folder with its environment and output files."""
    os.setpgid(0, 0)  # its own process group: a timeout kills it with whatever it started
    # as a fresh interpreter: Python's Ctrl-C handler, unless its parent ignores SIGINT (a pytest-xdist worker
    # does), which an exec would pass on
    signal.signal(signal.SIGINT, signal.SIG_IGN if request["sigint_ignored"] else signal.default_int_handler)
    # the same stream objects on new files (loggers made at import hold them); stdin anew, as the server's has
    # read ahead
    for fd, path, mode in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY),
                           (2, request["stderr"], os.O_WRONLY)):
        os.dup2(os.open(path, mode), fd)
    sys.stdin = open(0, closefd=False)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    script = request["argv"][0]
    sys.argv = list(request["argv"])
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    code, interrupted = 0, False
    try:
        import runpy

        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except BaseException as e:  # as the interpreter would: sys.excepthook (the fix adds its words there), status 1
        sys.excepthook(type(e), e, e.__traceback__)
        code, interrupted = 1, isinstance(e, KeyboardInterrupt)
    # the interpreter's own way out: wait for the threads that are not daemons, run atexit, flush
    try:
        threading._shutdown()
    except Exception:
        pass
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    if interrupted:  # an interpreter ended by Ctrl-C dies of SIGINT, as its parent sees
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


def serve():
    # the answers keep the pipe; what the imports print goes to stderr
    answers = open(os.dup(1), "w")
    os.dup2(2, 1)
    for name in PRELOAD:
        try:
            __import__(name)
        except ImportError:  # another release lays its modules out otherwise: the child imports what it needs
            pass
    # a fork copies only the calling thread: no Python thread may run here (torch's import leaves one idle native
    # thread of its own, which torch's DataLoader workers fork beside as well)
    assert threading.enumerate() == [threading.main_thread()], f"warm_start: threads {threading.enumerate()}"
    print(json.dumps({"ready": os.getpid()}), file=answers, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            answers.close()
            _child(request)
        print(json.dumps({"pid": pid}), file=answers, flush=True)
        _, status = os.waitpid(pid, 0)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        print(json.dumps({"pid": pid, "returncode": code}), file=answers, flush=True)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # pytest's Ctrl-C ends the worker; the server ends with its stdin
    serve()


# --- the tests' side (tests/conftest.py): one server per pytest worker, started at its first warm run

# Read at import or at the loading of a library (the dynamic loader, OpenMP, the .pth that activates the fix), so a
# run that sets one of these otherwise than the server's environment starts a real process instead.
# Every PYTHON* variable is too (PYTHONUNBUFFERED, PYTHONWARNINGS, PYTHONPATH ...: the interpreter reads them as it
# starts), and so are the locale's (the encoding of stdout).
READ_AT_START = ("ACCEL_DS_FIX", "LD_LIBRARY_PATH", "LD_PRELOAD", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "KMP_AFFINITY",
                 "GOMP_CPU_AFFINITY", "DS_ACCELERATOR", "CUDA_VISIBLE_DEVICES", "TMPDIR", "LANG", "LC_ALL", "LC_CTYPE")
READ_AT_START_PREFIXES = ("PYTHON",)


# A run whose point is the order of its imports: the fix activated before accelerate is imported.
ABOUT_IMPORT_ORDER = ("--import-fix-first",)


class WarmStarter:
    def __init__(self, env, cwd):
        self.env, self.cwd, self.server, self.buffer = dict(env), cwd, None, b""

    def can_start(self, argv, env):
        keys = set(READ_AT_START) | {k for k in {*env, *self.env} if k.startswith(READ_AT_START_PREFIXES)}
        return all(env.get(key) == self.env.get(key) for key in keys) and \
            not any(str(arg) in ABOUT_IMPORT_ORDER for arg in argv)

    def _answer(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self.buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self.server.stdout], [], [], left)[0]:
                return None
            chunk = os.read(self.server.stdout.fileno(), 65536)
            if not chunk:
                raise RuntimeError(f"warm_start: the server ended (status {self.server.wait()})")
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)

    def _start(self):
        self.server = subprocess.Popen([sys.executable, os.path.abspath(__file__)], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, env=self.env, cwd=self.cwd)
        assert "ready" in self._answer(timeout=300), "warm_start: the server did not start"

    def run(self, argv, env, cwd, timeout):
        """subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout), argv[0] being
        sys.executable, the child forked from the server; its output passes through files in a temporary folder."""
        if self.server is None or self.server.poll() is not None:
            self._start()
        with tempfile.TemporaryDirectory() as tmp:
            out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
            for path in (out, err):
                open(path, "w").close()
            request = {"argv": [str(a) for a in argv[1:]], "env": env, "cwd": str(cwd), "stdout": out, "stderr": err,
                       "sigint_ignored": signal.getsignal(signal.SIGINT) == signal.SIG_IGN}
            self.server.stdin.write((json.dumps(request) + "\n").encode())
            self.server.stdin.flush()
            pid = self._answer(timeout=60)["pid"]
            answer = self._answer(timeout=timeout)
            timed_out = answer is None
            if timed_out:  # as subprocess.run does: kill it (its process group), then raise
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                answer = self._answer()
            stdout, stderr = (Path(path).read_text(errors="replace") for path in (out, err))
        if timed_out:
            raise subprocess.TimeoutExpired(argv, timeout, output=stdout, stderr=stderr)
        return subprocess.CompletedProcess(list(argv), answer["returncode"], stdout, stderr)

    def close(self):
        if self.server is not None and self.server.poll() is None:
            self.server.stdin.close()
            self.server.wait(timeout=60)
