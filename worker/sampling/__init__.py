"""The parts of sampling beyond the draw (worker/sampler.py): per-request settings as columns,
penalties on the logits, top-k/top-p/min-p filters on the probabilities, and logprobs."""
