"""The weight cache: a model's weights converted, fused and packed once, then memory-mapped by
every engine on the node, so an engine's load is a map, not a conversion.

    load(path, ops, cache_dir=None, threads=None) -> LoadedModel   (weights in runtime form)

Life cycle of a load:

1. **Key**: blake3 over the file format version, the source's bytes, the layout the kernels run
   on (``layout_of(ops)``: ``q16`` packed groups or row-major ``rows``) and the converter (the
   source text of the files that decide the bytes, the gguf and torch versions). The source is
   hashed whole, not sampled: a model re-quantized in place can keep its size and mtime, and
   blake3 reads ~3 GB/s on one core (30 ms for the bundled 98 MB GGUF), cheaper than parsing
   its header; a multi-GB model pays ~0.3 s per GB at start-up for never running stale weights.
2. **Map**: ``<dir>/<model>-<key>.tqw`` is opened read-only and checked (magic, version, file
   size, blake3 of the header and index, blake3 of the data); its tensors are read-only views of
   one ``MAP_SHARED`` mapping, so every engine on the node shares the same page-cache pages.
   Config, identity and tokenizer come from the index too: the source is not parsed again.
3. **Build** (a miss, or a file that fails a check: logged, never used): take ``<dir>/.build.lock``
   (flock; one conversion per node at a time, the other engines wait here and then map what it
   wrote), look again, convert with ``threads`` threads, write ``<file>.tmp<pid>``, fsync, rename
   into place (readers see the old file or the whole new one), then map it.

A cache directory that cannot be written is warned about and the model is converted in memory.
Cache files unused for ``KEEP_DAYS`` are removed when another one is built.

File layout (little endian):

    [0, 40)    magic b"TQWCACHE", u32 format version, u32 index length, u64 data offset,
               u64 data length, u64 file size
    [40, 72)   blake3 of bytes [0, 40) + the index
    [72, ...)  index: JSON (key, source, layout, identity, config, tokenizer, data blake3, tensors,
               aliases)
    data       at a page boundary; each tensor at a multiple of 64 bytes
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import json
import logging
import mmap
import os
import re
import struct
import tempfile
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import torch

from shared.engine.config import ModelConfig
from shared.engine.loader import LoadedModel, load_model, release_freed_memory
from shared.engine.model_files import ModelLoadError, bundled_model_path, safetensors_files
from shared.engine.model import runtime_weights
from shared.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

MAGIC = b"TQWCACHE"
FORMAT_VERSION = 1
HEADER = struct.Struct("<8sIIQQQ")  # magic, version, index length, data offset, data length, file size
DIGEST = 32                         # blake3 of header + index, right after the header
PAGE = 4096
ALIGN = 64                          # every tensor starts on a cache line (the kernels' 64-byte loads)
SUFFIX = ".tqw"
KEEP_DAYS = 14
# torch threads converting a model: the conversion runs torch ops over 256-row chunks, too small
# for a thread team to pay off, and a team whose threads wait on cores other processes hold stalls
# at every op (measured on a busy 2-core box: load_model 7.4 s on one thread, 65 s on two)
LOAD_THREADS = 1
_HERE = Path(__file__).resolve().parent
# the files whose code decides the cached bytes (conversion, fusion, packing)
CONVERTER_SOURCES = (_HERE / "loader.py", _HERE / "model_files.py", _HERE / "model.py", Path(__file__).resolve(),
                     _HERE.parent.parent / "kernels" / "q4_0.py", _HERE.parent.parent / "kernels" / "q4_0_cpu.cpp",
                     _HERE.parent.parent / "kernels" / "q4_0_cpu.h")


class CacheFileError(ValueError):
    """A cache file that must not be used (truncated, corrupt, another format or key)."""


def default_dir() -> str:
    """``$TANDEM_WEIGHT_CACHE_DIR`` or ``~/.cache/tandem/weights`` (empty: no cache)."""
    return os.environ.get("TANDEM_WEIGHT_CACHE_DIR", "~/.cache/tandem/weights")


def layout_of(ops) -> str:
    """The form ``ops`` runs weights in: ``q16`` (``kernels.cpu.PackedQ4``) or ``rows`` (Q4_0 rows)."""
    fn = getattr(ops, "weight_layout", None)
    return fn() if fn is not None else "rows"


def _hasher():
    from blake3 import blake3

    return blake3(max_threads=1)  # one core: never competes with the engines starting beside it


def source_digest(path: str) -> str:
    """blake3 of every byte of the model: the file, or a directory's config and safetensors files."""
    h = _hasher()
    files = [path] if os.path.isfile(path) else [os.path.join(path, "config.json"), *safetensors_files(path)]
    for f in files:
        h.update(f"{os.path.basename(f)}:{os.path.getsize(f)};".encode())
        h.update_mmap(f)
    return h.hexdigest()


def converter_version() -> str:
    """A digest of what turns a source into cached bytes: this code, gguf's and torch's versions."""
    h = hashlib.sha256()
    for f in CONVERTER_SOURCES:
        h.update(f.read_bytes())
    h.update(f"gguf {importlib.metadata.version('gguf')} torch {torch.__version__}".encode())
    return h.hexdigest()


