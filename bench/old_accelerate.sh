#!/usr/bin/env bash
# accelerate releases whose DeepSpeed path needs CUDA (< 0.29), on a GPU machine with DeepSpeed installed:
# for each accelerate-*.whl in $1, the two-model example without the fix (the error of that release), with
# the fix, and through the hand-written merged module; the losses of the last two must be equal.
#   bash bench/old_accelerate.sh DIR_OF_ACCELERATE_WHEELS
set -u
cd "$(dirname "$0")/.."
status=0
for wheel in "$1"/accelerate-*.whl; do
    version=$(basename "$wheel" | cut -d- -f2)
    target=/tmp/accelerate-$version
    python3 -m pip install -q --no-deps --no-index --target "$target" "$wheel" || exit 1
    run() { PYTHONPATH="$target:${PYTHONPATH:-}" python3 examples/train_two_models.py --zero-stage 2 "$@"; }
    run >"/tmp/nofix-$version.log" 2>&1 && ran=yes || ran=no
    without=$(grep -E "^(\[rank0\]: )?[A-Za-z]*Error" "/tmp/nofix-$version.log" | tail -1 | sed 's/^\[rank0\]: //' | head -c 160)
    [ "$ran" = yes ] && without="it ran"
    [ -n "${LOGDIR:-}" ] && cp "/tmp/nofix-$version.log" "$LOGDIR/nofix-$version.log"
    run --import-fix --out "/tmp/fix-$version.json" >"/tmp/fix-$version.log" 2>&1
    run --reference --out "/tmp/ref-$version.json" >"/tmp/ref-$version.log" 2>&1
    verdict=$(python3 - "$version" <<'PY'
import json, sys
v = sys.argv[1]
try:
    fix, ref = (json.load(open(f"/tmp/{k}-{v}.json")) for k in ("fix", "ref"))
except OSError as exc:
    print(f"FAILED ({exc.filename} missing)"); sys.exit()
ok = fix["losses"] == ref["losses"] and fix["fix_active"]
print(("equal" if ok else "DIFFERENT") + f" losses over {len(fix['losses'])} steps, last {fix['losses'][-1]:.6f}")
PY
)
    echo "accelerate $version | without fix: ${without:-no error} | with fix vs hand-written: $verdict"
    case "$verdict" in equal*) ;; *) status=1; tail -20 "/tmp/fix-$version.log" ;; esac
done
exit $status
