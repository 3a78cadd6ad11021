# The rehearsals' PASS/FAIL bookkeeping (scripts/rehearse.sh, scripts/rehearse-k8s.sh). Sourced, never run; the
# caller sets `layout` (the label of each line) and reads `results` and `failures` at the end.
results=()
failures=0

checks() {  # checks COMMAND...: run it, keep and print the PASS/FAIL lines it prints (the rest goes to stderr);
    # a command that fails without saying FAIL, or says neither (a kubectl exec whose stream broke), is a FAIL too
    local line said=0 failed=0 rc=0
    while IFS= read -r line; do
        if [[ "$line" == __rc=* ]]; then rc="${line#__rc=}"; continue; fi
        if [[ "$line" != PASS* && "$line" != FAIL* ]]; then printf '%s\n' "$line" >&2; continue; fi
        said=1
        [[ "$line" == FAIL* ]] && failed=1
        record "$line"
    done < <("$@" 2>&1; echo "__rc=$?")
    if [[ $said == 0 || ( $rc != 0 && $failed == 0 ) ]]; then
        record "FAIL $* (exit $rc, $([[ $said == 0 ]] && echo "no verdict printed" || echo "no FAIL printed"))"
    fi
}
record() {
    results+=("[$layout] $1")
    [[ "$1" == FAIL* ]] && failures=$((failures + 1))
    printf '%s\n' "[$layout] $1"
}
verdict() {  # verdict WHAT COMMAND...: PASS when the command succeeds
    local what="$1"; shift
    if "$@" >/dev/null 2>&1; then echo "PASS $what"; else echo "FAIL $what"; fi
}
