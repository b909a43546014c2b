"""Paged KV-cache bookkeeping: blocks, the free queue, hashing, the pool, managers, coordinators."""
