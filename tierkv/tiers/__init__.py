"""The tiers: they hold and move bytes, nothing else.

Placement, reference counts and eviction belong to the store; a tier never decides what to keep.
"""
