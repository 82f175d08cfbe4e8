"""Compiled kernels kept on disk, so that a new process loads a kernel instead of compiling it.

A kernel compiles in 1-10 s per configuration, once per process; a training job launches a few
(forward, backward and its two small kernels per head dim and mask variant), a benchmark or a check
dozens. Each compiled kernel is exported as an object file (TVM-FFI, the DSL's ahead-of-time
export) under

    $FLASHMASK3_KERNEL_CACHE / <fingerprint> / <sha256 of the compile key>.o

`FLASHMASK3_KERNEL_CACHE` is a directory, or "off" to keep compiled kernels in memory only; unset,
it is `$XDG_CACHE_HOME/flashmask3/kernels` (`~/.cache/flashmask3/kernels`). The fingerprint
covers every source file of the kernels, the CuTe DSL's and TVM-FFI's versions and the target
(sm_90a), so a change to any of them starts a new directory instead of loading stale code. Entries
are written to a temporary name and renamed into place: processes sharing the cache (the ranks of
one job) never read a partial file. The directory may be filled on a machine without a GPU
(`flashmask3.precompile`) and copied to the GPU machines. Folders of other fingerprints are left
in place (another version may still use them); `prune` removes them.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import warnings
from functools import cache
from pathlib import Path

TARGET = "sm_90a"
"""The one target the kernels are built for (Hopper); part of the fingerprint."""

ENTRY_NAME = "kernel"
"""The function name each object file exports."""


def cache_root() -> Path | None:
    """The cache's directory (`FLASHMASK3_KERNEL_CACHE`; unset or empty: under the user's cache
    directory), or None where the variable is "off" (or "0", "false", "none")."""
    setting = os.environ.get("FLASHMASK3_KERNEL_CACHE", "").strip()
    if setting.lower() in ("off", "0", "false", "none"):
        return None
    if setting:
        return Path(setting).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "flashmask3" / "kernels"


@cache
def fingerprint() -> str:
    """A digest of what a compiled kernel depends on besides its key: the kernels' sources (every
    .py file of this package), the CuTe DSL's and TVM-FFI's versions, and the target."""
    import cutlass
    import tvm_ffi

    digest = hashlib.sha256(f"cutlass={cutlass.__version__} tvm_ffi={tvm_ffi.__version__} {TARGET}".encode())
    for source in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(source.name.encode() + b"\0" + source.read_bytes() + b"\0")
    return digest.hexdigest()[:20]


def entry_path(key: tuple) -> Path | None:
    """Where the kernel of compile key `key` is kept (its repr names every choice it was compiled
    with), or None where the cache is off."""
    root = cache_root()
    if root is None:
        return None
    return root / fingerprint() / f"{hashlib.sha256(repr(key).encode()).hexdigest()}.o"


def load(key: tuple):
    """The kernel of `key` from disk (a TVM-FFI function taking the same arguments as the compiled
    one), or None where it is not there, the cache is off, or the entry cannot be loaded (it is then
    compiled again and replaced)."""
    path = entry_path(key)
    if path is None or not path.is_file():
        return None
    import cutlass.cute as cute

    try:
        return getattr(cute.runtime.load_module(str(path), enable_tvm_ffi=True), ENTRY_NAME)
    except Exception:  # a truncated or foreign file: a miss
        return None


def store(key: tuple, compiled) -> Path | None:
    """Write the kernel `compiled` (from `cute.compile(..., options="--enable-tvm-ffi")`) for `key`;
    its path, or None where the cache is off or the entry cannot be written (a warning says why; the
    kernel then stays in memory only)."""
    path = entry_path(key)
    if path is None:
        return None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".o")
        os.close(descriptor)
        try:
            compiled.export_to_c(object_file_path=temporary, function_name=ENTRY_NAME)
            os.replace(temporary, path)
        finally:
            if os.path.exists(temporary):
                os.unlink(temporary)
    except Exception as error:  # the compiled kernel is still good: run it, uncached
        warnings.warn(f"flashmask3: compiled kernel not cached in {path.parent}: {error}", stacklevel=2)
        return None
    return path


def prune() -> list[Path]:
    """Remove the cache's folders of other fingerprints than the current one (kernels that this
    version of the sources, DSL and TVM-FFI never loads); the folders removed."""
    root = cache_root()
    if root is None or not root.is_dir():
        return []
    stale = [folder for folder in root.iterdir() if folder.is_dir() and folder.name != fingerprint()]
    for folder in stale:
        shutil.rmtree(folder, ignore_errors=True)
    return stale
