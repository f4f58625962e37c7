"""What in a cubin affects execution, as one hashable fingerprint (pure Python, pyelftools).

Two cubins with the same fingerprint run the same: same machine code, same constant and
global initialisers (a lookup table in `__constant__` memory), same shared-memory sizes,
same kernel attributes (`.nv.info*`: parameter layout, register count, max threads,
barriers), same relocations and symbols (by name, type, section, value and size). What is
ignored: string-table offsets, section and symbol *indices* (replaced by the names they
point at), the translation-unit hash NVRTC puts in internal-linkage names, debug sections (`.debug_*` and their relocations) and the notes NVRTC writes
about itself (`.note.*`: toolkit version and options).
"""

from __future__ import annotations

import hashlib
import io
import re

_IGNORED_TYPES = {"SHT_NULL", "SHT_STRTAB", "SHT_SYMTAB", "SHT_NOTE"}
# NVRTC names internal-linkage symbols (a namespace-scope constexpr) after a hash of the
# translation unit: `_ZN47_INTERNAL_00000000_10_qk_rope_cu_80da4421_241043qkr5kWarpE`.
# Any edit of the source changes it; it is a name, not code.
_INTERNAL = re.compile(r"\d*_INTERNAL_[0-9a-f]+_\d+_\w*?_[0-9a-f]{8}_\d+")


def _name(name: str | None) -> str | None:
    return _INTERNAL.sub("_INTERNAL_", name) if name else name


def _ignored(name: str) -> bool:
    return (name.startswith(".debug") or name.startswith(".rel.debug") or name.startswith(".rela.debug")
            or name.startswith(".note") or name.startswith(".nv_debug"))


def fingerprint(cubin: bytes) -> str:
    """A sha256 over every execution-relevant part of `cubin` (see the module docstring)."""
    from elftools.elf.elffile import ELFFile
    from elftools.elf.relocation import RelocationSection
    from elftools.elf.sections import SymbolTableSection

    elf = ELFFile(io.BytesIO(cubin))
    sections = list(elf.iter_sections())
    names = [s.name for s in sections]

    def section_name(index) -> str:
        if isinstance(index, int) and 0 < index < len(names):
            return names[index]
        return str(index)

    h = hashlib.sha256()

    def put(*parts) -> None:
        h.update(repr(parts).encode())
        h.update(b"\n")

    header = elf.header
    put("elf", header["e_machine"], header["e_type"], header["e_flags"], header["e_ident"]["EI_CLASS"],
        header["e_ident"]["EI_OSABI"], header["e_ident"]["EI_ABIVERSION"])
    symbols: list = []
    for section in sections:
        if isinstance(section, SymbolTableSection):
            symbols = [
                (_name(sym.name), sym["st_info"]["type"], sym["st_info"]["bind"], sym["st_other"]["visibility"],
                 section_name(sym["st_shndx"]), sym["st_value"], sym["st_size"])
                for sym in section.iter_symbols()
                if sym["st_info"]["type"] not in ("STT_FILE",) and not _ignored(section_name(sym["st_shndx"]))
            ]
    put("symbols", sorted(symbols))
    for section in sorted(sections, key=lambda s: s.name):
        name = section.name
        kind = section["sh_type"]
        if kind in _IGNORED_TYPES or _ignored(name):
            continue
        link = section_name(section["sh_link"])
        info = section_name(section["sh_info"]) if section["sh_flags"] & 0x40 or isinstance(section, RelocationSection) \
            else section["sh_info"]
        put("section", name, kind, section["sh_flags"], section["sh_size"], section["sh_addralign"],
            section["sh_entsize"], link, info)
        if isinstance(section, RelocationSection):
            table = elf.get_section(section["sh_link"])
            entries = []
            for rel in section.iter_relocations():
                sym = table.get_symbol(rel["r_info_sym"]) if table is not None else None
                addend = rel["r_addend"] if section.is_RELA() else None
                entries.append((rel["r_offset"], rel["r_info_type"], _name(sym.name) if sym is not None else None,
                                addend))
            put("relocations", name, entries)
        elif kind != "SHT_NOBITS":
            put("data", name, hashlib.sha256(section.data()).hexdigest())
    return h.hexdigest()
