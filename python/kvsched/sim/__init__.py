"""Replaying request traces through the real scheduler, in virtual time.

`traces` reads the bundled real traces; `prefix_replay` replays
mooncake_synthetic.jsonl to measure the prefix cache's hit rate.
"""
