#!/usr/bin/env bash
# NEEDS: dpkg gpg gpg-agent gpgconf apt-utils gzip coreutils util-linux
#
# build_repo.sh OUTDIR [REPO_BASE_URL]
#
# Builds a signed, flat apt repository laid out like NVIDIA's CUDA repository, for the fleetcuda lab
# (offline Debian 12 containers cannot reach NVIDIA's download server):
#
#   OUTDIR/compute/cuda/repos/debian12/x86_64/
#     cuda-keyring_1.1-1_all.deb            keyring + sources list pointing at REPO_BASE_URL
#     cuda-{cccl,cudart,cudart-dev,nvcc}-{12-8,13-0}_*.deb   stand-ins: placeholders and a fake nvcc
#                                           (the 13-0 ones real, see FLEETCUDA_CUDA13_DEBS below)
#     Packages Packages.gz Release Release.gpg InRelease
#     .fleetcuda-build                      stamp: what this build was made for (written last)
#
# REPO_BASE_URL (default file:///srv/fleetcuda-lab/apt) is where OUTDIR is visible inside the
# containers; the lab bind-mounts OUTDIR there read-only.  The signing key is generated per build in a
# throwaway GNUPGHOME, so a rebuild rotates it: containers must reinstall cuda-keyring afterwards.
# A complete build for the same REPO_BASE_URL by the same script is kept as it is (exit 0, no
# changes), unless FLEETCUDA_APT_REBUILD=1.  Exit codes: 0 ok, 2 usage, 3 a tool is missing.
#
# FLEETCUDA_CUDA13_DEBS=DIR: DIR is an output of cuda13_debs.py (the real CUDA 13.0 compiler, repackaged
# from NVIDIA's PyPI wheels, with cuda-crt-13-0, libnvvm-13-0, cuda-driver-dev-13-0 and the config-common
# packages): its .debs replace the 13-0 placeholders.  It must be complete and up to date, as
# `python3 cuda13_debs.py --check DIR` says (exit 1 if not).
set -euo pipefail

DISTRO=debian12
ARCH_DIR=x86_64
MAINTAINER="fleetcuda lab <lab@fleetcuda.invalid>"
KEY_UID="fleetcuda lab apt stand-in (NOT NVIDIA) <lab@fleetcuda.invalid>"
KEYRING_PATH=/usr/share/keyrings/cuda-archive-keyring.gpg
SOURCES_PATH=/etc/apt/sources.list.d/cuda-${DISTRO}-${ARCH_DIR}.list
STAMP=.fleetcuda-build
PLACEHOLDERS="Placeholder files only: nothing in it works as CUDA."

usage() {
    echo "usage: ${0##*/} OUTDIR [REPO_BASE_URL]" >&2
    echo "  REPO_BASE_URL: where OUTDIR is seen inside the containers (default file:///srv/fleetcuda-lab/apt)" >&2
    exit 2
}

