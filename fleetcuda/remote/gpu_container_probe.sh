# What the container sees of the NVIDIA driver, read-only: run inside the container (or on a machine without
# containers) by gpu_passthrough.py, through the same `[sudo -n] pct exec VMID -- env -i ... bash -c` as any step.
# One line per finding, which gpu_passthrough.py parses (the last field of a node line is the text of the open error):
#   lib <name> ldconfig <path> <the file it resolves to> <flags>   (flags as ldconfig -p gives them, e.g. libc6,x86-64)
#   lib <name> file <path> <the file it resolves to> -
# ldconfig lines keep the order `ldconfig -p` gives: the loader takes the first entry of a soname for its arch.
# A path that resolves to no file (a dangling link, a stale cache entry) says `dangling` or `absent` instead.
#   node <path> absent | node <path> other <type> | node <path> char <major>:<minor> ok|<strerror text>
# Nothing here is created: a node is opened only when it exists and is a character device (bash <> would
# create a missing file). This file holds no single quote, so the dry run finds it inside a JSON argument.
export LC_ALL=C
resolved() {
  if [ -e "$1" ]; then
    readlink -f -- "$1" 2>/dev/null || echo "$1"
  elif [ -L "$1" ]; then
    echo dangling
  else
    echo absent
  fi
}
for name in libcuda.so libnvidia-ml.so; do
  ldconfig -p 2>/dev/null | sed -n "s|^[[:space:]]*${name}[.0-9]* (\([^)]*\)) => \(/.*\)\$|\1\|\2|p" |
    while IFS="|" read -r flags path; do
      echo "lib ${name} ldconfig ${path} $(resolved "${path}") ${flags// /}"
    done
  for dir in /usr/lib/x86_64-linux-gnu /usr/lib/aarch64-linux-gnu /usr/lib64 /usr/lib /lib64 /usr/local/nvidia/lib64; do
    for path in "${dir}/${name}".*; do
      [ -e "${path}" ] || [ -L "${path}" ] || continue
      echo "lib ${name} file ${path} $(resolved "${path}") -"
    done
  done
done
nodes="/dev/nvidiactl /dev/nvidia-uvm"
for path in /dev/nvidia[0-9]*; do
  case "${path##*/nvidia}" in *[!0-9]*) continue ;; esac
  nodes="${nodes} ${path}"
done
case "${nodes}" in *nvidia[0-9]*) ;; *) nodes="${nodes} /dev/nvidia0" ;; esac
for path in ${nodes}; do
  if [ ! -e "${path}" ] && [ ! -L "${path}" ]; then
    echo "node ${path} absent"
  elif [ ! -c "${path}" ]; then
    echo "node ${path} other $(stat -L -c %F -- "${path}" 2>/dev/null | tr " " "-")"
  else
    mm=$(stat -L -c "%t:%T" -- "${path}")
    major=$((16#${mm%%:*}))
    minor=$((16#${mm##*:}))
    if err=$( { exec 3<>"${path}"; } 2>&1 ); then
      echo "node ${path} char ${major}:${minor} ok"
    else
      echo "node ${path} char ${major}:${minor} ${err##*: }"
    fi
  fi
done
