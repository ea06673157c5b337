"""Helpers the test folders share: fakes, rigs, and the stack's test-side clients."""
