# `fleetcuda discover`: what a Proxmox host says of its containers, and which Python environments inside a
# container hold torch. Functions, inlined in the script that calls one; POSIX sh (they need no bash, and no
# python3 outside an environment). They report in frames (the run's nonce is in $fcn, read from stdin).

# fleetcuda_discover_frame KIND FIELDS...: one frame line (fields hold no whitespace).
fleetcuda_discover_frame() {
  printf '\n%s\n' "@@fleetcuda:${fcn} $*"
}

# fleetcuda_discover_payload FILE: a file's text (at most 1 MiB) as payload lines, each prefixed with "| ".
fleetcuda_discover_payload() {
  head -c 1048576 "$1" | sed -e 's/^/| /' -e '$a\'
}

# fleetcuda_discover_host PCT SUDO: `pct list`, then `pct config VMID` of every vmid it lists. Each command's
# stdout in a frame `pve WHAT VMID RC` (WHAT: list or config; VMID `-` for list), its stderr (pct's warnings
# and errors) in the frame `pve-err WHAT VMID` after it; `pve-done COUNT` closes the report.
fleetcuda_discover_host() {
  fd_pct=$1
  fd_sudo=$2
  fd_tmp=$(mktemp -d "${TMPDIR:-/tmp}/fleetcuda-discover.XXXXXX") || exit 1
  trap 'rm -rf "$fd_tmp"' EXIT
  fleetcuda_discover_pct list - || return 0
  fd_count=0
  # The list's rows: VMID first; anything that is not a number (the header) is no vmid.
  while read -r fd_id fd_rest; do
    case $fd_id in '' | *[!0-9]*) continue ;; esac
    fleetcuda_discover_pct config "$fd_id"
    fd_count=$((fd_count + 1))
  done < "$fd_tmp/list.out"
  fleetcuda_discover_frame pve-done "$fd_count"
}

# fleetcuda_discover_pct WHAT VMID: run `pct WHAT [VMID]` (through `sudo -n` when asked) and frame it; fails
# when pct did.
fleetcuda_discover_pct() {
  if [ "$2" = - ]; then set -- "$1" - "$1"; else set -- "$1" "$2" "$1" "$2"; fi
  fd_what=$1
  fd_vmid=$2
  shift 2
  if [ "$fd_sudo" = 1 ]; then
    sudo -n -- "$fd_pct" "$@" > "$fd_tmp/$fd_what.out" 2> "$fd_tmp/$fd_what.err" < /dev/null
  else
    "$fd_pct" "$@" > "$fd_tmp/$fd_what.out" 2> "$fd_tmp/$fd_what.err" < /dev/null
  fi
  fd_rc=$?
  fleetcuda_discover_frame pve "$fd_what" "$fd_vmid" "$fd_rc"
  fleetcuda_discover_payload "$fd_tmp/$fd_what.out"
  fleetcuda_discover_frame pve-err "$fd_what" "$fd_vmid"
  fleetcuda_discover_payload "$fd_tmp/$fd_what.err"
  return "$fd_rc"
}

# fleetcuda_discover_word TEXT: TEXT when it is one plain word (a version), else `?`; `-` when empty.
fleetcuda_discover_word() {
  case $1 in
    '') printf '%s' - ;;
    *[!A-Za-z0-9.+_-]*) printf '%s' '?' ;;
    *) printf '%s' "$1" ;;
  esac
}

# fleetcuda_discover_torch SITE: torch's version and CUDA from SITE/torch/version.py, read, never imported.
fleetcuda_discover_torch() {
  fd_v=$(sed -n "s/^__version__ *= *['\"]\([^'\"]*\)['\"].*/\1/p" "$1/torch/version.py" 2>/dev/null | head -n 1)
  fd_c=$(sed -n "s/^cuda *\(:[^=]*\)*= *['\"]\([^'\"]*\)['\"].*/\2/p" "$1/torch/version.py" 2>/dev/null | head -n 1)
  if [ -z "$fd_c" ] && grep -q '^cuda *\(:[^=]*\)*= *None' "$1/torch/version.py" 2>/dev/null; then fd_c=none; fi
  printf '%s %s' "$(fleetcuda_discover_word "$(printf '%s' "$fd_v" | head -c 64)")" \
    "$(fleetcuda_discover_word "$(printf '%s' "$fd_c" | head -c 32)")"
}

