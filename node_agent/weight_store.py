"""Host weight store: the full model placed once per host in shared memory (engine-agnostic).

Workers load their shard from it on every switch (RELOAD_SHARDS) through the ``remp_shm`` model
loader: no disk I/O, no download, only a safetensors header read and memory copies.
"""

from __future__ import annotations

import json
import mmap
import shutil
import struct
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

from remp.topology import stage_range


@dataclass
class WeightStore:
    path: Path
    nbytes: int

    @classmethod
    def create(cls, model_dir: Path, root: Path, name: str) -> "WeightStore":
        from remp.errors import ConfigError  # lazy: the GPU data-path benchmark runs without grpc

        files = sorted(Path(model_dir).glob("*.safetensors"))
        if not files:
            raise ConfigError(f"the weight store needs safetensors files in {model_dir}")
        need = sum(f.stat().st_size for f in files)
        root.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(root).free
        if need > free:
            raise ConfigError(f"weight store needs {need} bytes in {root}, only {free} free")
        path = root / name
        path.mkdir(parents=True, exist_ok=True)
        for f in files:
            shutil.copyfile(f, path / f.name)
        return cls(path, need)

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


# ------------------------------------------------------------------ CUDA-aware shard loading
#
# Engine-agnostic: plain torch, no vLLM. The store's safetensors files are mapped once per worker
# process (MAP_SHARED, pre-faulted) and, on CUDA, page-locked with cudaHostRegister so the copy
# engines read the store directly: a TP shard cut along dimension 0 is one contiguous DMA, a cut
# along dimension 1 one pitched (2D) DMA; no host-side copy at all. Without page-locking, pieces
# go through a small ring of pinned staging buffers (CPU copy of chunk k+1 overlaps the DMA of
# chunk k).

_ST_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


def read_safetensors_header(path: Path) -> tuple[int, dict]:
    """(data offset, header) of one safetensors file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return 8 + n, header


@dataclass(frozen=True)
class ShardPiece:
    """Rows/columns [start, start+length) along ``dim`` of store tensor ``key`` (whole tensor when
    ``dim`` is None) go to rows [row, row + n) of this rank's parameter ``param``."""

    key: str
    dim: int | None
    start: int
    length: int
    param: str
    row: int = 0


