"""A worker that fails the way real probes do, to test the runner's isolation for real.

Used as the runner's worker command: `python tests/faulty_worker.py MODE [PID_FILE] REQUEST
RESULT`. It prints like a probe, then dies (os._exit), takes a signal, hangs with a child
process (its pid goes to PID_FILE, or to $FAULTY_CHILD_PID_FILE), sleeps alone, or grows.
"""

import os
import signal
import subprocess
import sys
import time

mode, options = sys.argv[1], sys.argv[2:-2]
request_path, result_path = sys.argv[-2], sys.argv[-1]
print("building model tiny-qwen2.5 ...", file=sys.stderr, flush=True)
if mode == "exit":
    print("Fatal Python error: probe aborted in update", file=sys.stderr, flush=True)
    os._exit(3)
elif mode == "segv":
    print("about to segfault", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGSEGV)
elif mode == "hang":
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    with open(options[0] if options else os.environ["FAULTY_CHILD_PID_FILE"], "w") as f:
        f.write(str(child.pid))
    time.sleep(3600)
elif mode == "sleep":  # hang without a child: a probe a lost node takes down whole
    print("sleeping in update", file=sys.stderr, flush=True)
    time.sleep(3600)
elif mode == "allocate":  # grow host memory until the watchdog steps in
    blocks = []
    while True:
        blocks.append(bytearray(32 * 2**20))
        time.sleep(0.01)