def cache_key(path: str, layout: str) -> str:
    h = hashlib.sha256(f"tqw {FORMAT_VERSION};{layout};{converter_version()};{source_digest(path)}".encode())
    return h.hexdigest()[:32]


def cache_path(cache_dir: str, path: str, key: str) -> Path:
    stem = os.path.basename(os.path.normpath(path))
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", stem.removesuffix(".gguf"))[:80]
    return Path(cache_dir) / f"{stem}-{key}{SUFFIX}"


# ---- writing -----------------------------------------------------------------------------------

def _parts(t) -> tuple[torch.Tensor, dict]:
    """(bytes to store as uint8 1-D, index entry without offset) of a runtime tensor."""
    from kernels.cpu import PackedQ4

    if isinstance(t, PackedQ4):
        return t.data.reshape(-1), {"dtype": "uint8", "shape": [t.data.numel()], "packed": [t.n, t.k]}
    t = t.detach().cpu().contiguous()
    return t.reshape(-1).view(torch.uint8), {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                                             "packed": None}


def index_meta(key: str, model: LoadedModel) -> dict:
    """What the index holds besides the tensors, for ``model`` (runtime form) under ``key``."""
    return {"key": key, "source": model.path, "layout": model.runtime, "identity": model.identity,
            "config": model.config.to_dict(), "tokenizer": model.tokenizer.to_dict()}


