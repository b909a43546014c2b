"""Parallel sampling (`n` > 1): a prompt's n choices are n engine requests, sent together to one
engine, each with its own seed.

Why the front end fans out rather than the engine forking a request: the engine caches a block's
hash as soon as it allocates the block (KVCacheManager.allocate_slots), and the ranks write a
step's KV before any attention reads it, so the choices scheduled in the step that computes the
prompt's full blocks already find them as prefix hits; later ones find them in the cache. Every
full block of the prompt is computed once and shared by reference counts (each choice's
`num_cached_tokens` shows its hit), the engine's request stays one sequence, and scheduling,
preemption, recovery and aborts need no parent/child bookkeeping. This is vLLM v1's choice too (its
front end's ParentRequest). What is not shared: the prompt's last, partial block, which every
choice computes itself (it is where they diverge). With several engines, a prompt's choices share
one ChoiceGroup (api_server.routing): the first choice is routed as any request is, and the
others follow it to its engine (EnginePool.generate), whatever the policy, so they find its
blocks there. Without prefix
caching (--no-enable-prefix-caching), or with prompt_logprobs (which reads no cache), each choice
computes the prompt itself.
"""

import hashlib

from protocol.sampling import SEED_LIMIT

MAX_CHOICES_PER_PROMPT = 128  # n at most: each choice is a request the engine holds; OpenAI's bound


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice `index` of a request seeded `seed`.

    Choice 0 keeps the request's seed, so `n=1` gives choice 0 of `n=4`; the others get seeds
    derived from (seed, index), distinct so that their draws differ and fixed so that they repeat
    run after run. An unseeded request's choices stay unseeded: each engine request then draws
    from its own stream (the sampler seeds it from its handle), independently.
    """
    if seed is None or index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (SEED_LIMIT + 1)
