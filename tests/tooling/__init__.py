"""Tests of the project's tooling (simulators, dev stack, bench, soak audit), not its product."""
