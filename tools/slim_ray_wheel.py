"""Make Ray's wheel fit the device's 64 MiB carry: the same wheel less `ray/jars/` (the Java
worker's jars, about 31 MiB zipped; a Python-only cluster never loads them), its RECORD
rewritten to match. Usage: python3 tools/slim_ray_wheel.py .whl-ray/ray-*.whl (in place)."""

import sys
import zipfile
from pathlib import Path

DROP = ("ray/jars/",)


def slim(wheel: Path) -> None:
    out = wheel.with_suffix(".slim")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if info.filename.startswith(DROP):
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines(keepends=True)
                data = "".join(line for line in lines if not line.startswith(DROP)).encode()
            dst.writestr(info, data)
    out.replace(wheel)


if __name__ == "__main__":
    for name in sys.argv[1:]:
        before = Path(name).stat().st_size
        slim(Path(name))
        print(f"{name}: {before / 2**20:.1f} MiB -> {Path(name).stat().st_size / 2**20:.1f} MiB")
