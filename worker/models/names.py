"""The names of the built-in models, importable without torch: `kvserve launch`, `kvserve-core`
and `kvserve demo` check a --model against them before any process starts, and a launcher that
imported the models (and torch with them) would pay seconds of CPU to start and to exit.
registry.py maps each name to its model and refuses to load if the two lists disagree.
"""

MODEL_NAMES = (
    "checksum",
    "fixed-time",
    "tiny-llama",
    "tiny-llama-hybrid",
    "tiny-llama-hybrid-2x",
    "tiny-local",
    "tiny-mla",
    "tiny-encdec",
    "tiny-mamba-hybrid",
)
ENCODER_DECODER_MODEL_NAMES = ("tiny-encdec",)  # each request must bring encoder_token_ids
