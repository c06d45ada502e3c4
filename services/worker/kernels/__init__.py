"""The worker's CPU kernels (cpu_kernels.c): compiled on first use, loaded with ctypes.

`load()` returns a `CpuKernels` whose methods take and fill torch tensors (float32 or
bfloat16, contiguous as each method says), or None where no C compiler is found or the build
fails: the worker then runs transformers' own modules. The library is built once per source,
compiler, CPU and instruction set into ~/.cache/textgen/kernels and reused by every later
process; concurrent builders each write a private file and rename it into place.

Instruction set: the code is picked on the host that runs it, `-march=native` by default.
`ATEN_CPU_CAPABILITY`, PyTorch's own override, caps it for our kernels too: `avx2` builds for
x86-64-v3 (AVX2 and FMA, no AVX512) and `default` for x86-64-v2, so a host with AVX512 runs
the AVX2 path of torch and of these kernels alike. A cap above what the CPU has changes
nothing.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from services.worker.kernels.matmul import MatmulKernels
from services.worker.kernels.tile_attention import TileAttention

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent
SOURCES = (
    "cpu_kernels.c",
    "cpu_kernels.inc",
    "paged_attention.inc",
    "attention_dot.inc",
    "lora.inc",
    "amx_linear.inc",
    "amx_attention.inc",
    "bf16_dot_linear.inc",
    "f32_linear.inc",
)
# -fno-trapping-math: a float select (exp_clamped's clamp) may run as a vector blend; without
# it GCC left exp's loops scalar below AVX512 (silu_mul 260 us vs torch's 55 on AVX2). Values
# are the same; only the FP exception flags, which nothing reads, may differ
FLAGS = ["-O3", "-fopenmp", "-ffp-contract=off", "-fno-trapping-math", "-shared", "-fPIC"]
CAPABILITY_ENV = "ATEN_CPU_CAPABILITY"  # PyTorch's name: one switch for torch and for us
# x86-64 instruction sets, lowest first, and the -march that builds for each
LEVELS = {"default": "x86-64-v2", "avx2": "x86-64-v3", "avx512": "native", "amx": "native"}
# GCC vectorizes loops 256 bits wide on most AVX512 CPUs unless told: the element-wise kernels
# then run ~20% slower in bfloat16 (silu_mul on 512 x 1536: 0.42 vs 0.55 ms). The avx512
# level of an AMX CPU leaves the tiles out (bfloat16 matmuls then run on AVX512-BF16 dots).
WIDE = "-mprefer-vector-width=512"
LEVEL_FLAGS = {"avx512": [WIDE, "-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"], "amx": [WIDE]}
BUILD_TIMEOUT_S = 120
SUFFIXES = {torch.float32: "f32", torch.bfloat16: "bf16"}  # the element types compiled
KEY_TILE = 16  # keys the attention kernel scores at once: block sizes must be multiples
MAX_HEAD_DIM = 256  # the attention kernel's largest head dimension (cpu_kernels.c)
MAX_LORA_COLS = 1024  # a LoRA op's parts x rank the lora_add kernel takes (cpu_kernels.c)
LORA_TILE = 8  # rows of one adapter the lora_add kernel computes together (cpu_kernels.c)

_i64 = ctypes.c_int64
_ptr = ctypes.c_void_p
_SIGNATURES = {  # argument types of each kernel (documented in the .inc files)
    "rms_norm": [_ptr, _ptr, _ptr, _ptr, _i64, _i64, ctypes.c_float, ctypes.c_int],
    "rope_store": [_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, ctypes.c_int],
    "silu_mul": [_ptr, _ptr, _i64, _i64, ctypes.c_int],
    "greedy": [_ptr, _i64, _i64, _ptr, _ptr, ctypes.c_int],
    "lora_add": [
        *[_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _ptr, _ptr, _i64, _i64, _i64],
        *[_ptr, _ptr, _ptr, _i64, _i64, ctypes.c_int],
    ],
    "paged_attention": [
        *[_ptr, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr],
        *[_i64, _i64, _i64, _i64, _i64, _i64, ctypes.c_float, _i64, ctypes.c_int, ctypes.c_int],
    ],
}


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "textgen" / "kernels"


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _cpu_identity() -> str:
    """What -march=native depends on: the CPU model and its feature flags."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            lines = [
                line for line in cpuinfo if line.startswith(("model name", "flags", "vendor_id"))
            ]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


def _native_level(identity: str) -> str:
    """The highest of LEVELS this CPU has (its /proc/cpuinfo flags)."""
    flags = set(identity.split())
    if {"avx512f", "avx512bw", "avx512vl"} <= flags:
        return "amx" if {"amx_tile", "amx_bf16"} <= flags else "avx512"
    return "avx2" if {"avx2", "fma"} <= flags else "default"


