#!/usr/bin/env bash
# Per-transaction cost of pgmemo binaries, in figures that do not move with the machine's
# load (the TPS and CPU-time runs of bench/run.py do, by ±15% on a shared VM):
#   - user-space instructions per transaction, counted by valgrind's callgrind;
#   - system calls per transaction (sendto, recvfrom, read, epoll_wait), counted by perf.
# Use it to compare a change against the binary before it:
#
#   bench/profile.sh -p PGPORT [-m simple|extended|prepared] [-c CLIENTS] [-t TX]
#                    [-f SCRIPT -s SCALE] [-d DATABASE] [-u USER] [-x PGMEMO_ARG]... [-r SEED]
#                    [-F] [-n] BIN...
#
# PGPORT is a running PostgreSQL on 127.0.0.1 with `pgbench -i` data in DATABASE (default
# postgres), trusting USER (default postgres; the demo mode's private server works: `pgmemo` prints
# nothing about its port, find it with `ss -ltnp | grep postgres`). `-f` runs a pgbench script
# instead of `-S` (e.g. bench/orm.sql, or bench/cache_hot.sql with `-x --cache`), with `-s` the
# scale of the data. Needs valgrind and perf (apt-get install valgrind linux-perf).
# -r SEED fixes pgbench's random numbers (the keys drawn), for runs that must count the same.
# -F prints where each binary's instructions went by feature (bench/split.py: framing, reply
# queue, registry, autoprepare, pool, I/O, the runtime...), -n skips the system-call count
# (no perf needed: scripts/instruction-budget). PROFILE_KEEP=DIR keeps each binary's callgrind
# profile there (BIN-MODE[-SCRIPT].callgrind), to see per function where instructions went:
# callgrind_annotate DIR/pgmemo-MODE.callgrind; with PROFILE_INSTR=1 as well, per instruction,
# for bench/lines.py (per source line, inlined code included).
set -eu

mode=prepared clients=8 tx=500 pgport= database=postgres user=postgres script= scale=1 split= perf=1
seed=()
extra=()
while getopts "p:m:c:t:f:s:d:u:x:r:Fn" opt; do
  case $opt in
    p) pgport=$OPTARG ;;
    m) mode=$OPTARG ;;
    c) clients=$OPTARG ;;
    t) tx=$OPTARG ;;
    f) script=$OPTARG ;;
    s) scale=$OPTARG ;;
    d) database=$OPTARG ;;
    u) user=$OPTARG ;;
    r) seed=(--random-seed "$OPTARG") ;;
    x) extra+=("$OPTARG") ;;
    F) split=1 ;;
    n) perf= ;;
    *) sed -n 2,23p "$0"; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
if [[ -z $pgport || $# -eq 0 ]]; then sed -n 2,23p "$0"; exit 2; fi
if [[ -n $script ]]; then workload=(-f "$script" -s "$scale"); else workload=(-S); fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
port=${PROFILE_PORT:-6499} # pgmemo's listening port
total=$((clients * tx))
run_pgbench() {
  pgbench "${workload[@]}" "${seed[@]}" -n -M "$mode" -c "$clients" -t "$1" -h 127.0.0.1 -p "$port" -U "$user" \
    "$database" >/dev/null
}
start() { # start BIN [wrapper...]: pgmemo on $port, in front of $pgport
  local bin=$1; shift
  "$@" "$bin" --upstream "postgresql://$user@127.0.0.1:$pgport" --listen "127.0.0.1:$port" \
    --pool-size 10 --auth trust "${extra[@]}" >"$work/pgmemo.log" 2>&1 &
  pid=$!
  until pg_isready -q -h 127.0.0.1 -p "$port"; do
    if ! kill -0 "$pid" 2>/dev/null; then cat "$work/pgmemo.log" >&2; exit 1; fi
    sleep 0.2
  done
  # Warm twice: statements prepared, buffers grown, and pgbench's own one-off query (the
  # scale lookup) past autoprepare's threshold, so its one-time parse is not counted; at least
  # 1,000 transactions each time (bench/cache_hit.sql's 100 keys all cached).
  local warm=$(((1000 + clients - 1) / clients))
  ((warm < 100)) && warm=100
  run_pgbench "$warm"
  run_pgbench "$warm"
}
stop() { kill -INT "$pid"; wait "$pid" 2>/dev/null || true; }

# PROFILE_INSTR=1: the profile kept per instruction, for bench/lines.py (by source line,
# inlined code included).
per_instr=()
if [[ -n ${PROFILE_INSTR:-} ]]; then per_instr=(--dump-instr=yes --compress-pos=no); fi

for bin in "$@"; do
  start "$bin" valgrind --tool=callgrind --instr-atstart=no "${per_instr[@]}" --callgrind-out-file="$work/cg.out"
  callgrind_control -i on "$pid" >/dev/null 2>&1
  run_pgbench "$tx"
  callgrind_control -i off "$pid" >/dev/null 2>&1
  stop
  instructions=$(callgrind_annotate "$work"/cg.out* 2>/dev/null | awk '/PROGRAM TOTALS/ {gsub(",", "", $1); print $1; exit}')
  name=$(basename "$bin")-$mode${script:+-$(basename "$script" .sql)}
  if [[ -n $split ]]; then
    cat "$work"/cg.out* >"$work/$name.callgrind"
    python3 "$(dirname "$0")/split.py" --tx "$total" --names "$name" "$work/$name.callgrind"
  fi
  if [[ -n ${PROFILE_KEEP:-} ]]; then # keep the profile, for callgrind_annotate per function
    mkdir -p "$PROFILE_KEEP"
    cat "$work"/cg.out* >"$PROFILE_KEEP/$name.callgrind"
  fi
  rm -f "$work"/cg.out*
  if [[ -z $perf ]]; then
    printf '%s  -M %s -c %s: %d user-space instructions/tx\n' "$bin" "$mode" "$clients" $((instructions / total))
    continue
  fi

  start "$bin"
  perf stat -x, -o "$work/stat.txt" -p "$pid" \
    -e syscalls:sys_enter_sendto,syscalls:sys_enter_recvfrom,syscalls:sys_enter_read,syscalls:sys_enter_epoll_wait &
  perf_pid=$!
  sleep 0.3
  run_pgbench "$tx"
  kill -INT "$perf_pid"; wait "$perf_pid" || true
  stop
  syscalls=$(awk -F, -v n="$total" '/sys_enter/ {sub("syscalls:sys_enter_", "", $3); printf "%s %.2f  ", $3, $1 / n}' "$work/stat.txt")
  printf '%s  -M %s -c %s: %d user-space instructions/tx; syscalls/tx: %s\n' \
    "$bin" "$mode" "$clients" $((instructions / total)) "$syscalls"
done
