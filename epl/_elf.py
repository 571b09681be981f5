"""Point a loaded shared library's import of a function at another function (Linux, ELF64).

A shared library calls a function of another library through a slot the dynamic linker fills
(its GOT: a JUMP_SLOT relocation for calls through the PLT, GLOB_DAT for a taken address).
``ImportSlots(library, symbol)`` finds those slots from the library's own relocation tables
(read from memory: the dynamic section, the dynamic symbol and string tables), and
``redirect(address)`` / ``restore()`` write them -- an aligned 8-byte store, which every later
call of the library reads. Only that library's calls change; the function itself and every
other caller keep theirs.

Used by epl._tf_compat (the one user); nothing here knows about TensorFlow.
"""
import ctypes
import os

import numpy as np

PT_LOAD, PT_DYNAMIC = 1, 2
DT_NULL, DT_PLTRELSZ, DT_STRTAB, DT_SYMTAB = 0, 2, 5, 6
DT_RELA, DT_RELASZ, DT_STRSZ, DT_JMPREL = 7, 8, 10, 23
PROT_READ, PROT_WRITE = 1, 2
_PAGE = os.sysconf("SC_PAGE_SIZE")
_SYM = np.dtype([("name", "<u4"), ("info", "u1"), ("other", "u1"), ("shndx", "<u2"),
                 ("value", "<u8"), ("size", "<u8")])
_RELA = np.dtype([("offset", "<u8"), ("info", "<u8"), ("addend", "<i8")])


class ElfError(RuntimeError):
  """The library or its import of the symbol could not be found or changed."""


def _mappings(path):
  """[(start, end, perms, file offset)] of ``path`` in this process (/proc/self/maps)."""
  real = os.path.realpath(path)
  out = []
  with open("/proc/self/maps") as f:
    for line in f:
      fields = line.split(None, 5)
      if len(fields) == 6 and os.path.realpath(fields[5].strip()) == real:
        start, end = (int(x, 16) for x in fields[0].split("-"))
        out.append((start, end, fields[1], int(fields[2], 16)))
  return out


def _array(address, dtype, count):
  return np.frombuffer((ctypes.c_char * (count * dtype.itemsize)).from_address(address),
                       dtype=dtype)


class ImportSlots:
  """The GOT slots through which ``library`` (a loaded .so path) reaches ``symbol``."""

  def __init__(self, library, symbol):
    maps = _mappings(library)
    if not maps:
      raise ElfError("%s is not loaded in this process" % library)
    self.library = library
    self.symbol = symbol
    self._maps = maps
    self.base = min(start - offset for start, _, _, offset in maps if offset == 0)
    self.slots = self._find()
    if not self.slots:
      raise ElfError("%s has no relocation for %s" % (library, symbol))
    self._original = {slot: ctypes.c_uint64.from_address(slot).value for slot in self.slots}

  def _dynamic(self):
    header = ctypes.string_at(self.base, 64)
    if header[:4] != b"\x7fELF" or header[4] != 2:
      raise ElfError("%s is not an ELF64 object" % self.library)
    phoff = int.from_bytes(header[32:40], "little")
    phentsize = int.from_bytes(header[54:56], "little")
    phnum = int.from_bytes(header[56:58], "little")
    for i in range(phnum):
      ph = ctypes.string_at(self.base + phoff + i * phentsize, phentsize)
      if int.from_bytes(ph[0:4], "little") == PT_DYNAMIC:
        vaddr = int.from_bytes(ph[16:24], "little")
        entries = {}
        address = self.base + vaddr
        while True:
          tag, value = ctypes.c_int64.from_address(address).value, \
              ctypes.c_uint64.from_address(address + 8).value
          if tag == DT_NULL:
            return entries
          entries.setdefault(tag, value)
          address += 16
    raise ElfError("%s has no dynamic section" % self.library)

  def _address(self, value):
    """A d_ptr of the dynamic section: glibc relocates some in place, others it leaves."""
    return value if value >= self.base else self.base + value

  def _find(self):
    dyn = self._dynamic()
    if not all(tag in dyn for tag in (DT_STRTAB, DT_STRSZ, DT_SYMTAB)):
      raise ElfError("%s has no dynamic symbol or string table" % self.library)
    strtab = self._address(dyn[DT_STRTAB])
    strings = ctypes.string_at(strtab, dyn[DT_STRSZ])
    wanted = self.symbol.encode() + b"\0"
    offsets, at = set(), strings.find(wanted)
    while at >= 0:                        # tail-merged names may point into longer strings
      offsets.add(at)
      at = strings.find(wanted, at + 1)
    if not offsets:
      return []
    tables = [_array(self._address(dyn[table]), _RELA, dyn[size] // _RELA.itemsize)
              for table, size in ((DT_JMPREL, DT_PLTRELSZ), (DT_RELA, DT_RELASZ))
              if table in dyn and size in dyn]
    # the symbols the relocations name: their own indices bound the table (ELF gives the
    # dynamic symbol table no size, and nothing orders it before the string table)
    count = max((int((t["info"] >> np.uint64(32)).max()) + 1 for t in tables if len(t)),
                default=0)
    if not count:
      return []
    symbols = _array(self._address(dyn[DT_SYMTAB]), _SYM, count)
    indices = np.flatnonzero(np.isin(symbols["name"], list(offsets)) & (symbols["shndx"] == 0))
    slots = []
    for rela in tables:
      hits = rela["offset"][np.isin(rela["info"] >> np.uint64(32), indices.astype(np.uint64))]
      slots.extend(self.base + int(offset) for offset in hits)
    return sorted(set(slots))

  def values(self):
    return [ctypes.c_uint64.from_address(slot).value for slot in self.slots]

  def _write(self, values):
    libc = ctypes.CDLL(None, use_errno=True)
    for slot, value in values.items():
      page = slot - slot % _PAGE
      perms = next((p for s, e, p, _ in self._maps if s <= slot < e), "")
      if "w" not in perms and libc.mprotect(ctypes.c_void_p(page), _PAGE,
                                            PROT_READ | PROT_WRITE) != 0:
        raise ElfError("mprotect of %s's slot for %s failed (errno %d)" % (
            self.library, self.symbol, ctypes.get_errno()))
      ctypes.c_uint64.from_address(slot).value = value
      if "w" not in perms:
        libc.mprotect(ctypes.c_void_p(page), _PAGE, PROT_READ)

  def redirect(self, address):
    """Every slot now calls ``address``."""
    self._write({slot: address for slot in self.slots})

  def restore(self):
    """The slots hold what they held when this object was made."""
    self._write(self._original)


def function_address(library, symbol):
  """The address of ``symbol`` exported by the loaded ``library``."""
  try:
    handle = ctypes.CDLL(library, mode=getattr(os, "RTLD_NOLOAD", 4) | ctypes.RTLD_GLOBAL)
    return ctypes.cast(getattr(handle, symbol), ctypes.c_void_p).value
  except (OSError, AttributeError) as e:
    raise ElfError("%s does not export %s (%s)" % (library, symbol, e)) from None


def redirect_import(importer, symbol, exporter, replacement):
  """``importer``'s calls of ``symbol`` go to ``replacement`` (exported by ``exporter``) from now
  on; returns the ImportSlots, whose ``restore()`` undoes it. Raises ElfError."""
  slots = ImportSlots(importer, symbol)
  slots.redirect(function_address(exporter, replacement))
  return slots