def capability() -> str:
    """The instruction set the kernels are built for: this CPU's best, capped by
    ATEN_CPU_CAPABILITY (its avx512_* values mean avx512, amx means no cap; unknown values
    are ignored). Always "native" off x86-64."""
    if platform.machine() != "x86_64":
        return "native"
    native = _native_level(_cpu_identity())
    requested = os.environ.get(CAPABILITY_ENV, "").strip().lower()
    requested = "avx512" if requested.startswith("avx512") else requested
    if requested not in LEVELS:
        return native
    order = list(LEVELS)
    return order[min(order.index(requested), order.index(native))]


def march(level: str) -> str:
    return "-march=" + LEVELS.get(level, "native")


def _library_path(compiler: str, level: str) -> Path:
    digest = hashlib.sha256()
    for name in SOURCES:
        digest.update((SOURCE_DIR / name).read_bytes())
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, timeout=30
    ).stdout
    flags = " ".join([*FLAGS, *LEVEL_FLAGS.get(level, [])])
    for part in (version, flags, march(level), _cpu_identity(), platform.machine()):
        digest.update(part.encode())
    return cache_dir() / f"cpu_kernels-{digest.hexdigest()[:16]}.so"


def _build(
    compiler: str,
    level: str,
    target: Path,
    sources: Path = SOURCE_DIR,  # another copy of the sources: scripts/kernel_ab.py
    extra_flags: tuple[str, ...] = (),  # after the level's: -DNAME=VALUE to try a variant
) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, private = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(handle)
    started = time.perf_counter()
    try:
        subprocess.run(
            [
                *[compiler, *FLAGS, *LEVEL_FLAGS.get(level, []), march(level), *extra_flags],
                *["-o", private, str(sources / "cpu_kernels.c")],
            ],
            check=True,
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
        )
        os.replace(private, target)
    finally:
        if os.path.exists(private):
            os.unlink(private)
    log.info(
        "built CPU kernels (%s) in %.1f s: %s", march(level), time.perf_counter() - started, target
    )