def llama_shard_pieces(cfg: dict, tp: int, pp: int, rank: int
                       ) -> tuple[dict[str, tuple], list[ShardPiece]]:
    """The parameters (vLLM's merged Llama layout) of rank ``rank`` = stage·TP + tp_rank and the
    store pieces that fill them: q/k/v → ``qkv_proj`` and gate/up → ``gate_up_proj`` cut along
    dimension 0, o/down cut along dimension 1, embedding and LM head cut by vocabulary (first and
    last stage), norms replicated. ``cfg``: HF config keys (num_hidden_layers, hidden_size, ...)."""
    L, h = cfg["num_hidden_layers"], cfg["hidden_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    inter, vocab = cfg["intermediate_size"], cfg["vocab_size"]
    hd = h // nh
    if nh % tp or nkv % tp or not 1 <= pp <= L or inter % tp or vocab % tp:
        raise ValueError(f"TP{tp}PP{pp} cannot shard this model (TP must divide the heads, KV "
                         "heads, FFN and vocabulary; PP be at most the layers)")
    stage, r = divmod(rank, tp)
    q, kv, i, v = nh * hd // tp, nkv * hd // tp, inter // tp, vocab // tp
    params: dict[str, tuple] = {}
    pieces: list[ShardPiece] = []
    if stage == 0:
        params["model.embed_tokens.weight"] = (v, h)
        emb = "model.embed_tokens.weight"
        pieces.append(ShardPiece(emb, 0, r * v, v, emb))
    for ly in stage_range(L, pp, stage):
        pre = f"model.layers.{ly}."
        qkv, o = pre + "self_attn.qkv_proj.weight", pre + "self_attn.o_proj.weight"
        gate_up, down = pre + "mlp.gate_up_proj.weight", pre + "mlp.down_proj.weight"
        params[qkv] = (q + 2 * kv, h)
        pieces += [ShardPiece(pre + "self_attn.q_proj.weight", 0, r * q, q, qkv, 0),
                   ShardPiece(pre + "self_attn.k_proj.weight", 0, r * kv, kv, qkv, q),
                   ShardPiece(pre + "self_attn.v_proj.weight", 0, r * kv, kv, qkv, q + kv)]
        params[o] = (h, q)
        pieces.append(ShardPiece(pre + "self_attn.o_proj.weight", 1, r * q, q, o))
        params[gate_up] = (2 * i, h)
        pieces += [ShardPiece(pre + "mlp.gate_proj.weight", 0, r * i, i, gate_up, 0),
                   ShardPiece(pre + "mlp.up_proj.weight", 0, r * i, i, gate_up, i)]
        params[down] = (h, i)
        pieces.append(ShardPiece(pre + "mlp.down_proj.weight", 1, r * i, i, down))
        for norm in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            params[pre + norm] = (h,)
            pieces.append(ShardPiece(pre + norm, None, 0, h, pre + norm))
    if stage == pp - 1:
        params["model.norm.weight"] = (h,)
        pieces.append(ShardPiece("model.norm.weight", None, 0, h, "model.norm.weight"))
        params["lm_head.weight"] = (v, h)
        pieces.append(ShardPiece("lm_head.weight", 0, r * v, v, "lm_head.weight"))
    return params, pieces


def _loaded_cudart():
    """ctypes handle on the CUDA runtime torch already loaded (for cudaMemcpy2DAsync)."""
    import ctypes

    with open("/proc/self/maps") as f:
        paths = sorted({ln.split()[-1] for ln in f if "libcudart.so" in ln})
    lib = ctypes.CDLL(paths[0] if paths else "libcudart.so")
    fn = lib.cudaMemcpy2DAsync
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                   ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    return fn


@dataclass
class MappedStore:
    """A weight store's files mapped into this process; tensors are zero-copy views."""

    path: Path
    pinned: bool = False
    map_seconds: float = 0.0
    pin_seconds: float = 0.0
    nbytes: int = 0
    _maps: list = field(default_factory=list)
    _bufs: list = field(default_factory=list)
    _index: dict = field(default_factory=dict)

    @classmethod
    def open(cls, path: Path, pin: bool = False) -> "MappedStore":
        import time

        import torch

        st = cls(Path(path))
        t0 = time.perf_counter()
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        for f in sorted(Path(path).glob("*.safetensors")):
            off, header = read_safetensors_header(f)
            size = f.stat().st_size
            with open(f, "r+b") as fh:
                mm = mmap.mmap(fh.fileno(), size, flags=flags)
            buf = torch.frombuffer(mm, dtype=torch.uint8)
            st._maps.append(mm)
            st._bufs.append(buf)
            st.nbytes += size
            for key, meta in header.items():
                b, e = meta["data_offsets"]
                dtype = getattr(torch, _ST_DTYPES[meta["dtype"]])
                st._index[key] = (buf, off + b, off + e, dtype, tuple(meta["shape"]))
        st.map_seconds = time.perf_counter() - t0
        if pin:
            t0 = time.perf_counter()
            for buf in st._bufs:
                err = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel(), 0)
                torch.cuda.check_error(err)
            st.pinned = True
            st.pin_seconds = time.perf_counter() - t0
        return st

    def keys(self) -> list[str]:
        return list(self._index)

    def tensor(self, key: str):
        buf, b, e, dtype, shape = self._index[key]
        return buf[b:e].view(dtype).view(shape)

    def close(self) -> None:
        import torch

        if self.pinned:
            for buf in self._bufs:
                torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(buf.data_ptr()))
            self.pinned = False
        self._index.clear()
        self._bufs.clear()
        for mm in self._maps:
            mm.close()
        self._maps.clear()


