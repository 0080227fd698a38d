#!/usr/bin/env bash
# Long GPU work on a GPU machine across several runs: each call may run 10 minutes, the machine stays
# while calls follow one another, and a detached job outlives the call that started it.
#   bash bench/gpu_detached.sh start 'COMMANDS'   # runs COMMANDS detached (setsid), then waits like `wait`
#   bash bench/gpu_detached.sh wait               # waits until the job is done or WAIT_S (560 s) passed
# Each call ends by packing the job's log and its results folder ($RES, default /var/tmp/res: point the
# commands' reports there) into $OUT/res.tar.gz, so every call brings back everything so far.
set -u
RES=${RES:-/var/tmp/res}; WAIT_S=${WAIT_S:-560}
mkdir -p "$RES"
if [ "$1" = start ]; then
    rm -f "$RES/job.done"
    RES=$RES setsid nohup bash -c "$2; echo \"job rc=\$?\" >\"$RES/job.done\"" >"$RES/job.log" 2>&1 </dev/null &
elif [ ! -e "$RES/job.log" ]; then
    # the machine that ran the job went back (idle past its limit) and this call got a fresh one: waiting here
    # would only spend device time (run 10 lost 540 s so)
    echo "no job on this machine: it is a fresh one (the job's machine went back); call start again"; exit 3
fi
t=$SECONDS
while [ ! -e "$RES/job.done" ] && [ $((SECONDS - t)) -lt "$WAIT_S" ]; do sleep 10; done
[ -e "$RES/job.done" ] && cat "$RES/job.done" || echo "job still running after $((SECONDS - t)) s"
tail -25 "$RES/job.log"
if [ -n "${OUT:-}" ]; then tar -czf "$OUT/res.tar.gz" -C "$(dirname "$RES")" "$(basename "$RES")"; fi
