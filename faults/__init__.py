"""Chaos harness: real processes, real faults, and a recorder of what the job looked like meanwhile.

Used by tests/stack/test_chaos.py and by `make demo-chaos` (faults/demo.py). Nothing here
imports pytest, so the demo can use it too.
"""
