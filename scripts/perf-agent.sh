#!/bin/bash
# Where the agent's kernel time goes in one `ferry-bench` run (issue 15).
#
#   scripts/perf-agent.sh AGENT OUT [ferry-bench flags...]
#
# Attaches Linux `perf` (Debian's linux-perf) to the agent that ferry-bench starts, for the
# whole run, warm-up included:
#   - `perf stat` with system-call tracepoints: how many of each call (OUT.syscalls);
#   - `perf record -e cpu-clock -g` (a software clock: this VM has no hardware counters):
#     the share of the agent's CPU samples per thread and per system call, `user` for the
#     samples outside the kernel (OUT.shares, from OUT.data).
# Both at once, so the counts and the shares are of the same run. perf slows the agent a
# little; compare the shares, and take CPU per message from a run without it.
# FERRY_BENCH names the ferry-bench binary (default target/release/ferry-bench); SCENARIO the
# ferry-bench scenario (default fan-out; `latency` for 1 000 msg/s, `direct` for direct_hold).
set -euo pipefail
agent=$(realpath "${1:?usage: perf-agent.sh AGENT OUT [ferry-bench flags]}")
out=${2:?usage: perf-agent.sh AGENT OUT [ferry-bench flags]}
shift 2
bench=${FERRY_BENCH:-target/release/ferry-bench}
calls=fsync,fdatasync,pwrite64,pread64,fcntl,futex,epoll_wait,recvfrom,sendto,write,writev,read,setsockopt
events=$(echo "$calls" | sed 's/\([a-z0-9_]*\)/syscalls:sys_enter_\1/g')

"$bench" --scenario "${SCENARIO:-fan-out}" --agent "$agent" "$@" >"$out.bench" 2>&1 &
bench_pid=$!
trap 'kill "$bench_pid" 2>/dev/null || true' EXIT
# The agent is ferry-bench's child running `AGENT run --config …` (not its `AGENT run --help`
# check); the Mosquitto bridge runs first, so wait as long as the bench runs.
pid=
while kill -0 "$bench_pid" 2>/dev/null; do
    pid=$(pgrep -P "$bench_pid" -f "^$agent run --config" | head -1 || true)
    [ -n "$pid" ] && break
    sleep 0.01
done
if [ -z "$pid" ]; then
    echo "perf-agent: the agent never started; see $out.bench" >&2
    exit 1
fi
# Both end when the agent exits.
perf stat -o "$out.syscalls" -e "$events" -p "$pid" 2>"$out.stat.log" &
perf record -q -o "$out.data" -F 2000 -e cpu-clock -g -p "$pid" 2>"$out.record.log" &
wait "$bench_pid" || true
wait || true
trap - EXIT

grep -E "agent CPU|throughput \(worst" "$out.bench" || true
for f in "$out.syscalls" "$out.data"; do
    if [ ! -s "$f" ]; then
        echo "perf-agent: perf wrote no $f; see $out.stat.log and $out.record.log" >&2
        exit 1
    fi
done
grep -E "syscalls:" "$out.syscalls" | awk '{printf "%10s %s\n", $1, $2}' || true
perf script -i "$out.data" -F comm,ip,sym 2>/dev/null | python3 -c '
import re, sys, collections
by, threads, total = collections.defaultdict(collections.Counter), collections.Counter(), 0
for sample in sys.stdin.read().split("\n\n"):
    lines = [l.strip() for l in sample.strip().split("\n") if l.strip()]
    if len(lines) < 2:
        continue
    comm = lines[0].split()[0]
    frames = [l.split(None, 1) for l in lines[1:]]
    total += 1
    threads[comm] += 1
    # Kernel addresses start with ffff: a sample whose first frame is not one is user time.
    if not frames[0][0].startswith("ffff"):
        kind = "user"
    else:
        kind = "kernel, outside a system call (interrupts, preemption, page faults)"
        for frame in frames:
            call = re.search(r"__x64_sys_(\w+)", frame[-1])
            if call:
                kind = call.group(1)
                break
    by[comm][kind] += 1
for comm, n in threads.most_common():
    print(f"{comm:18} {100 * n / total:5.1f} % of the samples")
    for kind, k in by[comm].most_common(8):
        print(f"    {100 * k / total:5.1f} %  {kind}")
' | tee "$out.shares"
