#!/usr/bin/env bash
# Two pgmemo binaries side by side under direct writes, interleaved in one run (bench/wal.py
# runs each binary in a run of its own, and the VM's speed drifts between runs):
#
#   bench/wal_ab.sh -p PGPORT [-r ROUNDS] [-w WRITES_PER_S] OLD_BIN NEW_BIN
#
# PGPORT: a running PostgreSQL on 127.0.0.1 with wal_level = logical and `pgbench -i` data in
# database postgres, trusting user postgres. Both binaries run with --cache
# --cache-invalidation wal; each round runs readers (`pgbench -f bench/cache_hot.sql -c 16
# -T 10`) through one while a writer updates random accounts directly at WRITES_PER_S, and
# prints reader TPS and the pgmemo process's CPU per read (utime + stime from /proc).
set -eu
pgport= rounds=3 writes=1000
while getopts "p:r:w:" opt; do
  case $opt in
    p) pgport=$OPTARG ;; r) rounds=$OPTARG ;; w) writes=$OPTARG ;;
    *) sed -n 2,12p "$0"; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
if [[ -z $pgport || $# -ne 2 ]]; then sed -n 2,12p "$0"; exit 2; fi
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'kill -INT $pids 2>/dev/null || true; rm -rf "$work"' EXIT
printf '\\set aid random(1, 100000)\nUPDATE pgbench_accounts SET abalance = abalance + 1 WHERE aid = :aid;\n' >"$work/writer.sql"
pids= ports=() port=6601
for bin in "$@"; do
  "$bin" --upstream "postgresql://postgres@127.0.0.1:$pgport" --listen "127.0.0.1:$port" \
    --pool-mode transaction --pool-size 10 --auth trust --cache --cache-invalidation wal \
    >"$work/pgmemo-$port.log" 2>&1 &
  pids="$pids $!" ports+=("$port:$!:$bin")
  until pg_isready -q -h 127.0.0.1 -p "$port"; do sleep 0.2; done
  pgbench -n -f bench/cache_hot.sql -s 1 -M simple -c 2 -T 2 -h 127.0.0.1 -p "$port" -U postgres postgres >/dev/null 2>&1
  port=$((port + 1))
done
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
hz=$(getconf CLK_TCK)
for round in $(seq "$rounds"); do
  for entry in "${ports[@]}"; do
    IFS=: read -r p pid bin <<<"$entry"
    t0=$(ticks "$pid")
    pgbench -n -f "$work/writer.sql" -R "$writes" -c 2 -j 1 -T 10 -M prepared -h 127.0.0.1 \
      -p "$pgport" -U postgres postgres >/dev/null 2>&1 &
    writer=$!
    out=$(pgbench -n -f bench/cache_hot.sql -s 1 -M simple -c 16 -j 2 -T 10 -h 127.0.0.1 -p "$p" \
      -U postgres postgres 2>/dev/null)
    wait "$writer"
    t1=$(ticks "$pid")
    reads=$(awk '/number of transactions actually processed/ {split($NF, a, "/"); print a[1]}' <<<"$out")
    tps=$(awk '/^tps/ {print $3}' <<<"$out")
    echo "$bin round $round: $tps reader TPS, $(echo "($t1 - $t0) * 1000000 / $hz / $reads" | bc -l | cut -c1-5) µs pgmemo CPU/read"
  done
done
