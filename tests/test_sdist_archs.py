"""The arch restriction of `kind: sdist_build`, run for real on a setup.py laid out like causal-conv1d's
(flags appended in -gencode pairs per nvcc release, then one top-level setup() call)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from fleetcuda.steps.sdist import PATCH_ARCHS

# Written for this test in the shape of causal-conv1d 1.7.0's setup.py; setup() is replaced by a print.
SETUP = '''
class Ext:
    def __init__(self, nvcc):
        self.extra_compile_args = {"cxx": ["-O3"], "nvcc": nvcc}

ext_modules = []
cc_flag = []
for arch in ("75", "80", "87", "90", "100", "120"):
    cc_flag.append("-gencode")
    cc_flag.append(f"arch=compute_{arch},code=sm_{arch}")
ext_modules.append(Ext(["-O3", "--use_fast_math"] + cc_flag + ["--threads", "4"]))
# literal flags as the real file spells them, so the edit can see what is offered:
# "arch=compute_75,code=sm_75" "arch=compute_80,code=sm_80" "arch=compute_87,code=sm_87"
# "arch=compute_90,code=sm_90" "arch=compute_100,code=sm_100" "arch=compute_120,code=sm_120"

def setup(**kw):
    print(kw["ext_modules"][0].extra_compile_args["nvcc"])

setup(
    ext_modules=ext_modules,
)
'''


def patch(tmp_path: Path, text: str, archs: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "setup.py"
    path.write_text(text)
    return subprocess.run([sys.executable, "-c", PATCH_ARCHS, str(path), archs], capture_output=True, text=True)


def test_restricts_the_gencode_pairs_the_compile_gets(tmp_path: Path) -> None:
    res = patch(tmp_path, SETUP, "90")
    assert res.returncode == 0, res.stderr
    assert "restricted the build to sm_90" in res.stdout
    built = subprocess.run([sys.executable, str(tmp_path / "setup.py")], capture_output=True, text=True, check=True)
    assert built.stdout.strip() == "['-O3', '--use_fast_math', '-gencode', 'arch=compute_90,code=sm_90', " \
                                   "'--threads', '4']"
    two = patch(tmp_path, SETUP, "90,120")
    assert two.returncode == 0
    built = subprocess.run([sys.executable, str(tmp_path / "setup.py")], capture_output=True, text=True, check=True)
    assert "sm_90" in built.stdout and "sm_120" in built.stdout and "sm_80" not in built.stdout


def test_refuses_an_arch_the_file_does_not_offer(tmp_path: Path) -> None:
    res = patch(tmp_path, SETUP, "89")
    assert res.returncode != 0
    assert "does not build for sm_89; it offers sm_100, sm_120, sm_75, sm_80, sm_87, sm_90" in res.stderr
    assert "fleetcuda" not in (tmp_path / "setup.py").read_text()  # left untouched


def test_refuses_a_changed_layout(tmp_path: Path) -> None:
    no_flags = patch(tmp_path, "ext_modules = []\nsetup(ext_modules=ext_modules)\n", "90")
    assert no_flags.returncode != 0 and "layout changed" in no_flags.stderr
    two_setups = SETUP + "\nsetup(\n)\n"
    res = patch(tmp_path, two_setups, "90")
    assert res.returncode != 0 and "layout changed" in res.stderr
    # Flags present but no extension carries nvcc args any more: refuse at build time, not build everything.
    moved = SETUP.replace('self.extra_compile_args = {"cxx": ["-O3"], "nvcc": nvcc}',
                          'self.extra_compile_args = {"cxx": ["-O3"], "cuda": nvcc}')
    assert patch(tmp_path, moved, "90").returncode == 0
    built = subprocess.run([sys.executable, str(tmp_path / "setup.py")], capture_output=True, text=True)
    assert built.returncode != 0 and "no extension with nvcc flags" in built.stderr
