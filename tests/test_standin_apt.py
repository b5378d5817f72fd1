"""The stand-in for NVIDIA's apt repository (tests/lab/standins/apt/build_repo.sh).

The lab's containers are offline Debian 12 (minbase), so fleetcuda's keyring and package steps run there
against this stand-in.  These tests hold it to what matters about the real one: nothing is installable
until cuda-keyring is installed, apt then verifies the repository's signature with that keyring (and
rejects a tampered or foreign one), and the packages install the paths and `nvcc --version` output that
fleetcuda's checks read.  apt and dpkg run for real, in a debootstrapped bookworm minbase under chroot.

The base root filesystem is made once per session (about 30 s), or taken from $FLEETCUDA_TEST_ROOTFS
when that names an existing one; every test works on its own `cp -a` copy.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "tests/lab/standins/apt/build_repo.sh"
# The mirror of this machine's own apt sources (never a host of ours): the same lookup as the lab's.
sys.path.insert(0, str(ROOT / "tests" / "lab"))
from labctl import debian_mirror  # noqa: E402

MIRROR = debian_mirror()
LAB_MOUNT = "/srv/fleetcuda-lab/apt"  # where the lab bind-mounts OUTDIR in its containers
DEFAULT_URL = f"file://{LAB_MOUNT}"
SUBDIR = "compute/cuda/repos/debian12/x86_64"
KEYRING_DEB = "cuda-keyring_1.1-1_all.deb"
KEYRING = "/usr/share/keyrings/cuda-archive-keyring.gpg"
SOURCES = "/etc/apt/sources.list.d/cuda-debian12-x86_64.list"
# Dpkg::Use-Pty=0: a chroot has no /dev/pts, and dpkg's pty logging would print an error.
APT = "apt-get -q -o Dpkg::Use-Pty=0"

DEBS = {
    KEYRING_DEB: ("cuda-keyring", "1.1-1", "all"),
    "cuda-cccl-12-8_12.8.90-1_amd64.deb": ("cuda-cccl-12-8", "12.8.90-1", "amd64"),
    "cuda-cudart-12-8_12.8.90-1_amd64.deb": ("cuda-cudart-12-8", "12.8.90-1", "amd64"),
    "cuda-cudart-dev-12-8_12.8.90-1_amd64.deb": ("cuda-cudart-dev-12-8", "12.8.90-1", "amd64"),
    "cuda-nvcc-12-8_12.8.93-1_amd64.deb": ("cuda-nvcc-12-8", "12.8.93-1", "amd64"),
    "cuda-cccl-13-0_13.0.85-1_amd64.deb": ("cuda-cccl-13-0", "13.0.85-1", "amd64"),
    "cuda-cudart-13-0_13.0.96-1_amd64.deb": ("cuda-cudart-13-0", "13.0.96-1", "amd64"),
    "cuda-cudart-dev-13-0_13.0.96-1_amd64.deb": ("cuda-cudart-dev-13-0", "13.0.96-1", "amd64"),
    "cuda-nvcc-13-0_13.0.88-1_amd64.deb": ("cuda-nvcc-13-0", "13.0.88-1", "amd64"),
}
INDICES = ("Packages", "Packages.gz", "Release", "Release.gpg", "InRelease", ".fleetcuda-build")

NVCC_VERSION = {
    "12.8": (
        "nvcc: NVIDIA (R) Cuda compiler driver\n"
        "Copyright (c) 2005-2025 NVIDIA Corporation\n"
        "Built on Fri_Feb_21_20:23:50_PST_2025\n"
        "Cuda compilation tools, release 12.8, V12.8.93\n"
        "Build cuda_12.8.r12.8/compiler.35583870_0\n"
    ),
    "13.0": (
        "nvcc: NVIDIA (R) Cuda compiler driver\n"
        "Copyright (c) 2005-2025 NVIDIA Corporation\n"
        "Built on Wed_Aug_20_01:58:59_PM_PDT_2025\n"
        "Cuda compilation tools, release 13.0, V13.0.88\n"
        "Build cuda_13.0.r13.0/compiler.36424714_0\n"
    ),
}


def unavailable(reason: str) -> None:
    """Skip when the machine lacks a real part, except under CI, where that would hide lost coverage."""
    if os.environ.get("CI"):
        pytest.fail(reason)
    pytest.skip(reason)


def need_root(why: str) -> None:
    if os.geteuid() != 0:
        unavailable(f"{why} needs root (chroot, mount, dpkg in a root filesystem)")


def run(argv: list[str], timeout: float = 120, **kwargs) -> subprocess.CompletedProcess[str]:
    """Run argv, stdout and stderr together (apt interleaves them), never raising on exit status."""
    return subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout, check=False, **kwargs)


def ensure_debs(packages: list[str], why: str) -> None:
    """Install missing Debian packages from the lists already present (no `apt-get update`: this
    machine's other sources are not ours to contact); skip or fail when that is not possible."""
    missing = [p for p in packages
               if not run(["dpkg-query", "-W", "-f=${db:Status-Abbrev}", p]).stdout.startswith("ii")]
    if not missing:
        return
    if os.geteuid() != 0:
        unavailable(f"{why} needs Debian packages {' '.join(missing)}")
    result = run(["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing], timeout=300,
                 env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    if result.returncode != 0:
        unavailable(f"{why} needs Debian packages {' '.join(missing)}; apt-get install failed:\n"
                    f"{result.stdout[-2000:]}")


def script_needs() -> list[str]:
    """The Debian packages build_repo.sh lists on its `# NEEDS:` line."""
    for line in BUILD.read_text(encoding="utf-8").splitlines():
        if line.startswith("# NEEDS:"):
            return line.split(":", 1)[1].split()
    raise AssertionError(f"{BUILD} has no '# NEEDS:' line")


def build(outdir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return run(["bash", str(BUILD), str(outdir), *args])


def extract(deb: Path, member: str, dest: Path) -> Path:
    """One file of a .deb's data part, as bytes on disk."""
    data = subprocess.run(["dpkg-deb", "--fsys-tarfile", str(deb)], capture_output=True, check=True).stdout
    body = subprocess.run(["tar", "-xO", "." + member], input=data, capture_output=True, check=True).stdout
    dest.write_bytes(body)
    return dest


def tamper(path: Path, old: bytes, new: bytes) -> None:
    """Change bytes inside a signed text without changing its length: only the signature can tell."""
    assert len(old) == len(new)
    data = path.read_bytes()
    assert data.count(old) == 1, f"{old!r} not exactly once in {path}"
    path.write_bytes(data.replace(old, new))


# --- fixtures ---------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def build_tools() -> None:
    ensure_debs(script_needs(), "building the apt stand-in")


@pytest.fixture(scope="session")
def built_repo(build_tools: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """OUTDIR of one build for the lab's default URL; tests that change it work on a copy."""
    outdir = tmp_path_factory.mktemp("apt-standin")
    result = build(outdir)
    assert result.returncode == 0, result.stdout
    return outdir


@pytest.fixture(scope="session")
def base_rootfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A Debian 12 minbase root filesystem, never modified: tests copy it."""
    need_root("the Debian 12 chroot")
    cached = os.environ.get("FLEETCUDA_TEST_ROOTFS")
    if cached and Path(cached).is_dir():
        rootfs = Path(cached)
        release = rootfs / "etc/debian_version"
        assert (rootfs / "usr/bin/apt-get").exists() and release.read_text().startswith("12"), (
            f"FLEETCUDA_TEST_ROOTFS={cached} is not a Debian 12 root filesystem")
        yield rootfs
        return
    ensure_debs(["debootstrap"], "the Debian 12 chroot")
    try:  # A quick probe: debootstrap's own downloads retry for many minutes before giving up.
        urllib.request.urlopen(f"{MIRROR}/dists/bookworm/InRelease", timeout=15).close()
    except OSError as err:
        unavailable(f"debootstrap cannot reach the Debian mirror {MIRROR}: {err}")
    rootfs = tmp_path_factory.mktemp("bookworm-minbase") / "root"
    result = run(["debootstrap", "--variant=minbase", "bookworm", str(rootfs), MIRROR], timeout=600)
    if result.returncode != 0:
        unavailable(f"debootstrap --variant=minbase bookworm failed:\n{result.stdout[-3000:]}")
    yield rootfs
    shutil.rmtree(rootfs, ignore_errors=True)


def mounts_under(path: Path) -> list[str]:
    prefix = str(path.resolve())
    with open("/proc/self/mountinfo", encoding="utf-8") as info:
        points = [line.split()[4] for line in info]
    return [p for p in points if p == prefix or p.startswith(prefix + "/")]


class Container:
    """A copy of the base root filesystem, offline like the lab's containers: no Debian sources, only
    the stand-in repository, bind-mounted read-only where the lab mounts it."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def sh(self, script: str) -> subprocess.CompletedProcess[str]:
        env = ["/usr/bin/env", "-i", "PATH=/usr/sbin:/usr/bin:/sbin:/bin", "HOME=/root", "LC_ALL=C",
               "DEBIAN_FRONTEND=noninteractive"]
        return run(["chroot", str(self.root), *env, "/bin/sh", "-c", script])

    def put(self, source: Path, directory: str) -> None:
        target = self.root / directory.lstrip("/") / source.name
        shutil.copyfile(source, target)
        target.chmod(0o644)  # readable by apt's _apt user, like a downloaded file


@contextmanager
def container(base: Path, repo: Path, workdir: Path) -> Iterator[Container]:
    root = workdir / "root"
    mounted: list[Path] = []
    try:
        subprocess.run(["cp", "-a", "--reflink=auto", str(base), str(root)], check=True)
        (root / "etc/apt/sources.list").unlink(missing_ok=True)
        for leftover in [*(root / "etc/apt/sources.list.d").glob("*"), *(root / "var/lib/apt/lists").glob("*")]:
            if leftover.is_file():
                leftover.unlink()
        lab = root / LAB_MOUNT.lstrip("/")
        lab.mkdir(parents=True, exist_ok=True)
        # A shared base could hold an absolute symlink on the way (/srv -> /data): never mount outside.
        assert lab.resolve().is_relative_to(root.resolve()), f"{lab} leads out of the root filesystem"
        subprocess.run(["mount", "-t", "proc", "proc", str(root / "proc")], check=True)
        mounted.append(root / "proc")
        subprocess.run(["mount", "--bind", str(repo), str(lab)], check=True)
        mounted.append(lab)
        # Read-only as in the lab: apt must not need to write into the repository.
        subprocess.run(["mount", "-o", "remount,bind,ro", str(lab)], check=True)
        yield Container(root)
    finally:
        for point in reversed(mounted):
            if subprocess.run(["umount", str(point)], check=False).returncode != 0:
                subprocess.run(["umount", "-l", str(point)], check=False)
        # Deleting with a mount still inside would reach into the repository or /proc.
        left = mounts_under(root)
        assert not left, f"still mounted, {root} kept: {left}"
        if root.exists():
            shutil.rmtree(root)


@pytest.fixture
def make_container(base_rootfs: Path, tmp_path: Path) -> Iterator[Callable[[Path], Container]]:
    """make_container(repo): a fresh container with repo as the lab's repository mount."""
    with ExitStack() as stack:
        def make(repo: Path) -> Container:
            workdir = Path(tempfile.mkdtemp(prefix="box", dir=tmp_path))
            return stack.enter_context(container(base_rootfs, repo, workdir))

        yield make


@pytest.fixture(scope="module")
def provisioned(base_rootfs: Path, built_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """One container taken through fleetcuda's sequence; each step's result is kept for the tests."""
    steps: dict[str, subprocess.CompletedProcess[str]] = {}
    with container(base_rootfs, built_repo, tmp_path_factory.mktemp("provisioned")) as box:
        steps["before-keyring"] = box.sh(f"{APT} update && {APT} install -y cuda-nvcc-12-8")
        box.put(built_repo / SUBDIR / KEYRING_DEB, "/tmp")
        steps["keyring"] = box.sh(f"cd /tmp && {APT} install -y ./{KEYRING_DEB}")
        steps["update"] = box.sh(f"{APT} update")
        steps["install-12.8"] = box.sh(f"{APT} install -y --no-install-recommends cuda-nvcc-12-8 cuda-cudart-dev-12-8")
        steps["alternative-12.8"] = box.sh("readlink -f /usr/local/cuda")
        steps["install-13.0"] = box.sh(f"{APT} install -y --no-install-recommends cuda-nvcc-13-0 cuda-cudart-dev-13-0")
        yield box, steps


# --- the script on its own --------------------------------------------------------------------------

def test_usage_errors(tmp_path: Path) -> None:
    result = run(["bash", str(BUILD)])
    assert result.returncode == 2 and "usage: build_repo.sh OUTDIR [REPO_BASE_URL]" in result.stdout
    result = build(tmp_path, "file:///srv/with space")
    assert result.returncode == 2 and "REPO_BASE_URL" in result.stdout
    assert not (tmp_path / "compute").exists()


def test_layout_and_control_fields(built_repo: Path, tmp_path: Path) -> None:
    repo = built_repo / SUBDIR
    assert sorted(p.name for p in repo.iterdir()) == sorted([*DEBS, *INDICES])
    for filename, (package, version, arch) in DEBS.items():
        fields = run(["dpkg-deb", "-f", str(repo / filename)]).stdout
        for expected in (f"Package: {package}\n", f"Version: {version}\n", f"Architecture: {arch}\n",
                         "Maintainer: fleetcuda lab <lab@fleetcuda.invalid>\n", "Priority: optional\n",
                         "Section: ", "fleetcuda lab stand-in"):
            assert expected in fields, f"{filename}: no {expected!r} in\n{fields}"
    deps = {name: run(["dpkg-deb", "-f", str(repo / name), "Depends"]).stdout.strip() for name in DEBS}
    assert deps["cuda-nvcc-12-8_12.8.93-1_amd64.deb"] == "cuda-cudart-12-8 (>= 12.8.90), cuda-cccl-12-8 (>= 12.8.90)"
    assert deps["cuda-cudart-dev-13-0_13.0.96-1_amd64.deb"] == (
        "cuda-cudart-13-0 (>= 13.0.96), cuda-cccl-13-0 (>= 13.0.85)")

    keyring_deb = repo / KEYRING_DEB
    conffiles = subprocess.run(["dpkg-deb", "--info", str(keyring_deb), "conffiles"],
                               capture_output=True, text=True, check=True).stdout
    assert conffiles.split() == [SOURCES]  # /usr/share/keyrings is not /etc: not a conffile
    sources = extract(keyring_deb, SOURCES, tmp_path / "sources.list").read_text()
    assert sources == f"deb [signed-by={KEYRING}] {DEFAULT_URL}/{SUBDIR}/ /\n"
    keyring = extract(keyring_deb, KEYRING, tmp_path / "keyring.gpg")
    assert keyring.read_bytes()[0] & 0x80, "keyring is not a binary OpenPGP keyring"  # armor starts with '-'

    release = (repo / "Release").read_text()
    assert release.startswith("Origin: NVIDIA\nLabel: NVIDIA CUDA\n")
    assert "Suite:" not in release and "Components:" not in release  # a flat repository
    for signed in (["InRelease"], ["Release.gpg", "Release"]):
        result = run(["gpgv", "--keyring", str(keyring), *[str(repo / f) for f in signed]])
        assert result.returncode == 0, result.stdout


def test_nvcc_standin(built_repo: Path, tmp_path: Path) -> None:
    for xy, deb in (("12.8", "cuda-nvcc-12-8_12.8.93-1_amd64.deb"), ("13.0", "cuda-nvcc-13-0_13.0.88-1_amd64.deb")):
        nvcc = extract(built_repo / SUBDIR / deb, f"/usr/local/cuda-{xy}/bin/nvcc", tmp_path / f"nvcc-{xy}")
        for flag in ("--version", "-V"):
            result = subprocess.run(["sh", str(nvcc), flag], capture_output=True, text=True, check=False)
            assert (result.returncode, result.stdout, result.stderr) == (0, NVCC_VERSION[xy], "")
        result = subprocess.run(["sh", str(nvcc), "-c", "x.cu"], capture_output=True, text=True, check=False)
        assert result.returncode == 1 and result.stdout == ""
        assert "fleetcuda lab stand-in" in result.stderr and "cannot compile" in result.stderr


def test_rebuild_is_idempotent_per_base_url(build_tools: None, tmp_path: Path) -> None:
    outdir = tmp_path / "out"
    repo = outdir / SUBDIR
    assert build(outdir).returncode == 0
    inrelease = (repo / "InRelease").stat().st_mtime_ns, (repo / "InRelease").read_bytes()
    again = build(outdir)
    assert again.returncode == 0 and "nothing to do" in again.stdout
    assert ((repo / "InRelease").stat().st_mtime_ns, (repo / "InRelease").read_bytes()) == inrelease

    elsewhere = build(outdir, "http://lab.invalid/apt/")
    assert elsewhere.returncode == 0 and "nothing to do" not in elsewhere.stdout
    sources = extract(repo / KEYRING_DEB, SOURCES, tmp_path / "sources.list").read_text()
    assert sources == f"deb [signed-by={KEYRING}] http://lab.invalid/apt/{SUBDIR}/ /\n"
    assert (repo / "InRelease").read_bytes() != inrelease[1]
    # The swap left no staging or old trees behind.
    assert sorted(p.name for p in outdir.iterdir()) == [".fleetcuda-build.lock", "compute"]
    assert [p.name for p in repo.parent.iterdir()] == ["x86_64"]


# --- in a Debian 12 minbase container ---------------------------------------------------------------

def test_unknown_package_before_keyring(provisioned) -> None:
    _, steps = provisioned
    result = steps["before-keyring"]
    assert result.returncode == 100, result.stdout
    assert "E: Unable to locate package cuda-nvcc-12-8" in result.stdout


def test_keyring_installs(provisioned) -> None:
    box, steps = provisioned
    assert steps["keyring"].returncode == 0, steps["keyring"].stdout
    status = box.sh("dpkg-query -W -f='${db:Status-Abbrev}' cuda-keyring").stdout
    assert status.startswith("ii"), status
    conffiles = box.sh("dpkg-query -W -f='${Conffiles}' cuda-keyring").stdout.split()
    assert conffiles[0] == SOURCES, conffiles
    assert box.sh(f"cat {SOURCES}").stdout == f"deb [signed-by={KEYRING}] {DEFAULT_URL}/{SUBDIR}/ /\n"
    assert box.sh(f"test -s {KEYRING}").returncode == 0


def test_update_and_install(provisioned) -> None:
    box, steps = provisioned
    update = steps["update"]
    assert update.returncode == 0, update.stdout
    # A clean update: signature trouble shows up as "W: GPG error" lines even when apt carries on.
    assert not [line for line in update.stdout.splitlines() if line.startswith(("W:", "E:"))], update.stdout
    install = steps["install-12.8"]
    assert install.returncode == 0, install.stdout
    for package in ("cuda-nvcc-12-8", "cuda-cudart-dev-12-8", "cuda-cudart-12-8", "cuda-cccl-12-8"):
        assert box.sh(f"dpkg-query -W -f='${{db:Status-Abbrev}}' {package}").stdout.startswith("ii"), package
    for path in ("bin/nvcc", "include/cuda_runtime.h", "include/cub/cub.cuh", "lib64/libcudart.so"):
        assert box.sh(f"test -e /usr/local/cuda-12.8/{path}").returncode == 0, path
    assert steps["alternative-12.8"].stdout == "/usr/local/cuda-12.8\n"
    verify = box.sh("dpkg --verify cuda-keyring cuda-nvcc-12-8 cuda-cudart-dev-12-8 cuda-cudart-12-8 cuda-cccl-12-8")
    assert (verify.returncode, verify.stdout) == (0, "")


def test_nvcc_version(provisioned) -> None:
    box, _ = provisioned
    assert box.sh("/usr/local/cuda-12.8/bin/nvcc --version").stdout == NVCC_VERSION["12.8"]
    # fleetcuda's own check, verbatim.
    assert box.sh('/usr/local/cuda-12.8/bin/nvcc --version | grep -q "release 12.8,"').returncode == 0


def test_second_toolkit_side_by_side(provisioned) -> None:
    box, steps = provisioned
    assert steps["install-13.0"].returncode == 0, steps["install-13.0"].stdout
    assert box.sh("/usr/local/cuda-13.0/bin/nvcc -V").stdout == NVCC_VERSION["13.0"]
    assert box.sh("test -e /usr/local/cuda-13.0/include/cccl/cub/cub.cuh").returncode == 0  # CUDA 13's layout
    assert box.sh("/usr/local/cuda-12.8/bin/nvcc -V").stdout == NVCC_VERSION["12.8"]
    # Like NVIDIA's update-alternatives priorities: the newest toolkit becomes /usr/local/cuda.
    assert box.sh("readlink -f /usr/local/cuda").stdout == "/usr/local/cuda-13.0\n"


def bad_repository(box: Container, keyring_deb: Path, expected: str) -> None:
    """With cuda-keyring installed, `apt-get update` rejects the repository and nothing is installable."""
    box.put(keyring_deb, "/tmp")
    assert box.sh(f"{APT} install -y /tmp/{KEYRING_DEB}").returncode == 0
    update = box.sh(f"{APT} update")
    assert update.returncode != 0, update.stdout
    assert expected in update.stdout and "is not signed" in update.stdout, update.stdout
    install = box.sh(f"{APT} install -y --no-install-recommends cuda-nvcc-12-8")
    assert "E: Unable to locate package cuda-nvcc-12-8" in install.stdout, install.stdout


def test_tampered_inrelease_is_rejected(built_repo: Path, tmp_path: Path, make_container) -> None:
    copy = tmp_path / "repo"
    shutil.copytree(built_repo, copy, symlinks=True)
    tamper(copy / SUBDIR / "InRelease", b"Label: NVIDIA CUDA\n", b"Label: NVIDIA CUDB\n")
    # apt does not fall back to Release + Release.gpg (both intact here) when InRelease is bad.
    bad_repository(make_container(copy), copy / SUBDIR / KEYRING_DEB, "BADSIG")


def test_tampered_release_is_rejected(built_repo: Path, tmp_path: Path, make_container) -> None:
    copy = tmp_path / "repo"
    shutil.copytree(built_repo, copy, symlinks=True)
    (copy / SUBDIR / "InRelease").unlink()  # so that apt reads Release and Release.gpg
    tamper(copy / SUBDIR / "Release", b"Label: NVIDIA CUDA\n", b"Label: NVIDIA CUDB\n")
    bad_repository(make_container(copy), copy / SUBDIR / KEYRING_DEB, "BADSIG")


def test_other_builds_key_is_rejected(built_repo: Path, tmp_path: Path, make_container) -> None:
    # Each build signs with a new key: a container holding an older build's cuda-keyring must fail.
    rebuilt = tmp_path / "rebuilt"
    result = build(rebuilt)
    assert result.returncode == 0, result.stdout
    bad_repository(make_container(rebuilt), built_repo / SUBDIR / KEYRING_DEB, "NO_PUBKEY")
