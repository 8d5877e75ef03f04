"""On-disk cache of a model's int4 layout, so that later loads skip quantizing and packing.

The cache holds the model's whole loaded state (packed int4 weights, scales and the unquantized
tensors) in the layout the model runs (with Anna's CPU kernels: their row lanes, a conversion of
about a second for a 0.5B model), as safetensors files plus a manifest. It lives in
``{model}/.anna/int4_cache/<key>`` (or ``int4_cache_dir``; in the user cache dir when the model
dir is read-only). The key covers the model files' identity (names, sizes, mtimes), the group
size, the torch version, the device capability and the layout, so anything that changes the
layout selects another entry. Every file's size and sha256 are checked before use: a stale,
truncated or corrupt entry is rebuilt, never used. Writes go to a temporary directory renamed
into place, so a crash mid-write leaves nothing that loads.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

log = logging.getLogger(__name__)

FORMAT_VERSION = 4  # 2: entries hold the kernels' layout; 3: fp16 group scales; 4: int4 blocks in pairs
MANIFEST = "manifest.json"


def cache_key(files: list[Path], group: int, device: str, layout: str, parts: tuple[str, ...] = ()) -> str:
    """``device``: the platform's ``capability()`` (an entry is only read where it was written);
    ``parts``: optional parts of the model that were built (e.g. the multi-token-prediction head)."""
    ident = {"format": FORMAT_VERSION, "group": group, "torch": torch.__version__,
             "device": device, "layout": layout, **({"parts": list(parts)} if parts else {}),
             "files": [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:24]


def cache_root(model_dir: Path, override: str, user_cache_dir: str) -> Path:
    """Where entries live: the override, else {model}/.anna/int4_cache, else (read-only model dir)
    the user cache dir."""
    if override:
        return Path(override).expanduser()
    preferred = model_dir / ".anna" / "int4_cache"
    try:
        preferred.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=preferred, prefix=".probe")
        probe.close()
        return preferred
    except OSError:
        digest = hashlib.sha256(str(model_dir.resolve()).encode()).hexdigest()[:16]
        return Path(user_cache_dir).expanduser() / "int4_cache" / digest


def file_sha256(path: Path) -> str:
    """A file's SHA-256, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def load_entry(entry: Path, workers: int) -> dict[str, torch.Tensor] | None:
    """The cached state, or None when the entry is missing or fails any check."""
    manifest_path = entry / MANIFEST
    if not manifest_path.exists():
        return None
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
        log.warning("int4 cache %s: unreadable manifest (%s): rebuilding", entry, exc)
        return None

    def read(name: str) -> dict[str, torch.Tensor] | None:
        path = entry / name
        meta = files[name]
        if not path.exists() or path.stat().st_size != meta["size"] or file_sha256(path) != meta["sha256"]:
            return None
        try:
            return load_file(str(path))
        except (SafetensorError, OSError):
            return None

    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="anna-int4-cache") as pool:
        parts = list(pool.map(read, files))
    if any(p is None for p in parts):
        log.warning("int4 cache %s: a file is missing, truncated or corrupt: rebuilding", entry)
        return None
    state: dict[str, torch.Tensor] = {}
    for part in parts:
        state.update(part)
    return state


def save_entry(entry: Path, state: dict[str, torch.Tensor], num_files: int) -> None:
    """Write atomically: into a temporary sibling directory, then rename it into place."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=entry.name + ".tmp-", dir=entry.parent))
    try:
        buckets: list[dict[str, torch.Tensor]] = [{} for _ in range(max(1, num_files))]
        sizes = [0] * len(buckets)
        for name, t in sorted(state.items(), key=lambda kv: -kv[1].numel() * kv[1].element_size()):
            i = sizes.index(min(sizes))  # balance bytes so that parallel loads finish together
            buckets[i][name] = t.detach().contiguous().cpu()
            sizes[i] += t.numel() * t.element_size()
        files = {}
        for i, bucket in enumerate(b for b in buckets if b):
            name = f"part-{i:03d}.safetensors"
            save_file(bucket, str(tmp / name))
            files[name] = {"size": (tmp / name).stat().st_size, "sha256": file_sha256(tmp / name)}
        (tmp / MANIFEST).write_text(json.dumps({"format": FORMAT_VERSION, "files": files}, indent=1))
        if entry.exists():
            shutil.rmtree(entry)
        os.replace(tmp, entry)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
