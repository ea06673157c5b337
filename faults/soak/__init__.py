"""`make soak`: N minutes of mixed, detached jobs on every pool kind under a random fault every
F seconds, then an audit of what the system promises (docs/reliability.md).

One job per module: the stack (stack.py, endpoints.py, comfy_factory.py), the job mix (mix.py)
and its driver (driver.py), the fault injector (injector.py: when and where, each fault
itself faults/inject.py's), the evidence (evidence.py, collect.py), the audit (audit.py) and the
report (report.py); run.py puts them in order.
"""
