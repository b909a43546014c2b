"""The OpenAI-compatible HTTP front end, in three packages and the two modules that join them:

- `openai/`: the OpenAI protocol surface (request and response bodies, serving, structured
  outputs, tools, reasoning, logprobs, stop strings, `n` choices, /tokenize);
- `routing/`: the engine pool, one EngineRecord per engine, the Router and its policies, the
  KV-event index and subscriber, and disaggregated prefill and decode;
- `tokenizer/`: tokenizers, chat templates and the shipped byte-level tokenizer files;
- `app.py`, the Starlette app, and `metrics.py`, its /metrics: they sit at the top because each
  joins all three (the app builds the pool, the tokenizer and serving from flags; /metrics reads
  the HTTP counts, serving's latencies and the pool's records).

openai reaches routing only through what `api_server.routing` exports; routing and tokenizer
import neither openai nor each other (tests/unit/test_layering.py checks it). The front end
reaches engines only through engine_client (requests and utility calls) and their KV-event
streams (routing/kv_event_subscriber.py, on sockets engine_client.connection configures); it
never imports the engine's internals, the workers or deploy/.
"""