def write(dst: Path, weights: dict, meta: dict) -> None:
    """Write ``weights`` (runtime form) and ``meta`` (``index_meta``) to ``dst`` atomically: a temp file in the same directory, fsynced, renamed into place."""
    names = [n for n in weights if not (n == "embed" and weights["embed"] is weights["output"])]
    aliases = {"embed": "output"} if weights["embed"] is weights["output"] else {}
    entries, blobs, off = [], [], 0
    for name in names:
        data, entry = _parts(weights[name])
        off = -(-off // ALIGN) * ALIGN
        entries.append({"name": name, "offset": off, "nbytes": data.numel(), **entry})
        blobs.append((off, data))
        off += data.numel()
    data_len = off
    h = _hasher()
    pos = 0
    for o, data in blobs:  # the data digest over exactly the bytes written, padding included
        h.update(bytes(o - pos))
        h.update(memoryview(data.numpy()))
        pos = o + data.numel()
    index = json.dumps({**meta, "data_blake3": h.hexdigest(), "tensors": entries, "aliases": aliases},
                       sort_keys=True).encode()
    data_off = -(-(HEADER.size + DIGEST + len(index)) // PAGE) * PAGE
    header = HEADER.pack(MAGIC, FORMAT_VERSION, len(index), data_off, data_len, data_off + data_len)
    digest = _hasher().update(header).update(index).digest()
    tmp = dst.with_name(f"{dst.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(header + digest + index)
            f.write(bytes(data_off - f.tell()))
            for o, data in blobs:
                f.write(bytes(data_off + o - f.tell()))
                f.write(memoryview(data.numpy()))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dst)
    finally:
        if tmp.exists():
            tmp.unlink()


# ---- reading -----------------------------------------------------------------------------------

def read(src: Path, key: str | None = None) -> tuple[dict, dict]:
    """(runtime weights as read-only views of a shared mapping, index) of a cache file.
    Raises CacheFileError when any check fails (``key``: the file must be for this key)."""
    from kernels.cpu import PackedQ4

    with open(src, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < HEADER.size + DIGEST:
            raise CacheFileError(f"{size} bytes: shorter than the header")
        # the header and index read, not mapped: their pages (~2 MB, most of it the tokenizer) would
        # stay resident in the mapping for the engine's life
        head = f.read(HEADER.size + DIGEST)
        magic, version, index_len, data_off, data_len, file_size = HEADER.unpack_from(head, 0)
        if magic != MAGIC or version != FORMAT_VERSION:
            raise CacheFileError(f"magic {magic!r} version {version}, expected {MAGIC!r} version {FORMAT_VERSION}")
        if file_size != size or data_off + data_len != size or HEADER.size + DIGEST + index_len > data_off:
            raise CacheFileError(f"{size} bytes, the header says {file_size} (truncated or overwritten)")
        index_bytes = f.read(index_len)
        if _hasher().update(head[:HEADER.size]).update(index_bytes).digest() != head[HEADER.size:]:
            raise CacheFileError("header / index checksum mismatch")
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        index = json.loads(index_bytes)
        del index_bytes
        if key is not None and index.get("key") != key:
            raise CacheFileError(f"built for key {index.get('key')}, expected {key}")
        data = memoryview(mm)[data_off:data_off + data_len]
        try:
            if _hasher().update(data).hexdigest() != index["data_blake3"]:
                raise CacheFileError("data checksum mismatch")
        finally:
            data.release()
        weights = {}
        with warnings.catch_warnings():
            # the mapping is read-only on purpose: a write would segfault, never diverge silently
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            for e in index["tensors"]:
                t = torch.frombuffer(mm, dtype=torch.uint8, count=e["nbytes"], offset=data_off + e["offset"])
                if e["packed"]:
                    weights[e["name"]] = PackedQ4(t, *e["packed"])
                else:
                    weights[e["name"]] = t.view(getattr(torch, e["dtype"])).reshape(e["shape"])
        for alias, target in index["aliases"].items():
            weights[alias] = weights[target]
        return weights, index
    except CacheFileError:
        raise
    except (KeyError, TypeError, ValueError, struct.error) as e:  # the mapping goes with its last view
        raise CacheFileError(f"bad index: {e!r}") from None


# ---- load ---------------------------------------------------------------------------------------

def _build_lock(lock_file: Path) -> IO:
    """The node's conversion lock, held until the returned file is closed (``with``; flock: the
    kernel releases it if the holder dies)."""
    f = open(lock_file, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        t0 = time.monotonic()
        log.info("waiting for another process converting weights (%s)", lock_file)
        fcntl.flock(f, fcntl.LOCK_EX)
        log.info("weight conversion lock taken after %.1fs", time.monotonic() - t0)
    return f


@contextmanager
def _torch_threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def convert(path: str, ops, threads: int) -> LoadedModel:
    """``load_model(path)`` in runtime form for ``ops``, converted with ``threads`` threads."""
    with _torch_threads(threads):
        model = load_model(path)
        prepare = getattr(ops, "prepare", None)
        model.weights = runtime_weights(model.config, model.weights, prepare, consume=True)
    model.runtime = layout_of(ops)
    release_freed_memory()
    return model


def _try_read(file: Path, key: str) -> tuple[dict, dict] | None:
    """The cache file's contents, or None when it is absent or bad (a bad one is logged)."""
    try:
        out = read(file, key)
    except FileNotFoundError:
        return None
    except (CacheFileError, OSError) as e:
        log.warning("weight cache %s is unusable (%s): rebuilding it", file, e)
        return None
    try:
        os.utime(file)  # marks it used (KEEP_DAYS)
    except OSError as e:
        log.debug("cannot touch %s: %s", file, e)
    return out


def _prune(cache_dir: Path, keep: Path) -> None:
    """Remove temp files of dead builders and cache files unused for KEEP_DAYS (lock held)."""
    old = time.time() - KEEP_DAYS * 86400
    for f in cache_dir.iterdir():
        temp = f"{SUFFIX}.tmp" in f.name
        if f == keep or not (temp or f.name.endswith(SUFFIX)):
            continue
        try:
            if temp or f.stat().st_mtime < old:
                f.unlink()
        except OSError as e:
            log.debug("cannot prune %s: %s", f, e)


def load(path: str | None, ops, cache_dir: str | None = None, threads: int | None = None) -> LoadedModel:
    """The model at ``path`` (None: bundled) with its weights in ``ops``' runtime form, from the
    cache in ``cache_dir`` (None: ``default_dir()``; "": no cache), converting on a miss with
    ``threads`` threads (None: every core this process may use; conversions on a node take turns,
    so they never share the cores). Raises ModelLoadError."""
    path = bundled_model_path() if path is None else os.fspath(path)
    if not os.path.exists(path):   # said as load_tokenizer says it (the cache key would ask for safetensors)
        raise ModelLoadError(f"cannot load model {path}: no such file or directory")
    threads = threads or len(os.sched_getaffinity(0))
    cache_dir = default_dir() if cache_dir is None else cache_dir
    if not cache_dir:
        with _build_lock(Path(tempfile.gettempdir()) / f"tandem-convert-{os.getuid()}.lock"):
            return convert(path, ops, threads)
    t0 = time.monotonic()
    layout = layout_of(ops)
    try:
        key = cache_key(path, layout)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load model {path}: {e}") from None
    root = Path(os.path.expanduser(cache_dir))
    file = cache_path(str(root), path, key)
    found = _try_read(file, key)
    if found is None:
        try:
            root.mkdir(parents=True, exist_ok=True)
            lock = _build_lock(root / ".build.lock")
        except OSError as e:
            log.warning("weight cache %s is not writable (%s): converting in memory", root, e)
            return convert(path, ops, threads)
        with lock:
            found = _try_read(file, key)  # another engine may have built it while we waited
            if found is None:
                model = convert(path, ops, threads)
                try:
                    write(file, model.weights, index_meta(key, model))
                except OSError as e:
                    log.warning("weight cache %s cannot be written (%s): using the weights in memory", file, e)
                    return model
                del model
                release_freed_memory()
                log.info("weight cache written: %s (%.1f MB) in %.2fs", file, file.stat().st_size / 1e6,
                         time.monotonic() - t0)
                _prune(root, file)
                found = read(file, key)
    weights, index = found
    model = LoadedModel(config=ModelConfig(**index["config"]), weights=weights,
                        tokenizer=Tokenizer.from_dict(index.pop("tokenizer")), identity=index["identity"],
                        path=path, runtime=index["layout"])
    del found, index
    release_freed_memory()  # the index's text (the tokenizer's vocabulary) is garbage now
    log.info("weights mapped from %s in %.2fs", file, time.monotonic() - t0)
    return model
