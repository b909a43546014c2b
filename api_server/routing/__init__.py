"""Routing across data-parallel engines: the engine pool and one record per engine, the routing
policies and the one Router that applies them, the KV-event index, its subscriber and the kv
policy's scorer, and the two-phase flow of disaggregated prefill and decode.

The package's interface to the rest of the front end is what this module exports: the pool that
takes engine requests and the group that keeps a prompt's choices on one engine. It imports
nothing of the OpenAI protocol (api_server.openai) nor of the tokenizer.
"""

from api_server.routing.engine_pool import ChoiceGroup, EnginePool

__all__ = ["ChoiceGroup", "EnginePool"]
