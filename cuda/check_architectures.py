#!/usr/bin/env python3
"""ctest cuda_architectures: lists the GPU code embedded in a built library or object (the CUDA
fat binaries of its .nv_fatbin sections: machine code per sm_XX, PTX per compute_XX, as
`cuobjdump --list-elf / --list-ptx` would; the toolkit here ships no cuobjdump) and checks it
against CMAKE_CUDA_ARCHITECTURES.

    check_architectures.py LIBRARY_OR_OBJECT "80-real;86-real;89-real;90"

An entry "N" means machine code and PTX for N, "N-real" machine code only, "N-virtual" PTX only.
Exits 1 naming what is missing (or when there is no GPU code at all).

Fat binary layout (little-endian), as nvcc writes it: a 16-byte header (u32 magic 0xBA55ED50,
u16 version, u16 header size, u64 size of the entries that follow), then entries, each a header
(u16 kind: 1 PTX, 2 ELF; u16; u32 header size; u64 payload size; ...; u32 arch at offset 28)
followed by its payload."""
import os
import struct
import subprocess
import sys
import tempfile

MAGIC = 0xBA55ED50


def fatbin_entries(blob):
    """(kind, arch) of every entry of the fat binaries concatenated in `blob`."""
    out, off = [], 0
    while off + 16 <= len(blob):
        magic, _, hsz, fsz = struct.unpack_from("<IHHQ", blob, off)
        if magic != MAGIC:
            raise ValueError(f"fat binary header expected at byte {off}, found {magic:#x}")
        e, end = off + hsz, off + hsz + fsz
        while e < end:
            kind, _, ehs, size = struct.unpack_from("<HHIQ", blob, e)
            arch = struct.unpack_from("<I", blob, e + 28)[0]
            out.append(("ptx" if kind == 1 else "elf" if kind == 2 else f"kind{kind}", arch))
            e += ehs + size
        off = end
    return out


def section(obj_path, workdir):
    """The .nv_fatbin section of one object file (b"" when it has none)."""
    dst = os.path.join(workdir, "section.bin")
    r = subprocess.run(["objcopy", "-O", "binary", "--only-section=.nv_fatbin", obj_path, dst],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"objcopy {obj_path}: {r.stderr.strip()}")
    with open(dst, "rb") as f:
        return f.read()


def entries_of(path):
    with tempfile.TemporaryDirectory() as d:
        with open(path, "rb") as f:
            is_archive = f.read(8) == b"!<arch>\n"
        if not is_archive:
            return fatbin_entries(section(path, d))
        members = subprocess.run(["ar", "t", path], capture_output=True, text=True,
                                 check=True).stdout.split()
        out = []
        for m in members:
            obj = os.path.join(d, "member.o")
            with open(obj, "wb") as f:
                f.write(subprocess.run(["ar", "p", path, m], capture_output=True, check=True).stdout)
            out += fatbin_entries(section(obj, d))
        return out


def main(argv):
    if len(argv) != 3:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    found = set(entries_of(argv[1]))
    for kind, arch in sorted(found, key=lambda e: (e[1], e[0])):
        print(f"{'sm' if kind == 'elf' else 'compute'}_{arch}: {kind}")
    missing = []
    for entry in filter(None, argv[2].split(";")):
        n, _, suffix = entry.partition("-")
        if suffix != "virtual" and ("elf", int(n)) not in found:
            missing.append(f"sm_{n} machine code")
        if suffix != "real" and ("ptx", int(n)) not in found:
            missing.append(f"compute_{n} PTX")
    if not found:
        missing.append("any GPU code")
    if missing:
        print(f"{argv[1]}: missing {', '.join(missing)} (CMAKE_CUDA_ARCHITECTURES {argv[2]})")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