@functools.cache
def load() -> CpuKernels | None:
    """The kernels, built if needed; None (logged once) where they cannot be."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "aarch64"):
        log.info("CPU kernels: not built on %s/%s", platform.system(), platform.machine())
        return None
    compiler = _compiler()
    if compiler is None:
        log.warning("CPU kernels: no C compiler (cc, gcc or $CC) found; using torch ops")
        return None
    level = capability()
    try:
        path = _library_path(compiler, level)
        if not path.exists():
            _build(compiler, level, path)
        log.info("CPU kernels: %s instruction set (%s)", level, march(level))
        return CpuKernels(ctypes.CDLL(str(path)), level)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or ""
        log.warning("CPU kernels unavailable (%s) %s; using torch ops", exc, detail[-2000:])
        return None


def _address(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


class CpuKernels:
    """Typed calls into the compiled library. Every tensor is on the CPU, contiguous, and of
    one element type (float32 or bfloat16) per call."""

    def __init__(self, library: ctypes.CDLL, level: str) -> None:
        self.level = level  # the instruction set it was built for: a key of LEVELS, or native
        self._functions = {}
        for name, argtypes in _SIGNATURES.items():
            for dtype, suffix in SUFFIXES.items():
                function = getattr(library, f"{name}_{suffix}")
                function.argtypes = argtypes
                function.restype = None
                self._functions[name, dtype] = function
        # the fast decoder's own matmuls where this build has them (kernels/matmul.py)
        self.matmul = MatmulKernels(library)
        # bfloat16 prompt chunks' attention on AMX tiles, where the matmuls have them
        self.tile_attention = TileAttention(library) if self.matmul.has_amx else None
        # prompt chunks' bfloat16 attention on AVX512-BF16 dot products (attention_dot.inc):
        # where the matmuls keep theirs (a CPU that issues them slowly keeps its FMAs for both)
        self.bf16_attention_dots: bool = (
            self.matmul.has_bf16_dot_products and not self.matmul.bf16_widens
        )
        if self.matmul.has_bf16_dot_products:
            log.info("bfloat16 prompt attention: %s (as the matmuls)", self.bf16_attention)
        elif self.tile_attention is not None:
            log.info("bfloat16 prompt attention: amx (chunks of 32 queries or more, on tiles)")

    @property
    def bf16_attention(self) -> str:
        """What bfloat16 prompt chunks attend with: amx (chunks of TILE_MIN_QUERIES or more on
        AMX tiles, shorter ones as widen), dot (AVX512-BF16 dot products) or widen (FMAs of
        keys and values widened to float32, as decodes everywhere)."""
        if self.tile_attention is not None:
            return "amx"
        return "dot" if self.bf16_attention_dots else "widen"

    @staticmethod
    def supports(dtype: torch.dtype) -> bool:
        return dtype in SUFFIXES

    def rms_norm(
        self,
        x: torch.Tensor,  # [num_rows, dim]
        weight: torch.Tensor,  # [dim]
        eps: float,
        residual: torch.Tensor | None = None,  # [num_rows, dim]: becomes x + residual
    ) -> torch.Tensor:
        """weight * RMSNorm(x), or of x + residual (which `residual` then holds). [num_rows, dim]"""
        out = torch.empty_like(x)
        num_rows, dim = x.shape
        self._functions["rms_norm", x.dtype](
            x.data_ptr(),
            _address(residual),
            weight.data_ptr(),
            out.data_ptr(),
            num_rows,
            dim,
            eps,
            torch.get_num_threads(),
        )
        return out

    def rope_store(
        self,
        qkv: torch.Tensor,  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]
        cos: torch.Tensor,  # [num_tokens, head_dim]
        sin: torch.Tensor,  # [num_tokens, head_dim]
        k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim] storage, block layout
        v_cache: torch.Tensor,  # (cpu_kernels.c)
        slots: torch.Tensor,  # [num_tokens] int64
        num_heads: int,
        block_size: int,
    ) -> None:
        """Rotate the query and key heads in place; write keys and values to the cache."""
        _num_slots, num_kv_heads, head_dim = k_cache.shape
        self._functions["rope_store", qkv.dtype](
            qkv.data_ptr(),
            qkv.shape[0],
            num_heads,
            num_kv_heads,
            head_dim,
            cos.data_ptr(),
            sin.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            slots.data_ptr(),
            block_size,
            torch.get_num_threads(),
        )

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of rows [gate | up]. [num_rows, 2 * width] -> [num_rows, width]"""
        num_rows, double = gate_up.shape
        out = gate_up.new_empty(num_rows, double // 2)
        self._functions["silu_mul", gate_up.dtype](
            gate_up.data_ptr(), out.data_ptr(), num_rows, double // 2, torch.get_num_threads()
        )
        return out

    def greedy(self, logits: torch.Tensor) -> tuple[list[int], list[float]]:
        """Per row of logits [num_rows, vocab]: the argmax (its first index) and its log-softmax."""
        num_rows, vocab = logits.shape
        token_ids = torch.empty(num_rows, dtype=torch.int64)
        logprobs = torch.empty(num_rows, dtype=torch.float32)
        self._functions["greedy", logits.dtype](
            logits.data_ptr(),
            num_rows,
            vocab,
            token_ids.data_ptr(),
            logprobs.data_ptr(),
            torch.get_num_threads(),
        )
        return token_ids.tolist(), logprobs.tolist()

    def lora_add(
        self,
        x: torch.Tensor,  # [num_rows, in_dim] (rows may be strided)
        slots: torch.Tensor,  # [num_rows] int64: each row's adapter slot, -1 for none
        order: torch.Tensor,  # [num_adapted] int64: the adapted rows, grouped by slot
        tile_starts: torch.Tensor,  # [num_tiles + 1] int64: tiles of <= 8 rows of one slot
        a_t: torch.Tensor,  # [num_slots, in_dim, parts * part_rank]
        b: torch.Tensor,  # [num_slots, parts * part_rank, out_width]
        part_rank: int,
        col_start: torch.Tensor,  # [parts] int64: each part's first output column
        col_width: torch.Tensor,  # [parts] int64: and its width
        out: torch.Tensor,  # [num_rows, out_width] (rows may be strided)
    ) -> None:
        """out += each row's own adapter's (x A^T) B, in place (lora.inc)."""
        in_dim = x.shape[1]
        rank_cols, out_width = b.shape[1], b.shape[2]
        self._functions["lora_add", x.dtype](
            x.data_ptr(),
            x.stride(0),
            slots.data_ptr(),
            order.data_ptr(),
            tile_starts.data_ptr(),
            tile_starts.shape[0] - 1,
            in_dim,
            a_t.data_ptr(),
            b.data_ptr(),
            rank_cols,
            col_start.shape[0],
            part_rank,
            col_start.data_ptr(),
            col_width.data_ptr(),
            out.data_ptr(),
            out.stride(0),
            out_width,
            torch.get_num_threads(),
        )

    def paged_attention(
        self,
        qkv: torch.Tensor,  # [num_tokens, >= num_heads * head_dim]: the queries lead each row
        k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim] storage, block layout
        v_cache: torch.Tensor,  # (cpu_kernels.c)
        query_start: torch.Tensor,  # [num_requests + 1] int64
        context_lens: torch.Tensor,  # [num_requests] int64
        block_tables: torch.Tensor,  # [num_requests, max_blocks] int64
        block_size: int,
        num_heads: int,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        """Causal attention over the paged cache. [num_tokens, num_heads * head_dim]"""
        _num_slots, num_kv_heads, head_dim = k_cache.shape
        out = qkv.new_empty(qkv.shape[0], num_heads * head_dim)
        num_requests, max_blocks = block_tables.shape
        self._functions["paged_attention", qkv.dtype](
            qkv.data_ptr(),
            qkv.stride(0),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            out.data_ptr(),
            query_start.data_ptr(),
            context_lens.data_ptr(),
            block_tables.data_ptr(),
            max_blocks,
            num_requests,
            num_heads,
            num_kv_heads,
            head_dim,
            block_size,
            scale,
            sliding_window or 0,
            int(self.bf16_attention_dots and qkv.dtype == torch.bfloat16),
            torch.get_num_threads(),
        )
        return out
