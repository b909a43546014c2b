"""Block hashes are the same in another interpreter: they must never depend on Python's per-process
hash() randomisation or on pickle. It starts a process, so it lives with the integration tests."""

import json
import os
import subprocess
import sys

import pytest

from engine_core.kv_cache.hashing import HASH_ALGOS, BlockHasher, first_block_extra_keys

pytestmark = pytest.mark.integration

BLOCK_SIZE = 4
SUBPROCESS_TIMEOUT_S = 60.0

# Recomputes the hashes of one token sequence in a fresh interpreter and prints them as hex.
SUBPROCESS_SCRIPT = """
import json, sys
from engine_core.kv_cache.hashing import HASH_ALGOS, BlockHasher
tokens, salt = json.loads(sys.argv[1]), sys.argv[2]
out = {}
for algo in HASH_ALGOS:
    hasher = BlockHasher(4, algo)
    out[algo] = [h.hex() for h in hasher.hash_prefix(tokens, (("cache_salt", salt),))]
print(json.dumps(out))
"""


@pytest.mark.timeout(120)
def test_hashes_are_identical_in_another_interpreter() -> None:
    """Guards against any dependence on Python's per-process hash() randomisation or pickle."""
    tokens, salt = list(range(100, 113)), "tenant-a"
    env = dict(os.environ, PYTHONHASHSEED="12345")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    result = subprocess.run(
        [sys.executable, "-c", SUBPROCESS_SCRIPT, json.dumps(tokens), salt],
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
        env=env,
        cwd=root,
        check=True,
    )
    theirs = json.loads(result.stdout)
    for algo in HASH_ALGOS:
        ours = BlockHasher(BLOCK_SIZE, algo).hash_prefix(tokens, first_block_extra_keys(salt))
        assert theirs[algo] == [h.hex() for h in ours]
        assert len(ours) == 3