if [ $# -lt 1 ] || [ $# -gt 2 ]; then usage; fi
case "$1" in -h|--help) usage ;; esac
OUTDIR=$1
BASE_URL=${2:-file:///srv/fleetcuda-lab/apt}
BASE_URL=${BASE_URL%/}
[ -n "$OUTDIR" ] || usage
# It ends up in a sources.list line, where whitespace would split it into other fields.
url_re='^[a-z][a-z0-9+.-]*:[^][[:space:]]+$'
if ! [[ $BASE_URL =~ $url_re ]]; then
    echo "${0##*/}: REPO_BASE_URL must be a URL without spaces or brackets, like file:///srv/x: $BASE_URL" >&2
    exit 2
fi

# tool -> the Debian package that ships it
declare -A TOOLS=(
    [dpkg-deb]=dpkg [gpg]=gpg [gpg-agent]=gpg-agent [gpgconf]=gpgconf [apt-ftparchive]=apt-utils
    [gzip]=gzip [md5sum]=coreutils [sha1sum]=coreutils [sha256sum]=coreutils [sha512sum]=coreutils
    [fmt]=coreutils [flock]=util-linux
)
declare -A packages=()
for tool in "${!TOOLS[@]}"; do
    if ! command -v "$tool" >/dev/null 2>&1; then
        echo "${0##*/}: missing tool: $tool (Debian package ${TOOLS[$tool]})" >&2
        packages[${TOOLS[$tool]}]=1
    fi
done
if [ ${#packages[@]} -gt 0 ]; then
    echo "${0##*/}: install with: apt-get install --no-install-recommends ${!packages[*]}" >&2
    exit 3
fi

umask 022
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
PARENT=$OUTDIR/compute/cuda/repos/$DISTRO
REPO=$PARENT/$ARCH_DIR
mkdir -p "$PARENT"
# apt downloads as the unprivileged _apt user, and unprivileged containers see host root's files as
# nobody's: the whole path must be world-readable.
chmod a+rx "$OUTDIR" "$OUTDIR/compute" "$OUTDIR/compute/cuda" "$OUTDIR/compute/cuda/repos" "$PARENT"

# Two builds into one OUTDIR at once would race on the directory swap at the end.
exec 9>"$OUTDIR/.fleetcuda-build.lock"
flock 9

SCRIPT_SHA=$(sha256sum "${BASH_SOURCE[0]}" | cut -d' ' -f1)
CUDA13_DEBS=${FLEETCUDA_CUDA13_DEBS:-}
CUDA13=placeholders
if [ -n "$CUDA13_DEBS" ]; then
    if ! python3 "$(dirname "${BASH_SOURCE[0]}")/cuda13_debs.py" --check "$CUDA13_DEBS"; then
        echo "${0##*/}: FLEETCUDA_CUDA13_DEBS=$CUDA13_DEBS is not a complete, current build of cuda13_debs.py" >&2
        exit 1
    fi
    CUDA13_DEBS=$(cd "$CUDA13_DEBS" && pwd)
    CUDA13="$CUDA13_DEBS sha256=$(sha256sum "$CUDA13_DEBS/.fleetcuda-cuda13" | cut -d' ' -f1)"
fi
WANT_STAMP=$(printf 'base_url=%s\nscript_sha256=%s\ncuda13=%s\n' "$BASE_URL" "$SCRIPT_SHA" "$CUDA13")
OUTPUTS=(Packages Packages.gz Release Release.gpg InRelease cuda-keyring_1.1-1_all.deb)

complete() {
    local f
    [ -f "$REPO/$STAMP" ] || return 1
    [ "$(cat "$REPO/$STAMP")" = "$WANT_STAMP" ] || return 1
    for f in "${OUTPUTS[@]}"; do [ -s "$REPO/$f" ] || return 1; done
}
if [ "${FLEETCUDA_APT_REBUILD:-0}" != 1 ] && complete; then
    echo "${0##*/}: $REPO is already built for $BASE_URL; nothing to do"
    exit 0
fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/fleetcuda-apt.XXXXXX")
export GNUPGHOME=$WORK/gnupg
STAGE=$PARENT/.$ARCH_DIR.new.$$
OLD=$PARENT/.$ARCH_DIR.old.$$
cleanup() {
    # The agent keeps running after gpg exits and holds the secret key: stop it, then remove it all.
    gpgconf --kill gpg-agent >/dev/null 2>&1 || true
    # Interrupted between the two renames of the swap: put the previous build back.
    if [ ! -e "$REPO" ] && [ -e "$OLD" ]; then mv "$OLD" "$REPO"; fi
    rm -rf "$WORK" "$STAGE" "$OLD"
}
trap cleanup EXIT
mkdir -m 700 "$GNUPGHOME" "$WORK/pkgs"
# A throwaway keyring holding only our own key: no web of trust to consult (and no trustdb chatter).
echo "trust-model always" >"$GNUPGHOME/gpg.conf"
mkdir "$STAGE"

# --- packaging helpers -----------------------------------------------------------------------------

# begin_pkg NAME: a fresh package tree; prints its path.
begin_pkg() {
    local root=$WORK/pkgs/$1
    mkdir -p "$root/DEBIAN"
    echo "$root"
}

# put ROOT PATH MODE: file content from stdin.
put() {
    mkdir -p "$(dirname "$1$2")"
    cat >"$1$2"
    chmod "$3" "$1$2"
}

# build_pkg ROOT NAME VERSION ARCH SECTION DEPENDS SUMMARY BODY
build_pkg() {
    local root=$1 name=$2 version=$3 arch=$4 section=$5 depends=$6 summary=$7 body=$8
    local size
    size=$(du -sk --exclude=DEBIAN "$root" | cut -f1)
    # md5sums as debhelper would write them, so that `dpkg --verify` works in the containers.
    (cd "$root" && find . -path ./DEBIAN -prune -o -type f -printf '%P\0' | sort -z \
        | xargs -0 -r md5sum >DEBIAN/md5sums)
    {
        echo "Package: $name"
        echo "Version: $version"
        echo "Architecture: $arch"
        echo "Maintainer: $MAINTAINER"
        echo "Installed-Size: $size"
        [ -z "$depends" ] || echo "Depends: $depends"
        echo "Section: $section"
        echo "Priority: optional"
        echo "Description: $summary (fleetcuda lab stand-in)"
        # Continuation lines of a control field start with a space.
        printf '%s\n' "fleetcuda lab stand-in for NVIDIA's $name, for testing provisioning in" \
            "offline containers; it does not come from NVIDIA." "$body" | fmt -w 78 | sed 's/^/ /'
    } >"$root/DEBIAN/control"
    dpkg-deb --root-owner-group --build "$root" "$STAGE/${name}_${version}_${arch}.deb" >/dev/null
}

# --- the keyring: key, sources list, package --------------------------------------------------------

if ! gpg --batch --pinentry-mode loopback --passphrase '' \
    --quick-generate-key "$KEY_UID" rsa3072 sign never >"$WORK/keygen.log" 2>&1; then
    cat "$WORK/keygen.log" >&2
    exit 1
fi
FPR=$(gpg --batch --with-colons --list-secret-keys | sed -n 's/^fpr:\{9\}\([0-9A-F]\{40\}\):.*/\1/p')
[ -n "$FPR" ] || { echo "${0##*/}: gpg did not create a key" >&2; exit 1; }

root=$(begin_pkg cuda-keyring)
# A binary keyring (not armored): what apt's signed-by and gpgv read for a .gpg file.
gpg --batch --export "$FPR" | put "$root" "$KEYRING_PATH" 0644
echo "deb [signed-by=$KEYRING_PATH] $BASE_URL/compute/cuda/repos/$DISTRO/$ARCH_DIR/ /" \
    | put "$root" "$SOURCES_PATH" 0644
# Only files under /etc are conffiles (Debian policy 10.7.2): an admin may edit the sources list and
# upgrades must not silently undo that; the keyring under /usr is data that upgrades replace.
echo "$SOURCES_PATH" >"$root/DEBIAN/conffiles"
build_pkg "$root" cuda-keyring 1.1-1 all misc "" "GPG keyring for the CUDA repository" \
    "It installs $KEYRING_PATH (the lab repository's signing key, not NVIDIA's) and $SOURCES_PATH, which points apt at $BASE_URL/compute/cuda/repos/$DISTRO/$ARCH_DIR/."

# --- the toolkit stand-ins ---------------------------------------------------------------------------

# toolkit X.Y NVCC_VERSION CUDART_VERSION CCCL_VERSION BUILT_ON BUILD_ID CUB_DIR
# Versions as in NVIDIA's repository: 12.8 update 1's set; for 13.0 one seen installed together
# (nvcc 13.0.88, cudart 13.0.96, cccl 13.0.85).
toolkit() {
    local xy=$1 nvcc_v=$2 cudart_v=$3 cccl_v=$4 built_on=$5 build_id=$6 cub_dir=$7
    local dashed=${xy//./-} major=${xy%%.*} prefix=/usr/local/cuda-$xy root
    local priority=$((${xy%%.*} * 10 + ${xy##*.}))

    # cuda-cccl: CUB/Thrust/libcu++ headers (CUDA 13 moved them under include/cccl/).
    root=$(begin_pkg "cuda-cccl-$dashed")
    put "$root" "$prefix/$cub_dir/cub.cuh" 0644 <<EOF
// fleetcuda lab stand-in for CUB from cuda-cccl-$dashed $cccl_v: a placeholder, not NVIDIA's header.
#error "fleetcuda lab stand-in: this is not a real CUB header"
EOF
    build_pkg "$root" "cuda-cccl-$dashed" "$cccl_v-1" amd64 devel "" "CUDA CCCL" "$PLACEHOLDERS"

    # cuda-cudart: the runtime library, and the /usr/local/cuda alternative (in NVIDIA's repository
    # the alternative comes from cuda-toolkit-X-Y-config-common, which cuda-cudart-X-Y depends on).
    root=$(begin_pkg "cuda-cudart-$dashed")
    put "$root" "$prefix/lib64/libcudart.so.$cudart_v" 0644 <<<"fleetcuda lab stand-in for libcudart $cudart_v (not a library)"
    ln -s "libcudart.so.$cudart_v" "$root$prefix/lib64/libcudart.so.$major"
    put "$root" /DEBIAN/postinst 0755 <<EOF
#!/bin/sh
set -e
if [ "\$1" = configure ]; then
    update-alternatives --install /usr/local/cuda cuda $prefix $priority
fi
EOF
    put "$root" /DEBIAN/prerm 0755 <<EOF
#!/bin/sh
set -e
if [ "\$1" = remove ] || [ "\$1" = deconfigure ]; then
    update-alternatives --remove cuda $prefix
fi
EOF
    build_pkg "$root" "cuda-cudart-$dashed" "$cudart_v-1" amd64 devel "" "CUDA Runtime native Libraries" \
        "$PLACEHOLDERS It registers $prefix as the /usr/local/cuda alternative."

    # cuda-cudart-dev: headers and the unversioned link-time name.
    root=$(begin_pkg "cuda-cudart-dev-$dashed")
    put "$root" "$prefix/include/cuda_runtime.h" 0644 <<EOF
/* fleetcuda lab stand-in for cuda_runtime.h from cuda-cudart-dev-$dashed $cudart_v.
 * A placeholder so that checks for the file pass; it declares nothing. */
#error "fleetcuda lab stand-in: this is not NVIDIA's cuda_runtime.h"
EOF
    mkdir -p "$root$prefix/lib64"
    ln -s "libcudart.so.$major" "$root$prefix/lib64/libcudart.so"
    build_pkg "$root" "cuda-cudart-dev-$dashed" "$cudart_v-1" amd64 devel \
        "cuda-cudart-$dashed (>= $cudart_v), cuda-cccl-$dashed (>= $cccl_v)" "CUDA Runtime native dev links, headers" \
        "$PLACEHOLDERS"

    # cuda-nvcc: a driver script that only knows --version, and that a compile needs a host compiler.
    root=$(begin_pkg "cuda-nvcc-$dashed")
    put "$root" "$prefix/bin/nvcc" 0755 <<EOF
#!/bin/sh
# fleetcuda lab stand-in for NVIDIA's nvcc $nvcc_v (package cuda-nvcc-$dashed): it only reports its version,
# and fails as NVIDIA's nvcc does when its host compiler is missing.
for arg in "\$@"; do
    case "\$arg" in
        --version|-V)
            cat <<'VERSION'
nvcc: NVIDIA (R) Cuda compiler driver
Copyright (c) 2005-2025 NVIDIA Corporation
Built on $built_on
Cuda compilation tools, release $xy, V$nvcc_v
Build cuda_$xy.r$xy/compiler.${build_id}_0
VERSION
            exit 0 ;;
    esac
done
# The host compiler as nvcc picks it: -ccbin / --compiler-bindir (a directory: its gcc), else \$NVCC_CCBIN,
# else gcc on PATH (never g++ or cc).  Without it, NVIDIA's nvcc (13.0.88, checked) prints these two lines
# on stderr and exits 1, before it looks at anything else.
ccbin=\${NVCC_CCBIN:-gcc} next=
for arg in "\$@"; do
    if [ -n "\$next" ]; then ccbin=\$arg next=; continue; fi
    case "\$arg" in
        -ccbin|--compiler-bindir) next=1 ;;
        -ccbin=*|--compiler-bindir=*) ccbin=\${arg#*=} ;;
    esac
done
if [ -d "\$ccbin" ]; then ccbin=\${ccbin%/}/gcc; fi
case "\$ccbin" in
    */*) [ -f "\$ccbin" ] && [ -x "\$ccbin" ] ;;
    *) command -v "\$ccbin" >/dev/null 2>&1 ;;
esac || {
    echo "\$ccbin: No such file or directory" >&2
    echo "nvcc fatal   : Failed to preprocess host compiler properties." >&2
    exit 1
}
echo "nvcc: this is the fleetcuda lab stand-in for nvcc $nvcc_v; it cannot compile (only --version / -V work)" >&2
exit 1
EOF
    build_pkg "$root" "cuda-nvcc-$dashed" "$nvcc_v-1" amd64 devel \
        "cuda-cudart-$dashed (>= $cudart_v), cuda-cccl-$dashed (>= $cccl_v)" "CUDA nvcc" \
        "Its nvcc is a shell script that answers --version like NVIDIA's nvcc $nvcc_v and cannot compile; without a host compiler it fails with nvcc's own message."
}

toolkit 12.8 12.8.93 12.8.90 12.8.90 Fri_Feb_21_20:23:50_PST_2025 35583870 include/cub
if [ -n "$CUDA13_DEBS" ]; then
    # The real ones (cuda13_debs.py); hard links where the file system allows, they are never modified.
    for deb in "$CUDA13_DEBS"/*.deb; do
        ln "$deb" "$STAGE/" 2>/dev/null || cp "$deb" "$STAGE/"
    done
else
    toolkit 13.0 13.0.88 13.0.96 13.0.85 Wed_Aug_20_01:58:59_PM_PDT_2025 36424714 include/cccl/cub
fi

# --- indices and signatures --------------------------------------------------------------------------

(
    cd "$STAGE"
    # Flat repository: Filename: ./name.deb, no dists/, no Suite or Components (like NVIDIA's).
    apt-ftparchive packages . >Packages 2>"$WORK/ftparchive.log" || { cat "$WORK/ftparchive.log" >&2; exit 1; }
    gzip -9n <Packages >Packages.gz
    # Release as NVIDIA writes theirs: Origin, Label, Architecture, Date, then the digests.
    {
        echo "Origin: NVIDIA"
        echo "Label: NVIDIA CUDA"
        echo "Architecture: $ARCH_DIR"
        echo "Date: $(LC_ALL=C date -u -R)"
        echo "Description: fleetcuda lab stand-in for NVIDIA's CUDA repository ($DISTRO/$ARCH_DIR)"
        for algo in MD5Sum:md5sum SHA1:sha1sum SHA256:sha256sum SHA512:sha512sum; do
            echo "${algo%%:*}:"
            for f in Packages Packages.gz; do
                printf ' %s %16d %s\n' "$(${algo#*:} <"$f" | cut -d' ' -f1)" "$(stat -c %s "$f")" "$f"
            done
        done
    } >Release
    # SHA-512 digests: apt rejects SHA-1 signatures.
    gpg --batch --yes --quiet --local-user "$FPR" --digest-algo SHA512 --armor --detach-sign -o Release.gpg Release
    gpg --batch --yes --quiet --local-user "$FPR" --digest-algo SHA512 --clearsign -o InRelease Release
    printf '%s\n' "$WANT_STAMP" >"$STAMP"
)

# Swap the finished tree in, so that a reader never sees half a repository.
if [ -e "$REPO" ]; then
    mv "$REPO" "$OLD"
fi
mv "$STAGE" "$REPO"
chmod 0755 "$REPO"
rm -rf "$OLD"
echo "${0##*/}: built $REPO for $BASE_URL (signing key $FPR)"
