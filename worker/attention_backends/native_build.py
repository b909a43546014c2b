"""The CPU kernels of native/, built at first use with the host's C++ compiler and loaded with
ctypes.

Why built here and not at install: the project installs as pure Python (`pip install -e .`), and
a build step would need torch inside pip's isolated build environment (a CUDA wheel of several
GB). The kernels carry no torch headers, so one build takes a few seconds: `c++ -O3
-march=native -fopenmp -ffast-math -c`, then a link without -ffast-math.

- The library is cached under `~/.cache/kvserve/native/`, named by a hash of the source (and
  the headers beside it), the flags, the compiler and this CPU's model and instruction-set
  flags, so a cache shared between different hosts never hands one a library built for
  another's instructions. Concurrent ranks each build to a temporary file and rename it into
  place; the last rename wins with identical bytes.
- It is loaded after torch, so its OpenMP runtime is torch's own libgomp (the same soname) and
  its parallel loops run on torch's threads.
- No compiler (`c++` or `g++` on the PATH), or a build that fails: `load_native()` returns None
  once, with a warning naming why, and the CPU attention falls back to the torch path (`blocks`),
  which computes the same.
- `--attention-backend blocks` skips the build altogether.
"""

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).resolve().parent / "native" / "paged_decode.cpp"
# Compiled with -ffast-math (vectorized expf and reductions) but linked without it: linking a
# shared library with it can add crtfastmath.o, which sets flush-to-zero for the whole process.
COMPILE_FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffast-math", "-fPIC", "-std=c++17", "-c")
LINK_FLAGS = ("-shared", "-fopenmp")
BUILD_TIMEOUT_S = 120.0

logger = logging.getLogger(__name__)


def cache_dir() -> Path:
    return Path.home() / ".cache" / "kvserve"


def _cpu_signature() -> str:
    """This CPU's model and instruction-set flags (Linux), else the machine's name."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine()
    fields = {}
    for line in text.splitlines():
        if not line.strip():
            break  # the first processor's block describes them all
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return "|".join(fields.get(key, "") for key in ("model name", "flags", "Features", "CPU part"))


def _library_path(compiler: str, source: Path) -> Path:
    digest = hashlib.sha256()
    flags = " ".join((*COMPILE_FLAGS, *LINK_FLAGS))
    # the source and the headers it includes from its folder (paged_decode_avx512.h)
    files = [source, *sorted(path for path in source.parent.iterdir() if path != source)]
    texts = [path.name.encode() + b"\0" + path.read_bytes() for path in files if path.is_file()]
    for part in (*texts, flags.encode(), compiler.encode()):
        digest.update(part)
        digest.update(b"\0")
    digest.update(_cpu_signature().encode())
    return cache_dir() / "native" / f"paged_decode-{digest.hexdigest()[:20]}.so"


def _build(compiler: str, source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    obj = temporary + ".o"
    try:
        for command in (
            [compiler, *COMPILE_FLAGS, str(source), "-o", obj],
            [compiler, *LINK_FLAGS, obj, "-o", temporary],
        ):
            result = subprocess.run(
                command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False
            )
            if result.returncode != 0:
                raise RuntimeError(
                    f"{' '.join(command)} exited {result.returncode}: "
                    f"{result.stderr.strip()[-2000:]}"
                )
        os.replace(temporary, target)
    finally:
        for path in (temporary, obj):
            if os.path.exists(path):
                os.unlink(path)


@functools.lru_cache(maxsize=1)
def load_native() -> ctypes.CDLL | None:
    """The kernels' library, built if this host has none cached; None where it cannot be."""
    return load_native_from(SOURCE)


def load_native_from(source: Path) -> ctypes.CDLL | None:
    """The library built from `source` (cached under its own hash), or None where it cannot be
    built. bench/native_attention.py builds an earlier revision's kernel with it."""
    import torch  # noqa: F401  (its libgomp must be loaded first: see the module docstring)

    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        logger.warning("no C++ compiler on the PATH (c++, g++): CPU attention gathers blocks")
        return None
    try:
        target = _library_path(compiler, source)
        if not target.is_file():
            _build(compiler, source, target)
        library = ctypes.CDLL(str(target))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning(
            "the native CPU attention kernel is unavailable (%s): CPU attention gathers blocks", exc
        )
        return None
    function = library.kvserve_paged_decode
    function.restype = ctypes.c_int
    function.argtypes = [
        ctypes.c_void_p,  # q
        ctypes.c_int,  # q_dtype
        ctypes.c_int64,  # q_token_stride
        ctypes.c_void_p,  # query_tokens
        ctypes.c_void_p,  # cache
        ctypes.c_int,  # dtype
        ctypes.c_int64,  # block_stride
        ctypes.c_int64,  # kv_stride
        ctypes.c_void_p,  # block_ids
        ctypes.c_int,  # blocks_per_seq
        ctypes.c_void_p,  # starts
        ctypes.c_void_p,  # ends
        ctypes.c_int,  # num_seqs
        ctypes.c_int,  # num_heads
        ctypes.c_int,  # num_kv_heads
        ctypes.c_int,  # head_dim
        ctypes.c_int,  # block_size
        ctypes.c_float,  # scale
        ctypes.c_float,  # softcap (0: none)
        ctypes.c_void_p,  # out
        ctypes.c_int,  # out_dtype
        ctypes.c_int64,  # out_token_stride
        ctypes.c_int,  # num_threads
    ]
    return library
