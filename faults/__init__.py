"""Fault tooling: real processes, real faults, and what a job looked like meanwhile. It stays in
the repository: the wheel ships devstack/ (the stack and simulators `durable-comfy dev` runs) and
nothing of this.

- inject.py: every fault, implemented once (a worker or a service `kill -9`ed and started again,
  a ComfyUI simulator's socket cut or stalled, a RunPod worker crashed, frozen or cut off from
  S3, API bursts, ...);
- the chaos harness the tests and the demo share: harness.py (a stack of its own, one test's
  moving parts), sim.py (the ComfyUI simulator's controls and step watcher), timeline.py (a
  job's status over time), worker_proc.py (`python worker.py` as a killable process),
  graphs.py, wait.py;
- demo.py: `make demo-chaos`;
- soak/: `make soak`.

Used by tests/stack/test_chaos.py, tests/stack/test_runpod_chaos.py, `make demo-chaos` and
`make soak`. Nothing here imports pytest, so the demo and the soak can use it too.
"""
