"""Disaggregated prefill and decode on the engine (DESIGN.md §12): a prefill engine's pins and a
decode engine's pulls. Plain Python over the block pool; the ranks move the pages."""
