"""CURVE key files: `kvserve keygen DIR` writes them, and `--curve-keys-dir DIR` loads one role's
keys into a CurveKeys config. Only this module reads key files; engine_core/ and worker/ get
the keys in their configs. It never overwrites a secret key unless told to.
"""

import argparse
import os
from pathlib import Path
from typing import Literal

import zmq
import zmq.auth

from deploy.flags import UsageError
from protocol.config import CurveKeys

Role = Literal["engine", "worker", "client"]
ROLES: tuple[Role, ...] = ("engine", "worker", "client")
AUTHORIZED_FOLDER = "authorized"  # the public keys the engine admits, one file each
KEYS_FLAG = "--curve-keys-dir"
DIR_MODE = 0o700  # the key folder and its authorized/ folder
SECRET_MODE = 0o600
PUBLIC_MODE = 0o644


def add_keys_flag(parser: argparse.ArgumentParser, role: Role) -> None:
    parser.add_argument(
        KEYS_FLAG,
        metavar="DIR",
        help=f"folder written by `kvserve keygen`: CURVE on, with the {role} keys found there; "
        "default off",
    )


def keys_from(args: argparse.Namespace, role: Role) -> CurveKeys | None:
    """The keys of `role` from --curve-keys-dir, or None when the flag was not given."""
    folder = getattr(args, "curve_keys_dir", None)
    return None if folder is None else load_curve_keys(Path(folder), role)


def keygen(folder: Path, is_forced: bool = False) -> list[Path]:
    """Write a keypair per role and authorized/ with the worker and client public keys; the
    files written. UsageError when a secret key exists and `is_forced` is False."""
    existing = [folder / f"{role}.key_secret" for role in ROLES]
    existing = [path for path in existing if path.exists()]
    if existing and not is_forced:
        raise UsageError(f"{existing[0]} exists: pass --force to replace every key in {folder}")
    authorized = folder / AUTHORIZED_FOLDER
    for path in (folder, authorized):
        path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        os.chmod(path, DIR_MODE)  # mkdir's mode is masked by the umask
    for stale in authorized.glob("*.key"):
        stale.unlink()  # --force: the old keys must no longer be admitted
    written = []
    for role in ROLES:
        public_file, secret_file = (Path(p) for p in zmq.auth.create_certificates(folder, role))
        os.chmod(secret_file, SECRET_MODE)
        os.chmod(public_file, PUBLIC_MODE)
        written += [public_file, secret_file]
        if role != "engine":
            copy = authorized / public_file.name
            copy.write_bytes(public_file.read_bytes())
            os.chmod(copy, PUBLIC_MODE)
            written.append(copy)
    return written


def load_curve_keys(folder: Path, role: Role) -> CurveKeys:
    """The keypair of `role`, the engine's public key and, for the engine, authorized/."""
    public_key, secret_key = _load(folder / f"{role}.key_secret", need_secret=True)
    server_public_key, _ = _load(folder / "engine.key", need_secret=False)
    authorized: list[str] = []
    if role == "engine":
        files = sorted((folder / AUTHORIZED_FOLDER).glob("*.key"))
        if not files:
            raise UsageError(
                f"{KEYS_FLAG} {folder}: no public keys in {folder / AUTHORIZED_FOLDER}: "
                f"run `kvserve keygen {folder}`"
            )
        authorized = [_load(path, need_secret=False)[0] for path in files]
    return CurveKeys(public_key, secret_key, server_public_key, authorized)


def _load(path: Path, need_secret: bool) -> tuple[str, str]:
    try:
        public_key, secret_key = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise UsageError(
            f"{KEYS_FLAG} {path.parent}: cannot read {path.name} ({exc}): "
            f"run `kvserve keygen {path.parent}`"
        ) from None
    if need_secret and secret_key is None:
        raise UsageError(f"{KEYS_FLAG} {path.parent}: {path.name} holds no secret key")
    return public_key.decode(), (secret_key or b"").decode()


def keygen_command(args: argparse.Namespace) -> int:
    folder = Path(args.dir)
    for path in keygen(folder, args.force):
        print(path)
    print(f"pass {KEYS_FLAG} {folder} to kvserve-core, kvserve-worker and clients")
    return 0
