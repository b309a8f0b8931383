"""The engine core: scheduler, KV cache manager, block pool, encoder cache manager."""
