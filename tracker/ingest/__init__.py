"""The tracker service: consumes engines' KV-event streams (sequence numbers, replay on
gaps, restart fencing) into the block index; ``kvrouter tracker`` and ``kvrouter lookup``,
and :mod:`tracker.ingest.embedded` for a router that keeps its own index.
"""
