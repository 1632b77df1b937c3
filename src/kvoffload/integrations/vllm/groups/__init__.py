"""KV cache groups (hybrid models), read by both sides.

- ``group_kinds``: the kinds of group kvoffload offloads, and the one-line refusal of others;
- ``group_slots``: which groups share a CPU slot space, how big a slot is, how many;
- ``window_keep``: keep the sliding-window chunks a hit at an earlier boundary needs.
"""
