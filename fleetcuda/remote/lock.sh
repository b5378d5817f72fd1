# One `fleetcuda apply` at a time per target (see fleetcuda/run/locks.py): a lock directory, made with
# mkdir (atomic), holding its owner's name. Functions, inlined in the script that takes the lock; each says
# what it did in a `lock` frame (the run's nonce is in $fcn, read from stdin).
#
# The lock stands for the work on this target, not for the process that took it: while a process of the
# owner's run still runs here (a step's bash, whose $0 is `fleetcuda:<step>@<run id>`, and every process it
# started, which carry it as FLEETCUDA_LABEL, the run id being the owner's last word, after ` run `), the lock
# is neither removed as stale, nor taken over, nor released.

# fleetcuda_lock_work LOCKDIR: whether processes of the lock's run still run here (status 0), said in a
# `lock working N LABEL` frame (how many, and the first one's label).
fleetcuda_lock_work() {
  local owner run d a last tgt vmid n=0 first=
  # The container the lock is for: its processes carry FLEETCUDA_TARGET (command.target_argv), which matters
  # where containers share one /proc.
  vmid=${1##*fleetcuda-apply-}; vmid=${vmid%.lock}
  owner=$(head -n 1 "$1/owner" 2>/dev/null)
  case $owner in *" run "*) run=${owner##* run } ;; *) return 1 ;; esac
  # A run id as command.internal_label makes it (hex); anything else names no run's processes.
  case $run in "" | *[!A-Za-z0-9._-]*) return 1 ;; esac
  for d in /proc/[0-9]*; do
    # A step's processes, its children included however they renamed or detached themselves, carry its label in
    # their environment (command.target_argv), read by builtins: no process per process. (Not the last argument:
    # where containers share one /proc, a `pct exec`/sudo that started another container's step ends with it.)
    # (Every entry ends in a NUL. No `|| [ -n "$a" ]`: a process that ends while it is read fails each read
    # with ESRCH, which left that loop spinning for ever.)
    last= tgt=
    while IFS= read -r -d '' a; do
      case $a in FLEETCUDA_LABEL=*) last=${a#FLEETCUDA_LABEL=} ;; FLEETCUDA_TARGET=*) tgt=${a#FLEETCUDA_TARGET=} ;; esac
    done 2>/dev/null < "$d/environ"
    [ -z "$tgt" ] || [ "$tgt" = "$vmid" ] || continue
    case $last in
      "fleetcuda:"*"@$run") n=$((n + 1)); [ -n "$first" ] || first=$last ;;
    esac
  done
  [ "$n" -gt 0 ] || return 1
  first=$(printf '%s' "$first" | head -c 200 | tr -c "[:alnum:]@:._-" "?")
  printf '\n%s\n' "@@fleetcuda:${fcn} lock working $n $first"
}

# fleetcuda_lock_acquire NAME OWNER WAIT_S STALE_S: take the lock, waiting up to WAIT_S seconds; a lock
# not refreshed for STALE_S seconds is removed (its run is gone), unless processes of its run still run
# here. Exits 75 when it stays busy.
fleetcuda_lock_acquire() {
  local name=$1 owner=$2 wait_s=$3 stale_s=$4 lockdir holder age deadline working
  # A tmpfs (/run/lock, else /run) where there is one: a restart clears what a dead run left.
  lockdir=/run/lock/$name
  { [ -d /run/lock ] && [ -w /run/lock ]; } || lockdir=/run/$name
  { [ -d /run ] && [ -w /run ]; } || lockdir="$HOME/.cache/$name.lock"
  mkdir -p "$(dirname "$lockdir")"
  deadline=$(( $(date +%s) + wait_s ))
  while ! mkdir "$lockdir" 2>/dev/null; do
    # Said in a frame: one line of plain characters, whatever the file holds.
    holder=$(head -n 1 "$lockdir/owner" 2>/dev/null | head -c 300 | tr -d "\n" | tr -c "[:alnum:]@:._ -" "?")
    # Ours already (a reply lost with a dropped connection, then the command sent again).
    [ "$(cat "$lockdir/owner" 2>/dev/null)" = "$owner" ] && break
    age=$(( $(date +%s) - $(stat -c %Y "$lockdir" 2>/dev/null || date +%s) ))
    working=0
    if [ "$age" -gt "$stale_s" ]; then
      if fleetcuda_lock_work "$lockdir" >/dev/null; then
        working=1  # its run's control process is gone, its work is not: still busy
      else
        printf '\n%s\n' "@@fleetcuda:${fcn} lock stale $holder"; rm -rf "$lockdir"; continue
      fi
    fi
    if [ "$(date +%s)" -ge "$deadline" ]; then
      [ "$working" = 0 ] || fleetcuda_lock_work "$lockdir"
      printf '\n%s\n' "@@fleetcuda:${fcn} lock busy $lockdir $holder"; exit 75
    fi
    sleep 2
  done
  printf "%s\n" "$owner" > "$lockdir/owner"
  printf '\n%s\n' "@@fleetcuda:${fcn} lock held"
}

# fleetcuda_lock_if_owned NAME OWNER ACTION WORD: where OWNER holds the lock NAME, remove or touch it
# (ACTION), then say WORD. A lock is removed only once no process of its run runs here: else it is kept
# (said in a `working` frame, then `kept`).
fleetcuda_lock_if_owned() {
  local name=$1 owner=$2 action=$3 word=$4 lockdir
  for lockdir in "/run/lock/$name" "/run/$name" "$HOME/.cache/$name.lock"; do
    if [ "$(cat "$lockdir/owner" 2>/dev/null)" = "$owner" ]; then
      case $action in
        remove)
          if fleetcuda_lock_work "$lockdir"; then
            printf '\n%s\n' "@@fleetcuda:${fcn} lock kept"; continue
          fi
          rm -rf "$lockdir" ;;
        touch) touch "$lockdir" ;;
      esac
      printf '\n%s\n' "@@fleetcuda:${fcn} lock $word"
    fi
  done
}

fleetcuda_lock_release() { fleetcuda_lock_if_owned "$1" "$2" remove released; }
# Touched, so that no other run takes it over as stale.
fleetcuda_lock_refresh() { fleetcuda_lock_if_owned "$1" "$2" touch refreshed; }
# OWNER's control process is known to be dead (a run of this machine's pid namespace that no longer exists).
fleetcuda_lock_take_over() { fleetcuda_lock_if_owned "$1" "$2" remove taken-over; }
