"""Building the CPU kernels: the C files of this folder compiled once per machine with the system compiler
(each file its own process, then linked into one shared library) and loaded with ctypes.

The cache key is every source and header's content, the generated layout header, the compiler, its flags and
the CPU's feature flags (-march=native targets them): a change to any of them builds anew. The library links
OpenMP dynamically: loaded into a process where torch already holds libgomp.so.1, it shares torch's runtime
and thread pool instead of starting a second one that would fight it for cores."""

from __future__ import annotations

import ctypes
import glob
import hashlib
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor

from minisgl.env import ENV
from minisgl.kernel.cpu import layout
from minisgl.utils import init_logger
from minisgl.utils.logger import logged_step

logger = init_logger(__name__)

_DIR = os.path.dirname(os.path.abspath(__file__))
# Reassociation lets the compiler vectorise the dot products; no -ffast-math (it would assume no infinities).
_FLAGS = [
    "-O3",
    "-march=native",
    "-fPIC",
    "-fopenmp",
    "-ffp-contract=fast",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-fno-trapping-math",
]


def _cpu_signature() -> str:
    """What -march=native depends on: a library built on another CPU is not reused."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _sources() -> tuple[list[str], list[str]]:
    """The folder's C files and headers, sorted."""
    return sorted(glob.glob(os.path.join(_DIR, "*.c"))), sorted(glob.glob(os.path.join(_DIR, "*.h")))


def _key(compiler: str, flags: list[str], header: str) -> str:
    """The build's cache key: every file's name and content, the generated header, compiler, flags, CPU."""
    h = hashlib.sha256()
    sources, headers = _sources()
    for path in sources + headers:
        with open(path, "rb") as f:
            h.update(os.path.basename(path).encode() + b"\0" + f.read() + b"\0")
    h.update(header.encode())
    h.update(" ".join([compiler, *flags, _cpu_signature()]).encode())
    return h.hexdigest()[:16]


def _compile(compiler: str, flags: list[str], build_dir: str, out: str) -> str | None:
    """Compiles every C file into build_dir (in parallel) and links them into `out`; the compiler's errors
    on failure, None on success."""
    sources, _ = _sources()
    include = ["-I", build_dir, "-I", _DIR]  # the generated layout.h, the folder's headers

    def one(src: str) -> subprocess.CompletedProcess:
        obj = os.path.join(build_dir, os.path.basename(src)[:-2] + ".o")
        return subprocess.run(
            [compiler, *flags, *include, "-c", "-o", obj, src], capture_output=True, text=True, check=False
        )

    largest_first = sorted(sources, key=os.path.getsize, reverse=True)  # the long compiles start first
    with ThreadPoolExecutor(max_workers=max(1, min(len(sources), os.cpu_count() or 1))) as pool:
        results = list(pool.map(one, largest_first))
    failed = [r.stderr for r in results if r.returncode != 0]
    if failed:
        return "\n".join(failed)
    objs = [os.path.join(build_dir, os.path.basename(s)[:-2] + ".o") for s in sources]
    link = subprocess.run(
        [compiler, *flags, "-shared", "-o", out, *objs], capture_output=True, text=True, check=False
    )
    return link.stderr if link.returncode != 0 else None


def build(extra_flags: tuple[str, ...] = ()) -> str | None:
    """The library's path, compiled first where these sources, compiler and CPU have none yet; extra_flags
    (after the defaults, e.g. an older -march) build a variant for the tests. None without a compiler or
    where the compile fails (logged)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning("No C compiler found: CPU kernels fall back to torch ops (slower decode attention)")
        return None
    flags = [*_FLAGS, *extra_flags]
    header = layout.c_header()
    out_dir = os.path.join(ENV.cache_dir, "kernels")
    path = os.path.join(out_dir, f"cpu_kernels-{_key(compiler, flags, header)}.so")
    if os.path.exists(path):
        return path
    os.makedirs(out_dir, exist_ok=True)
    build_dir = tempfile.mkdtemp(prefix="cpu_kernels-build-", dir=out_dir)
    try:
        with open(os.path.join(build_dir, "layout.h"), "w") as f:
            f.write(header)
        tmp = os.path.join(build_dir, "cpu_kernels.so")
        what = f"Compiling CPU kernels ({os.path.basename(compiler)}, once per machine)"
        with logged_step(logger, what, f"into {path}"):
            errors = _compile(compiler, flags, build_dir, tmp)
        if errors is not None:
            logger.warning("Compiling CPU kernels failed; falling back to torch ops:\n%s", errors[-2000:])
            return None
        os.replace(tmp, path)  # atomic: processes building at once each see a whole library
    finally:
        shutil.rmtree(build_dir, ignore_errors=True)
    return path


def load(path: str) -> ctypes.CDLL:
    """The library at `path`, its layout checked against layout.py's (RuntimeError on a mismatch)."""
    lib = ctypes.CDLL(path)
    lib.cpu_layout_signature.restype = ctypes.c_char_p
    built = lib.cpu_layout_signature().decode()
    if built != layout.signature():
        raise RuntimeError(
            f"the CPU kernel library {path} was built for descriptor layout {built}, but "
            f"minisgl/kernel/cpu/layout.py describes {layout.signature()}: delete the library to rebuild it"
        )
    return lib
