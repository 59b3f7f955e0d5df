#!/usr/bin/env python3
"""Exercise the node daemon's NVML backend end to end on a real GPU machine.

    python scripts/nvml_check.py            # backend only
    python scripts/nvml_check.py --agent    # also a real node daemon on a throwaway NATS

1. list the GPUs (UUID, model, memory), the NVLink topology (P2P pairs, links, domains) and
   each GPU's MIG mode and GPU-instance profiles, and on a GPU in MIG mode the instances made
   (profile, GPU/compute instance id, MIG UUID, capability devices from mig-minors);
2. one heartbeat sample (memory, utilization, processes, health), and the used-versus-held
   fields the reconciler reads (utilization, memory used with or without a process: idle, leaked);
3. start a process with CUDA_VISIBLE_DEVICES=<index> that opens a CUDA context (through
   libcuda with ctypes: no torch or cupy needed) and check that NVML lists it on that GPU;
4. with --agent: a node daemon with the NVML backend registers, a grant starts the same CUDA
   process as a job, its heartbeat shows the pid on the granted GPU, a cancel kills it.
Exits non-zero on the first failed check.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CUDA_CHILD = r"""
import ctypes, sys, time
cuda = ctypes.CDLL("libcuda.so.1")
assert cuda.cuInit(0) == 0, "cuInit failed"
dev, ctx = ctypes.c_int(), ctypes.c_void_p()
assert cuda.cuDeviceGet(ctypes.byref(dev), 0) == 0, "cuDeviceGet failed"
assert cuda.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev) == 0, "cuCtxCreate failed"
ptr = ctypes.c_void_p()
cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(256 << 20))
print("cuda context ready", flush=True)
time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 30)
"""


def ok(msg: str) -> None:
    print(f"  ok  {msg}", flush=True)


def fail(msg: str) -> None:
    print(f"FAIL  {msg}", flush=True)
    raise SystemExit(1)


def wait_for_pid(backend, index: int, pid: int, present: bool, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sample = backend.sample()[index]
        if (pid in sample.pids) == present:
            return sample
        time.sleep(0.25)
    return None


def check_backend(index: int):
    from gpusched.services.nodeagent.backends import NvmlBackend

    t0 = time.perf_counter()
    backend = NvmlBackend()
    gpus = backend.gpus()
    if not gpus:
        fail("NVML reports no GPUs")
    ok(f"{len(gpus)} GPU(s) in {time.perf_counter() - t0:.2f}s")
    for g in gpus:
        print(f"      {g.index}: {g.model} {g.memory_mb} MiB {g.uuid} nvlink_domain={g.nvlink_domain}")
    print(f"      NVLink P2P pairs: {backend.nvlink_pairs()}")
    bus_ids, links = backend.nvlink_links()
    print(f"      bus ids: {bus_ids}")
    print(f"      active links per GPU: {[len(lk) for lk in links]} {links if sum(map(len, links)) < 40 else ''}")
    ok(f"NVLink domains {backend.nvlink_domains()}")
    for i, m in backend.mig().items():  # MIG mode and GPU-instance profiles (docs/gpu-sharing.md)
        made = ", ".join(f"{p.name} x{p.instances} ({p.remaining} free)" for p in m.profiles) or "no profiles"
        print(f"      MIG {i}: mode {m.mode} (pending {m.pending}): {made}")
        if m.mode == "enabled":  # the instances made on it, as a MIG job would be given them
            slices, error = backend.read_mig(i)
            for s in slices:
                caps = " ".join(f"{d.path} ({d.major}:{d.minor})" for d in s.devices)
                print(f"        {s.profile} GPU instance {s.gi} compute instance {s.ci}: {s.uuid} {caps}")
            print(f"        {len(slices)} MIG instance(s)" + (f"; FAIL reading them: {error}" if error else ""))
    ok("MIG modes read")
    t0 = time.perf_counter()
    samples = backend.sample()
    ok(f"sample in {(time.perf_counter() - t0) * 1000:.1f} ms")
    for s in samples:
        print(f"      {json.dumps({k: getattr(s, k) for k in s.__struct_fields__})}")
    print_used(samples)
    if index >= len(gpus):
        fail(f"no GPU {index}")

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(index), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    child = subprocess.Popen([sys.executable, "-c", CUDA_CHILD, "60"], env=env, stdout=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline().strip()
        if line != "cuda context ready":
            fail(f"the CUDA child did not start (exit {child.poll()}): {line!r}")
        sample = wait_for_pid(backend, index, child.pid, True)
        if sample is None:
            others = {s.index: s.pids for s in backend.sample()}
            fail(f"pid {child.pid} not listed on GPU {index} (processes per GPU: {others}); "
                 "in a container NVML may list host pids")
        ok(f"pid {child.pid} on GPU {index} (CUDA_VISIBLE_DEVICES={index}): memory used {sample.memory_used_mb} MiB, "
           f"utilization {sample.utilization_pct:.0f}% (a context that computes nothing: idle)")
        wrong = [s.index for s in backend.sample() if child.pid in s.pids and s.index != index]
        if wrong:
            fail(f"pid also seen on GPUs {wrong}: CUDA and NVML disagree on the numbering")
        ok("CUDA_VISIBLE_DEVICES index == NVML index (PCI bus order)")
    finally:
        child.kill()
        child.wait()
    if wait_for_pid(backend, index, child.pid, False) is None:
        fail(f"pid {child.pid} still listed after it exited")
    ok("gone from the process list after exit")
    backend.close()


def print_used(samples) -> None:
    """What the reconciler concludes from each GPU (defaults: idle under 5%, leaked from 1024 MB
    with no process): nvmlDeviceGetUtilizationRates, nvmlDeviceGetMemoryInfo and
    nvmlDeviceGetComputeRunningProcesses, as the heartbeat carries them."""
    for s in samples:
        state = "idle" if s.utilization_pct < 5.0 else "busy"
        if not s.pids and s.memory_used_mb >= 1024:
            state += ", memory in use with no process (would be quarantined as leaked if nothing holds it)"
        print(f"      GPU {s.index}: utilization {s.utilization_pct:.0f}%, memory {s.memory_used_mb}/"
              f"{s.memory_total_mb} MiB, processes {s.pids or '-'}: {state}")
    ok("used-versus-held fields read")


async def check_agent(index: int) -> None:
    from gpusched.bus.cas import append_cas
    from gpusched.bus.log import EventLog
    from gpusched.bus.servers import start_nats
    from gpusched.core import events as ev
    from gpusched.core.model import JobSpec
    from gpusched.services.nodeagent.agent_config import AgentConfig
    from gpusched.services.nodeagent.backends import NvmlBackend
    from gpusched.services.nodeagent.host import NodeHost
    from gpusched.services.runtime import FoldedLog

    server = start_nats()
    work = Path(tempfile.mkdtemp(prefix="gpusched-nvml-check-"))
    try:
        host = await NodeHost.open(server.url, heartbeat_s=0.5)
        agent = host.add(AgentConfig(node="gpu-node", address="127.0.0.1", work_dir=work, kill_grace_s=2), NvmlBackend())
        await host.start()
        log = await EventLog.open(server.url)
        watch = FoldedLog(log)
        await watch.start()
        await watch.catch_up()
        if "gpu-node" not in watch.state.nodes:
            fail("node not registered")
        ok(f"registered {len(watch.state.nodes['gpu-node'].gpus)} GPUs")
        spec = JobSpec(team="t", gpus=1, command=[sys.executable, "-c", CUDA_CHILD, "60"])
        await append_cas(watch, [ev.JobSubmitted(at=time.time(), job_id="probe", spec=spec)])
        await watch.catch_up()
        await append_cas(watch, [ev.GpusGranted(at=time.time(), job_id="probe", attempt=1, gpus=[f"gpu-node/{index}"])])
        deadline = time.monotonic() + 30
        pid = None
        while time.monotonic() < deadline:
            runs = list(agent.jobs.values())
            if runs:
                pid = runs[0].proc.pid
                hb = agent.heartbeat()
                if pid in hb.gpus[index].pids:
                    break
            await asyncio.sleep(0.5)
        else:
            fail(f"job pid {pid} never appeared on GPU {index} in the heartbeat")
        ok(f"job pid {pid} runs on GPU {index} per the heartbeat")
        await append_cas(watch, [ev.JobCancelled(at=time.time(), job_id="probe")])
        deadline = time.monotonic() + 15
        while agent.jobs and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        if agent.jobs:
            fail("cancelled job still running")
        ok("cancel killed it")
        await watch.stop()
        await log.close()
        await host.stop()
    finally:
        server.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", type=int, default=0, help="GPU index for the process checks")
    ap.add_argument("--agent", action="store_true", help="also run a node daemon against a throwaway NATS")
    args = ap.parse_args()
    from gpusched.services.nodeagent.backends import BackendUnavailable

    print("NVML backend:")
    try:
        check_backend(args.gpu)
    except BackendUnavailable as err:
        print(f"FAIL  {err}")
        return 2
    if args.agent:
        print("node daemon with the NVML backend:")
        asyncio.run(check_agent(args.gpu))
    print("all checks passed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
