"""The OpenAI protocol surface of the front end: request and response bodies (protocol.py), how
one request becomes engine requests (engine_requests.py) and its outputs a response (serving.py),
with what serving needs of the protocol: structured outputs, tool calls and their parsers,
reasoning, logprobs, stop strings, ignored fields, generation-config defaults and `n` choices.

It submits engine requests through api_server.routing's package interface (EnginePool,
ChoiceGroup) and tokenizes through api_server.tokenizer; neither of those imports it.
"""
