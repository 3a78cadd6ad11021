# The rehearsals' PASS/FAIL bookkeeping (scripts/rehearse.sh, scripts/rehearse-k8s.sh). Sourced, never run; the
# caller sets `layout` (the label of each line) and reads `results` and `failures` at the end.
results=()
failures=0

checks() {  # checks COMMAND...: run it, keep and print the PASS/FAIL lines it prints (the rest goes to stderr)
    local line
    while IFS= read -r line; do
        if [[ "$line" != PASS* && "$line" != FAIL* ]]; then printf '%s\n' "$line" >&2; continue; fi
        results+=("[$layout] $line")
        [[ "$line" == FAIL* ]] && failures=$((failures + 1))
        printf '%s\n' "[$layout] $line"
    done < <("$@" 2>&1 || true)
}
verdict() {  # verdict WHAT COMMAND...: PASS when the command succeeds
    local what="$1"; shift
    if "$@" >/dev/null 2>&1; then echo "PASS $what"; else echo "FAIL $what"; fi
}
