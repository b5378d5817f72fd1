# Run inside a target after Ctrl-C, as `stop.sh RUN LABEL`: TERM (then KILL) every process of this run,
# found by its label (the last argument: `fleetcuda:<step>@<run>` or `fleetcuda-<what>@<run>`), or by the
# FLEETCUDA_LABEL every command has in its environment (command.target_argv), which a step's children keep however
# they rename or detach themselves (`exec -a`, setsid, nohup); the stop script itself excepted. `timeout` passes the signal on to the step's whole process group. Other runs'
# processes have other run ids.
run=$1
label=$2
stop() {
  n=0
  for d in /proc/[0-9]*; do
    pid=${d#/proc/}
    [ "$pid" = "$$" ] && continue
    last=$(tr '\0' '\n' < "$d/cmdline" 2>/dev/null | tail -n 1) || continue
    case $last in fleetcuda:*"@$run"|fleetcuda-*"@$run") ;; *)
      last=$(tr '\0' '\n' < "$d/environ" 2>/dev/null | sed -n 's/^FLEETCUDA_LABEL=//p' | tail -n 1) ;;
    esac
    case $last in
      "fleetcuda-stop@$run") ;;
      fleetcuda:*"@$run"|fleetcuda-*"@$run") kill "-$1" "$pid" 2>/dev/null && n=$((n + 1)) ;;
    esac
  done
  echo "$n"
}
first=$(stop TERM)
for _ in 1 2 3 4 5 6 7 8 9 10; do [ "$(stop 0)" = 0 ] && break; sleep 1; done
left=$(stop KILL)
echo "stopped $first process(es) labelled $label (or of run $run); $left needed KILL"
