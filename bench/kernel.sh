#!/usr/bin/env bash
# Where a proxy's CPU per transaction goes, user space against the kernel, for PgBouncer and
# pgmemo binaries side by side (taking turns, each round in the same order):
#   - user and system CPU time per transaction (utime and stime of all its threads);
#   - system calls per transaction (all, and epoll_wait), counted by perf;
#   - TCP segments sent per transaction by the whole machine (nstat's TcpOutSegs: four when
#     every acknowledgement rides on data);
#   - context switches per transaction, voluntary (it waited) and involuntary (preempted).
#
#   bench/kernel.sh -p PGPORT [-m simple|extended|prepared] [-c CLIENTS] [-T SECONDS]
#                   [-r ROUNDS] [-b PGBOUNCER] BIN...
#
# PGPORT is a running PostgreSQL on 127.0.0.1 with `pgbench -i` data in database postgres,
# trusting user postgres (as for bench/profile.sh). PGBOUNCER defaults to the peers' build
# (/opt/peers/pgbouncer/bin/pgbouncer, /work/shared/peers/build.sh; `-b ''` leaves it out); it
# runs as user postgres (it will not run as root). Needs perf and nstat (linux-perf, iproute2).
# Times move with the machine's load (run it on a quiet machine, several rounds); the counts
# do not.
set -eu

mode=simple clients=8 seconds=5 rounds=2 pgport= pgbouncer=/opt/peers/pgbouncer/bin/pgbouncer
while getopts "p:m:c:T:r:b:" opt; do
  case $opt in
    p) pgport=$OPTARG ;;
    m) mode=$OPTARG ;;
    c) clients=$OPTARG ;;
    T) seconds=$OPTARG ;;
    r) rounds=$OPTARG ;;
    b) pgbouncer=$OPTARG ;;
    *) sed -n 2,19p "$0"; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
if [[ -z $pgport || ($# -eq 0 && -z $pgbouncer) ]]; then sed -n 2,19p "$0"; exit 2; fi

work=$(mktemp -d)
chmod 755 "$work"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -INT "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
ready() { # ready PORT PID LOG
  until pg_isready -q -h 127.0.0.1 -p "$1"; do
    if ! kill -0 "$2" 2>/dev/null; then cat "$3" >&2; exit 1; fi
    sleep 0.2
  done
}

names=() ports=() procs=()
if [[ -n $pgbouncer ]]; then
  port=$(free_port)
  cat >"$work/pgbouncer.ini" <<EOF
[databases]
* = host=127.0.0.1 port=$pgport
[pgbouncer]
listen_addr = 127.0.0.1
listen_port = $port
unix_socket_dir =
auth_type = trust
auth_file = $work/userlist.txt
pool_mode = transaction
default_pool_size = 10
max_client_conn = 1000
max_prepared_statements = 200
ignore_startup_parameters = extra_float_digits
logfile =
pidfile =
EOF
  echo '"postgres" ""' >"$work/userlist.txt"
  chmod 644 "$work"/*
  # exec: the pid is PgBouncer's own, not a wrapper's.
  setpriv --reuid=postgres --regid=postgres --init-groups -- "$pgbouncer" "$work/pgbouncer.ini" \
    >"$work/pgbouncer.log" 2>&1 &
  pids+=($!)
  ready "$port" "$!" "$work/pgbouncer.log"
  names+=(pgbouncer) ports+=("$port") procs+=("$!")
fi
for bin in "$@"; do
  port=$(free_port)
  log="$work/pgmemo-${#names[@]}.log"
  "$bin" --upstream "postgresql://postgres@127.0.0.1:$pgport" --listen "127.0.0.1:$port" \
    --pool-size 10 --auth trust >"$log" 2>&1 &
  pids+=($!)
  ready "$port" "$!" "$log"
  names+=("$bin") ports+=("$port") procs+=("$!")
done

switches() { # voluntary and involuntary context switches of all the process's threads
  cat /proc/"$1"/task/*/status | awk '/^voluntary_ctxt/ {v += $2} /^nonvoluntary_ctxt/ {n += $2} END {print v, n}'
}
run_pgbench() { # PORT SECONDS
  pgbench -S -n -M "$mode" -c "$clients" -j 2 -T "$2" -h 127.0.0.1 -p "$1" -U postgres postgres
}
measure() { # NAME PORT PID
  run_pgbench "$2" 1 >/dev/null 2>&1 # warm: statements prepared, servers connected
  local u0 s0 u1 s1 v0 n0 v1 n1
  read -r u0 s0 < <(awk '{print $14, $15}' /proc/"$3"/stat)
  read -r v0 n0 < <(switches "$3")
  nstat -n >/dev/null
  perf stat -x, -e raw_syscalls:sys_enter -e syscalls:sys_enter_epoll_wait -p "$3" \
    -o "$work/perf" -- sleep $((seconds + 1)) &
  local perf_pid=$!
  local out
  out=$(run_pgbench "$2" "$seconds" 2>&1)
  wait "$perf_pid"
  read -r u1 s1 < <(awk '{print $14, $15}' /proc/"$3"/stat)
  read -r v1 n1 < <(switches "$3")
  local segs
  segs=$(nstat -z TcpOutSegs | awk '/TcpOutSegs/ {print $2}')
  python3 - "$1" "$out" "$u0" "$s0" "$u1" "$s1" "$v0" "$n0" "$v1" "$n1" "$segs" "$work/perf" \
    "$(getconf CLK_TCK)" <<'PY'
import re, sys
name, out = sys.argv[1], sys.argv[2]
u0, s0, u1, s1, v0, n0, v1, n1, segs = map(int, sys.argv[3:12])
perf, clk = sys.argv[12], int(sys.argv[13])
tx = int(re.search(r"^number of transactions actually processed: (\d+)", out, re.M).group(1))
tps = float(re.search(r"^tps = ([\d.]+)", out, re.M).group(1))
calls = {}
for line in open(perf):
    f = line.strip().split(",")
    if len(f) > 2 and f[0].isdigit():
        calls[f[2].split(":")[-1].replace("sys_enter_", "").replace("sys_enter", "all")] = int(f[0])
user, sys_ = (u1 - u0) / clk * 1e6 / tx, (s1 - s0) / clk * 1e6 / tx
print(f"| {name} | {tps:,.0f} | {user:.1f} | {sys_:.1f} | {user + sys_:.1f} | "
      f"{calls.get('all', 0) / tx:.2f} | {calls.get('epoll_wait', 0) / tx:.2f} | {segs / tx:.2f} | "
      f"{(v1 - v0) / tx:.3f} | {(n1 - n0) / tx:.3f} |")
PY
}

echo "pgbench -S -M $mode -c $clients, $seconds s a run, $rounds round(s); per transaction:"
echo
echo "| proxy | TPS | user µs | system µs | CPU µs | system calls | epoll_wait | TCP segments | waits | preempted |"
echo "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
for ((r = 0; r < rounds; r++)); do
  for i in "${!names[@]}"; do measure "${names[$i]}" "${ports[$i]}" "${procs[$i]}"; done
done
