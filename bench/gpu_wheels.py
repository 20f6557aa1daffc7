"""The packages a lent GPU machine lacks, as wheels in ``.whl/`` (ignored by git) to carry with a device call.

    python bench/gpu_wheels.py                  # cp312 manylinux wheels into .whl/ (22 MiB)
    python bench/gpu_wheels.py --python 3.11 --dest /tmp/whl311   # for this machine's Python (a local check)

The device image (Python 3.12, torch, Lightning, matplotlib, tensorboard, opencv, absl-py) lacks
:data:`WHEELS`. EnvPool's wheel (53 MB, every env family) is rewritten with its Atari engine alone:
the other families' compiled engines and assets are left out, and ``envpool/entry.py``, which
imports every family, imports the Atari registrations alone. On the device:

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEELS = [
    "gymnasium==1.4.0",
    "farama-notifications==0.0.6",
    "jsonargparse==4.53.0",
    "docstring-parser==0.18.0",
    "typeshed-client==2.15.0",
    "cma==4.5.0",
    "pygame==2.6.1",  # CartPole's frames (rgb_array)
    "ale-py==0.12.1",
    "minatar==1.0.15",
    "envpool==1.2.5",
    "dm-env==1.6",
    "dm-tree==0.1.10",
    "optree==0.20.0",
]
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64"]
PLATFORMS += ["manylinux2014_x86_64", "manylinux1_x86_64", "any"]
#: EnvPool's members kept beside every ``.py`` file: its Atari engine, its bundled libraries, its metadata
ENVPOOL_KEEP = ("envpool/atari/", "envpool.libs/", ".dist-info/")
ENVPOOL_ENTRY = '"""Registration of the envs this wheel keeps: Atari (bench/gpu_wheels.py)."""\n\nimport envpool.atari.registration  # noqa: F401\n'


def keep_in_envpool(name: str) -> bool:
    """Whether a member of EnvPool's wheel stays in the Atari-only wheel."""
    return name.endswith(".py") or any(part in name for part in ENVPOOL_KEEP)


def strip_envpool(wheel: Path) -> Path:
    """Rewrite EnvPool's wheel in place with :func:`keep_in_envpool`'s members; returns it."""
    stripped = wheel.with_suffix(".tmp")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(stripped, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if info.filename == "envpool/entry.py":  # every family's registration -> Atari's alone
                dst.writestr(info, ENVPOOL_ENTRY)
            elif keep_in_envpool(info.filename):
                dst.writestr(info, src.read(info.filename))
    stripped.replace(wheel)
    return wheel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dest", default=str(ROOT / ".whl"))
    parser.add_argument("--python", default="3.12", help="the device's Python (3.12)")
    args = parser.parse_args()
    dest = Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    tag = args.python.replace(".", "")
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version"]
    cmd += [args.python, "--implementation", "cp", "--abi", f"cp{tag}", "--abi", "none", "-d", str(dest)]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    subprocess.run(["timeout", "-k", "5", "600", *cmd, *WHEELS], check=True)
    for wheel in dest.glob("envpool-*.whl"):
        before = wheel.stat().st_size
        strip_envpool(wheel)
        print(f"{wheel.name}: {before / 2**20:.1f} MiB -> {wheel.stat().st_size / 2**20:.1f} MiB (Atari alone)")
    total = sum(p.stat().st_size for p in dest.glob("*.whl"))
    print(f"{len(list(dest.glob('*.whl')))} wheels, {total / 2**20:.1f} MiB in {dest}")


if __name__ == "__main__":
    main()
