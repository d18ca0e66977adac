#!/bin/bash
# bench/scale_job.sh BIN W S: one job of W gradlink-bench workers (4K..64K, every element checked
# by every worker) and S gradlink-server processes on this host, all real processes; prints the
# wall time from the servers' start to the last worker's exit and how many workers failed.
BIN=$1; W=$2; S=$3; d=$(mktemp -d)
$BIN/gradlink-scheduler --port 0 -w $W -s $S --job sc --join-timeout-ms 120000 > $d/sched.out 2>$d/sched.err &
sp=$!
for t in $(seq 100); do grep -q "listening on" $d/sched.out && break; sleep 0.05; done
addr=$(grep -o "listening on [^ ]*" $d/sched.out | awk '{print $3}')
t0=$(date +%s.%N)
for i in $(seq $S); do $BIN/gradlink-server --scheduler $addr --job sc > $d/s$i.log 2>&1 & done
pids=()
for i in $(seq $W); do $BIN/gradlink-bench --scheduler $addr --job sc -b 4K -e 64K -n 2 --warmup 1 > $d/w$i.out 2> $d/w$i.err & pids+=($!); done
fail=0; for p in ${pids[@]}; do wait $p || fail=$((fail+1)); done
t1=$(date +%s.%N)
wait $sp; src=$?
echo "W=$W S=$S: workers failed $fail, scheduler rc $src, $(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.2f", b - a }') s"
grep -h -m2 "failed\|hung" $d/sched.err | cut -c1-200
rm -rf $d
[ $fail -eq 0 ] && [ $src -eq 0 ]
