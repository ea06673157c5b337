"""Deterministic workflow code and the data contracts it exchanges. No I/O here."""
