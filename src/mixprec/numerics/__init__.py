"""Diagnostics of what number formats do to training: the numerics probe that measures ranges,
underflow and overflow layer by layer (probe.py, with its arithmetic in probe_stats.py), the first
non-finite event in time order (events.py) and the rules that name the mechanism (verdicts.py)."""