class ShardLoader:
    """Loads shard pieces from a :class:`MappedStore` into this rank's parameters (any device).

    On CUDA with a page-locked store the copy engines read the store directly (``direct``); else
    (``staged``) pieces pass through ``ring`` pinned buffers of ``chunk_bytes``. Copies run on
    ``stream`` (default: the current stream) and are asynchronous: synchronize before use."""

    def __init__(self, store: MappedStore, device, *, mode: str = "auto", ring: int = 4,
                 chunk_bytes: int = 64 << 20, stream=None):
        import torch

        self.store, self.device = store, torch.device(device)
        cuda = self.device.type == "cuda"
        if mode == "auto":
            mode = "direct" if (cuda and store.pinned) else "staged"
        if mode == "direct" and not (cuda and store.pinned):
            raise ValueError("direct loading needs CUDA and a page-locked store")
        self.mode = mode
        if stream is None and cuda:
            stream = torch.cuda.current_stream(self.device)
        self.stream = stream
        self._memcpy2d = None
        if cuda and mode == "direct":
            try:
                self._memcpy2d = _loaded_cudart()
            except (OSError, AttributeError, IndexError):
                self._memcpy2d = None  # strided pieces fall back to the staging ring
        self._ring = []
        if cuda:
            self._ring = [(torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=True), None)
                          for _ in range(ring)]
        self._next = 0
        self.stats = {"direct_bytes": 0, "pitched_bytes": 0, "staged_bytes": 0, "pieces": 0}

    def load(self, pieces: list[ShardPiece], params: dict) -> int:
        """Copy every piece into ``params`` (name → tensor); returns the bytes copied."""
        import torch

        total = 0
        ctx = torch.cuda.stream(self.stream) if self.device.type == "cuda" else nullcontext()
        with ctx:
            for p in pieces:
                src = self.store.tensor(p.key)
                if p.dim is not None:
                    src = src.narrow(p.dim, p.start, p.length)
                dst = params[p.param].narrow(0, p.row, src.shape[0])
                total += self._copy(dst, src)
                self.stats["pieces"] += 1
        return total

    def _copy(self, dst, src) -> int:
        n = src.numel() * src.element_size()
        if self.device.type != "cuda":
            dst.copy_(src)
            self.stats["staged_bytes"] += n
            return n
        if self.mode == "direct" and src.is_contiguous():
            dst.copy_(src, non_blocking=True)
            self.stats["direct_bytes"] += n
            return n
        pitched = src.dim() == 2 and src.stride(1) == 1
        if self.mode == "direct" and self._memcpy2d is not None and pitched:
            es = src.element_size()
            err = self._memcpy2d(dst.data_ptr(), dst.stride(0) * es, src.data_ptr(),
                                 src.stride(0) * es, src.shape[1] * es, src.shape[0], 1,
                                 self.stream.cuda_stream)
            if err == 0:
                self.stats["pitched_bytes"] += n
                return n
            self.stats["pitched_error"] = err  # e.g. a runtime mismatch: use the staging ring
            self._memcpy2d = None
        return self._staged(dst, src)

    def _staged(self, dst, src) -> int:
        import torch

        n_total = src.numel() * src.element_size()
        rows = src.shape[0] if src.dim() > 0 else 1
        row_bytes = max(1, n_total // max(1, rows))
        chunk_bytes = self._ring[0][0].numel()
        step = max(1, chunk_bytes // row_bytes)
        if src.dim() == 0 or row_bytes > chunk_bytes:
            raise ValueError("a row larger than the staging chunk")
        for r0 in range(0, rows, step):
            s = src[r0:r0 + step] if src.dim() > 0 else src
            d = dst[r0:r0 + step] if dst.dim() > 0 else dst
            buf, ev = self._ring[self._next]
            if ev is not None:
                ev.synchronize()  # the DMA that last read this buffer is done
            nb = s.numel() * s.element_size()
            stage = buf[:nb].view(s.dtype).view(s.shape)
            stage.copy_(s)
            d.copy_(stage, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.stream)
            self._ring[self._next] = (buf, ev)
            self._next = (self._next + 1) % len(self._ring)
        self.stats["staged_bytes"] += n_total
        return n_total
