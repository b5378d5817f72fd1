# One `fleetcuda apply` at a time per target (see fleetcuda/run/locks.py): a lock directory, made with
# mkdir (atomic), holding its owner's name. Functions, inlined in the script that takes the lock; each says
# what it did in a `lock` frame (the run's nonce is in $fcn, read from stdin).

# fleetcuda_lock_acquire NAME OWNER WAIT_S STALE_S: take the lock, waiting up to WAIT_S seconds; a lock
# not refreshed for STALE_S seconds is removed (its run is gone). Exits 75 when it stays busy.
fleetcuda_lock_acquire() {
  local name=$1 owner=$2 wait_s=$3 stale_s=$4 lockdir holder age deadline
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
    if [ "$age" -gt "$stale_s" ]; then
      printf '\n%s\n' "@@fleetcuda:${fcn} lock stale $holder"; rm -rf "$lockdir"; continue
    fi
    if [ "$(date +%s)" -ge "$deadline" ]; then
      printf '\n%s\n' "@@fleetcuda:${fcn} lock busy $lockdir $holder"; exit 75
    fi
    sleep 2
  done
  printf "%s\n" "$owner" > "$lockdir/owner"
  printf '\n%s\n' "@@fleetcuda:${fcn} lock held"
}

# fleetcuda_lock_if_owned NAME OWNER ACTION WORD: where OWNER holds the lock NAME, remove or touch it
# (ACTION), then say WORD.
fleetcuda_lock_if_owned() {
  local name=$1 owner=$2 action=$3 word=$4 lockdir
  for lockdir in "/run/lock/$name" "/run/$name" "$HOME/.cache/$name.lock"; do
    if [ "$(cat "$lockdir/owner" 2>/dev/null)" = "$owner" ]; then
      case $action in
        remove) rm -rf "$lockdir" ;;
        touch) touch "$lockdir" ;;
      esac
      printf '\n%s\n' "@@fleetcuda:${fcn} lock $word"
    fi
  done
}

fleetcuda_lock_release() { fleetcuda_lock_if_owned "$1" "$2" remove released; }
# Touched, so that no other run takes it over as stale.
fleetcuda_lock_refresh() { fleetcuda_lock_if_owned "$1" "$2" touch refreshed; }
# OWNER is known to be dead (a run of this machine that no longer exists).
fleetcuda_lock_take_over() { fleetcuda_lock_if_owned "$1" "$2" remove taken-over; }
