#!/usr/bin/env bash
# The re-runs behind the verdicts (docs/share.md and docs/lm.md, "Verdicts, before ->
# after"), two at a time, one thread each, every step resumable: run this script again
# after an interruption and each step continues where it stopped (finished arms and runs
# are kept; a step already done returns at once). A step whose output folder another
# process is writing is waited for, not started twice.
#
#   benchmarks/verdict_reruns.sh            # from the repository root, after `make setup`
#
# Lane 1: the share rate probe (part a), test 3 on SmolLM2 over three calibration draws,
#         the -20% arms (both draws), test 6 (configs/share/experiment-test6.yaml), test 3
#         on Qwen2.5-Coder-0.5B over three draws.
# Lane 2: the share rate probe (part b), then the -30% / -40% arms, then the CPU study.
# The whole-model runs start only when both probe parts are done (they read its choice).
set -u
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE
S=.venv/bin/structlm
C=configs/share/experiment-verdicts.yaml
mkdir -p runs

step() {  # step OUT_DIR COMMAND...: wait while another process writes OUT_DIR, then run
    local out=$1
    shift
    while pgrep -f -- "--out $out( |$)" > /dev/null; do sleep 60; done
    echo "[$(date -u +%FT%TZ)] start $out" >> runs/verdict_reruns.log
    "$@" >> "$out.log" 2>&1
    local rc=$?  # before anything else sets $? (the date below would)
    echo "[$(date -u +%FT%TZ)] end $out (exit $rc)" >> runs/verdict_reruns.log
}

probe_a() { step runs/verdicts_probe_a $S experiment share smollm2 --config $C \
    --methods basis-sharing,svd-llm-w --probe-only --out runs/verdicts_probe_a --threads 1; }
probe_b() { step runs/verdicts_probe_b $S experiment share smollm2 --config $C \
    --methods svd-llm --probe-only --out runs/verdicts_probe_b --threads 1; }
share_a() { step runs/verdicts_a $S experiment share smollm2 --config $C --reductions 0.2 \
    --out runs/verdicts_a --add-runs runs/verdicts_probe_a runs/verdicts_probe_b --threads 1; }
share_b() { step runs/verdicts_b $S experiment share smollm2 --config $C --reductions 0.3,0.4 \
    --out runs/verdicts_b --add-runs runs/verdicts_probe_a runs/verdicts_probe_b --threads 1; }
study() { step runs/study-cpu-verdicts $S experiment study configs/study/cpu-verdicts.yaml \
    --threads 1; }
analysis_smollm2() {  # test 3 over three calibration draws, then tests 1-2 (test 8 reads both)
    step runs/share_smollm2_analysis_draws $S share analyze smollm2 --corpus austen --tests 3 \
        --calib-seeds 0,1,2 --threads 1 --out runs/share_smollm2_analysis_draws
    step runs/share_smollm2_analysis_draws $S share analyze smollm2 --corpus austen \
        --calib-seeds 0,1,2 --threads 1 --out runs/share_smollm2_analysis_draws; }
analysis_qwen() {
    step runs/share_qwen_analysis_draws $S share analyze qwen2.5-coder --corpus django \
        --second-corpus austen --tests 3 --calib-seeds 0,1,2 --threads 1 \
        --out runs/share_qwen_analysis_draws
    step runs/share_qwen_analysis_draws $S share analyze qwen2.5-coder --corpus django \
        --second-corpus austen --calib-seeds 0,1,2 --threads 1 \
        --out runs/share_qwen_analysis_draws; }
test6() { step runs/verdicts_test6 $S experiment share smollm2 \
    --config configs/share/experiment-test6.yaml --out runs/verdicts_test6 --threads 1; }

main() {  # one function, parsed whole before it runs: editing this file never breaks a run
    probe_a & probe_b & wait
    (analysis_smollm2; share_a; test6; analysis_qwen) & (share_b; study) & wait
    echo "[$(date -u +%FT%TZ)] all lanes done" >> runs/verdict_reruns.log
}
main "$@"; exit $?
