"""The ELF reader of baselines.native_libs against files whose libraries are known (a
synthetic shared object written here, torch's own libraries), and the HybridEP runtime reason
that turns a static C++ runtime into a one-line skip instead of a SIGSEGV."""

from __future__ import annotations

import importlib.util
import struct
import types
from pathlib import Path

import pytest
import torch

from baselines import hybridep_megatron as hm
from baselines.native_libs import PRELOAD_FIX, elf_needed, static_cxx_runtime_reason


def write_elf(path: Path, needed: list[str], *, vaddr: int = 0x1000) -> Path:
    """A minimal 64-bit little-endian ELF: header, a PT_LOAD and a PT_DYNAMIC program header,
    a string table and a dynamic section (DT_NEEDED entries, DT_STRTAB as a virtual address
    inside the PT_LOAD, DT_NULL)."""
    strtab = b"\0" + b"".join(n.encode() + b"\0" for n in needed)
    names, pos = [], 1
    for n in needed:
        names.append(pos)
        pos += len(n) + 1
    phoff, phnum, phentsize = 64, 2, 56
    str_off = phoff + phnum * phentsize
    dyn_off = str_off + len(strtab) + (-len(strtab)) % 8
    dyn = b"".join(struct.pack("<qQ", 1, n) for n in names)
    dyn += struct.pack("<qQ", 5, vaddr + str_off) + struct.pack("<qQ", 0, 0)
    size = dyn_off + len(dyn)
    header = (b"\x7fELF" + bytes([2, 1, 1]) + bytes(9)
              + struct.pack("<HHIQQQIHHHHHH", 3, 62, 1, 0, phoff, 0, 0, 64, phentsize, phnum,
                            64, 0, 0))
    load = struct.pack("<IIQQQQQQ", 1, 5, 0, vaddr, vaddr, size, size, 0x1000)
    dynamic = struct.pack("<IIQQQQQQ", 2, 6, dyn_off, vaddr + dyn_off, vaddr + dyn_off,
                          len(dyn), len(dyn), 8)
    data = header + load + dynamic
    data += strtab + bytes(dyn_off - len(data) - len(strtab))
    path.write_bytes(data + dyn)
    return path


def test_elf_needed_reads_a_synthetic_shared_object(tmp_path):
    libs = ["libtorch.so", "libstdc++.so.6", "libc.so.6"]
    assert elf_needed(write_elf(tmp_path / "a.so", libs)) == libs
    assert elf_needed(write_elf(tmp_path / "b.so", ["libc.so.6"], vaddr=0x400000)) == \
        ["libc.so.6"]
    assert elf_needed(write_elf(tmp_path / "c.so", [])) == []


def test_elf_needed_claims_nothing_for_other_files(tmp_path):
    assert elf_needed(tmp_path / "missing.so") is None
    (tmp_path / "text.so").write_text("not an ELF file\n" * 8)
    assert elf_needed(tmp_path / "text.so") is None
    good = write_elf(tmp_path / "d.so", ["libc.so.6"]).read_bytes()
    (tmp_path / "cut.so").write_bytes(good[:100])  # program headers cut off
    assert elf_needed(tmp_path / "cut.so") is None


def test_elf_needed_reads_torch_python_library():
    lib = Path(torch.__file__).parent / "lib" / "libtorch_python.so"
    if not lib.is_file():
        pytest.skip("this torch build has no lib/libtorch_python.so")
    needed = elf_needed(lib)
    assert "libtorch.so" in needed and any(n.startswith("libc.so") for n in needed)


def test_static_cxx_runtime_reason():
    why = static_cxx_runtime_reason(["libtorch.so", "libgcc_s.so.1", "libc.so.6"], "")
    assert why.startswith("hybrid_ep_cpp links the C++ runtime statically") and PRELOAD_FIX in why
    assert static_cxx_runtime_reason(["libstdc++.so.6", "libc.so.6"], "") is None
    assert static_cxx_runtime_reason(["libc++.so.1", "libc.so.6"], "") is None  # LLVM's
    assert static_cxx_runtime_reason(
        ["libc.so.6"], "/usr/lib/x86_64-linux-gnu/libstdc++.so.6") is None
    assert static_cxx_runtime_reason(None, None) is None


def test_hybridep_runtime_reason_reads_the_installed_extension(tmp_path, monkeypatch):
    static = write_elf(tmp_path / "hybrid_ep_cpp.so", ["libtorch.so", "libgcc_s.so.1"])
    spec = types.SimpleNamespace(origin=str(static))
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name: spec if name == "hybrid_ep_cpp" else None)
    assert PRELOAD_FIX in hm.hybridep_runtime_reason({})
    assert hm.hybridep_runtime_reason({"LD_PRELOAD": "/lib/libstdc++.so.6"}) is None
    write_elf(static, ["libstdc++.so.6", "libc.so.6"])
    assert hm.hybridep_runtime_reason({}) is None
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert hm.hybridep_runtime_reason({}) is None
