"""What a native extension links against, read from its ELF file without loading it, and the
one such fact that decides whether HybridEP can run: a C++ runtime linked in statically.

Why: a DeepEP hybrid-ep build whose compiler found only the static ``libstdc++.a`` (seen on
the lent H200 machines: the ``/opt/gcc`` wrapper links ``hybrid_ep_cpp`` without a NEEDED
``libstdc++.so.6``) carries its own copy of the C++ runtime; the process's other copy (the
shared one torch loads) then meets it inside iostream code, and ``HybridEPBuffer``'s
constructor dies with SIGSEGV in ``get_comm_id`` (formatting ranks with an
``std::ostringstream``). Preloading the shared ``libstdc++.so.6`` makes every reference bind
to one copy; the constructor then succeeds (the two-H200 run results/20261130-195433-h200x2
ran that way).
"""

from __future__ import annotations

import struct
from pathlib import Path

PT_LOAD, PT_DYNAMIC = 1, 2
DT_NULL, DT_NEEDED, DT_STRTAB = 0, 1, 5
PRELOAD_FIX = "export LD_PRELOAD=$(g++ -print-file-name=libstdc++.so.6)"


def elf_needed(path: str | Path) -> list[str] | None:
    """The DT_NEEDED entries (shared libraries it links against, e.g. "libc.so.6") of a 64-bit
    little-endian ELF file, in file order; None when ``path`` is not such a file (or cannot be
    read): callers then claim nothing."""
    try:
        data = Path(path).read_bytes()
    except OSError:
        return None
    if len(data) < 64 or data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return None
    try:
        phoff, = struct.unpack_from("<Q", data, 32)
        phentsize, phnum = struct.unpack_from("<HH", data, 54)
        loads, dynamic = [], None
        for i in range(phnum):  # p_type, p_flags, p_offset, p_vaddr, p_paddr, p_filesz
            p_type, _, off, vaddr, _, filesz = struct.unpack_from("<IIQQQQ", data,
                                                                  phoff + i * phentsize)
            if p_type == PT_LOAD:
                loads.append((vaddr, off, filesz))
            elif p_type == PT_DYNAMIC:
                dynamic = (off, filesz)
        if dynamic is None:
            return []
        needed, strtab = [], None
        for pos in range(dynamic[0], dynamic[0] + dynamic[1], 16):
            tag, val = struct.unpack_from("<qQ", data, pos)
            if tag == DT_NULL:
                break
            if tag == DT_NEEDED:
                needed.append(val)
            elif tag == DT_STRTAB:
                strtab = next((off + val - vaddr for vaddr, off, size in loads
                               if vaddr <= val < vaddr + size), None)
        if strtab is None:
            return None if needed else []
        return [data[strtab + n:data.index(b"\0", strtab + n)].decode() for n in needed]
    except (struct.error, ValueError, UnicodeDecodeError):
        return None


def static_cxx_runtime_reason(needed: list[str] | None, ld_preload: str | None,
                              name: str = "hybrid_ep_cpp") -> str | None:
    """Why the C++ extension ``name`` would crash in this process, or None. ``needed``: its
    DT_NEEDED list (:func:`elf_needed`; None claims nothing); ``ld_preload``: $LD_PRELOAD.
    Pure."""
    if needed is None or any(lib.startswith(("libstdc++.so", "libc++.so")) for lib in needed):
        return None  # a shared C++ runtime (GNU's, or LLVM's libc++): nothing to claim
    if "libstdc++.so" in (ld_preload or ""):
        return None
    return (f"{name} links the C++ runtime statically (no libstdc++.so.6 among its libraries) "
            f"and then crashes in HybridEPBuffer's constructor; preload the shared one: "
            f"{PRELOAD_FIX}")