# fleetcuda_discover_env DIR KIND: a frame `pyenv KIND DIR PYTHON PYVER TORCH CUDA` for a Python environment
# at DIR (a venv, a conda prefix, or /usr: the system's python3); `-` where there is nothing (no torch:
# TORCH and CUDA `-`). Only paths of
# ordinary characters are said (what an inventory may hold); the others are counted. DIR is looked for under
# $fd_root (empty: the container's own /; a test's tree otherwise).
fleetcuda_discover_env() {
  fd_dir=${1#"$fd_root"}
  fd_kind=$2
  [ -d "$fd_root$fd_dir" ] || return 0
  case $fd_dir in
    *[!A-Za-z0-9._/+@-]*) fd_skipped=$((fd_skipped + 1)); return 0 ;;
  esac
  fd_real=$(cd "$fd_root$fd_dir" 2>/dev/null && pwd -P) || return 0
  case " $fd_seen " in *" $fd_real "*) return 0 ;; esac
  if [ "$fd_kind" = system ]; then
    fd_python=/usr/bin/python3
    [ -x "$fd_root$fd_python" ] || return 0
  else
    fd_python=-
    for fd_p in "$fd_dir/bin/python" "$fd_dir/bin/python3"; do
      if [ -x "$fd_root$fd_p" ]; then fd_python=$fd_p; break; fi
    done
    [ "$fd_python" = - ] && return 0
    [ -d "$fd_root$fd_dir/conda-meta" ] && fd_kind=conda
  fi
  if [ "$fd_count" -ge 64 ]; then fd_truncated=1; return 0; fi
  fd_seen="$fd_seen $fd_real"
  fd_count=$((fd_count + 1))
  fd_pyver=- fd_torch="- -"
  for fd_site in "$fd_root$fd_dir"/lib/python3*/site-packages "$fd_root$fd_dir"/local/lib/python3*/dist-packages \
      "$fd_root$fd_dir"/lib/python3/dist-packages; do
    [ -d "$fd_site" ] || continue
    fd_ver=${fd_site#"$fd_root$fd_dir"/}
    fd_ver=${fd_ver#local/}
    fd_ver=${fd_ver#lib/python}
    fd_ver=${fd_ver%%/*}
    [ "$fd_pyver" = - ] && [ "$fd_ver" != 3 ] && fd_pyver=$(fleetcuda_discover_word "$fd_ver")
    if [ -f "$fd_site/torch/version.py" ]; then
      [ "$fd_ver" != 3 ] && fd_pyver=$(fleetcuda_discover_word "$fd_ver")
      fd_torch=$(fleetcuda_discover_torch "$fd_site")
      break
    fi
  done
  # The system's python3 is in every container: said only when it holds torch.
  if [ "$fd_kind" = system ] && [ "$fd_torch" = "- -" ]; then fd_count=$((fd_count - 1)); return 0; fi
  fleetcuda_discover_frame pyenv "$fd_kind" "$fd_dir" "$fd_python" "$fd_pyver" "$fd_torch"
}

# fleetcuda_discover_envs [ROOT]: every candidate environment of the usual places (venvs, conda installs and
# their envs, the system's python3), each in a `pyenv` frame; `pyenv-done COUNT SKIPPED TRUNCATED` closes the
# report. ROOT (tests only) is a tree to look in instead of /.
fleetcuda_discover_envs() {
  fd_root=${1:-}
  fd_seen=
  fd_count=0
  fd_skipped=0
  fd_truncated=0
  for fd_d in "$fd_root"/root/venv "$fd_root"/root/.venv "$fd_root"/root/env "$fd_root"/opt/venv \
      "$fd_root"/opt/.venv "$fd_root"/opt/*/venv "$fd_root"/opt/*/.venv "$fd_root"/srv/*/venv \
      "$fd_root"/srv/*/.venv "$fd_root"/home/*/venv "$fd_root"/home/*/.venv "$fd_root"/workspace/venv \
      "$fd_root"/workspace/.venv; do
    fleetcuda_discover_env "$fd_d" venv
  done
  for fd_base in "$fd_root"/opt/conda "$fd_root"/opt/miniconda3 "$fd_root"/opt/miniforge3 "$fd_root"/opt/anaconda3 \
      "$fd_root"/root/miniconda3 "$fd_root"/root/anaconda3 "$fd_root"/root/miniforge3 "$fd_root"/root/mambaforge \
      "$fd_root"/home/*/miniconda3 "$fd_root"/home/*/anaconda3 "$fd_root"/home/*/miniforge3; do
    fleetcuda_discover_env "$fd_base" conda
    for fd_d in "$fd_base"/envs/*; do
      fleetcuda_discover_env "$fd_d" conda
    done
  done
  fleetcuda_discover_env "$fd_root"/usr system
  fleetcuda_discover_frame pyenv-done "$fd_count" "$fd_skipped" "$fd_truncated"
}
