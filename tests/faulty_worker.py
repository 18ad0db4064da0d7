"""A worker that fails the way real probes do, to test the runner's isolation for real.

Used as the runner's worker command: `python tests/faulty_worker.py MODE [PID_FILE] REQUEST
RESULT`. It prints like a probe, then dies (os._exit), takes a signal, hangs with a child
process (its pid goes to PID_FILE, or to $FAULTY_CHILD_PID_FILE), sleeps alone, grows (in
this memory cgroup, or in the one named by $FAULTY_CGROUP, where the kernel's OOM killer
ends it), or writes an ok result and then hangs (a driver killed after the result was written).
Modes that sleep write their own pid to $FAULTY_WORKER_PID_FILE when it is set.
"""

import os
import signal
import subprocess
import sys
import time

mode, options = sys.argv[1], sys.argv[2:-2]
request_path, result_path = sys.argv[-2], sys.argv[-1]
print("building model tiny-qwen2.5 ...", file=sys.stderr, flush=True)
if os.environ.get("FAULTY_WORKER_PID_FILE"):
    with open(os.environ["FAULTY_WORKER_PID_FILE"], "w") as f:
        f.write(str(os.getpid()))
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
elif mode == "result-then-hang":  # the probe is done; its process has not exited yet
    from autotune.files import write_text_atomic
    from autotune.probe.measure.result import ProbeResult, ProbeStatus

    peaks = {"rollout": 300 * 2**20, "experience": 320 * 2**20, "update": 350 * 2**20}
    write_text_atomic(result_path, ProbeResult(
        status=ProbeStatus.OK, tokens_per_s=1234.5, samples_per_s=10.0, step_s=1.0,
        peak_mem_bytes=max(peaks.values()), phase_peak_mem_bytes=peaks,
        device_name="faulty", device_capacity_bytes=2**33, probe_wall_s=1.0).to_json())
    time.sleep(3600)
elif mode == "allocate":  # grow host memory until the watchdog (or the OOM killer) steps in
    if os.environ.get("FAULTY_CGROUP"):
        with open(os.path.join(os.environ["FAULTY_CGROUP"], "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    blocks = []
    while True:
        blocks.append(bytearray(32 * 2**20))
        time.sleep(0.01)
