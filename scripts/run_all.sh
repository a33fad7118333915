#!/usr/bin/env bash
# The whole pipeline in one command: SFT -> reward model -> PPO (or, with PIPELINE=dpo, SFT -> DPO),
# each stage reading the previous stage's output, all under one root, then report.md + plots there, and
# report.html: the run explorer (python -m rlhf.report; curves, configs, alarms, samples in one page).
#
#   bash scripts/run_all.sh                                   # embedded default, CPU (~10 min on 2 cores)
#   PIPELINE=dpo bash scripts/run_all.sh dpo:dpo.beta=0.2     # SFT -> DPO on the pairs, no reward model / PPO
#   OUTPUT_DIR=runs/exp1 bash scripts/run_all.sh              # choose the root (default: outputs)
#   bash scripts/run_all.sh sft:train.epochs=2 reward:train.lr=5e-4 ppo:ppo.kl_coef=0.05 all:engine=zero3
#   LAUNCH="torchrun --nproc_per_node 2" bash scripts/run_all.sh all:engine=zero3   # 2 ranks (micro-batches
#                                                             # fit themselves: 32 rows -> 16 per rank)
#   PRESET=smoke bash scripts/run_all.sh                      # a few steps per stage (tests, CI)
#   ALGO=grpo bash scripts/run_all.sh                         # the RL stage's algorithm: ppo (default),
#                                                             # grpo, rloo or reinforce_pp (conf/algorithm/)
#   TASK=tools bash scripts/run_all.sh                        # the tool task: 4-digit sums with the calculator
#                                                             # tool (data/tools, scripts/make_tool_data.py):
#                                                             # SFT (shipped + tool demonstrations) -> GRPO
#                                                             # with rollout.env=...calculator:Calculator,
#                                                             # rewarded by the gold judge (docs/environments.md)
#   TASK=tools TOOL=off bash scripts/run_all.sh               # its control arm: the same sums as direct answers
#                                                             # (data/tools/sft_direct.jsonl), RL without the tool
#   TASK=long bash scripts/run_all.sh                         # the long-answer task: counts written out term by
#                                                             # term, 50-400 tokens (data/long,
#                                                             # scripts/make_long_data.py): SFT -> reward -> RL
#                                                             # (ALGO=ppo or grpo) with 448 new tokens, overlong
#                                                             # shaping, truncation counted (docs/stages.md)
#   RM_ENSEMBLE=2 bash scripts/run_all.sh ppo:reward.ensemble_agg=mean_minus_std
#                                                             # a reward-model ensemble: the reward stage run N
#                                                             # times (reward/, reward_2/, ...; member k with seed +
#                                                             # 1000 x (k - 1) on pairs of its own: the shipped
#                                                             # data/default/pairs_train_<k>.jsonl), PPO scoring with
#                                                             # all (reward.ensemble_models; each a whole reward stage)
#   RM_ENSEMBLE=2 bash scripts/run_all.sh reward:data.path=/data/a.jsonl reward_2:data.path=/data/b.jsonl
#                                                             # your own pairs: reward_<k>: goes to member k only
#
#   FORCE=1 bash scripts/run_all.sh                          # re-run every stage from scratch
#   DRY_RUN=1 bash scripts/run_all.sh                         # say what each stage would do (skip, resume, run)
#                                                             # and print its full command, running nothing
#                                                             # (every stage's config is checked first, dry or
#                                                             # not: python -m rlhf.check; a bad key stops it)
#   SEEDS="1234 1 2" bash scripts/run_all.sh                  # a seed sweep: the pipeline once per seed
#                                                             # (all:seed=<s>) under $OUTPUT_DIR/seed_<s>/,
#                                                             # then $OUTPUT_DIR/sweep.md: per seed SFT gold,
#                                                             # RM accuracy, PPO gold, KL, times, the worst seed
#                                                             # first; mean ± std, min, max
#
# Arguments are Hydra overrides prefixed with the stage they go to (sft:, reward:, ppo:, dpo:) or all:
# (all: goes to the stages of the chosen PIPELINE: ppo = sft, reward, ppo; dpo = sft, dpo); reward: goes to
# every reward model, reward_<k>: to the ensemble's member k alone (2 <= k <= RM_ENSEMBLE), after reward:'s.
#
# Re-running into the same OUTPUT_DIR does only the work that is missing. Per stage, in order
# (scripts/stage_plan.py decides and prints one line saying which and why):
#   skipped  <stage>/summary.json exists and <stage>/config.yaml matches the config this invocation
#            would run;
#   resumed  (train.resume=true) no summary.json, config.yaml matches, and <stage>/checkpoints holds
#            a complete checkpoint (checkpoints are written with train.save_every > 0);
#   running  (train.overwrite=true: the stage's previous output is replaced) otherwise: no output
#            yet, a changed config, nothing to resume from, an earlier stage that ran or resumed in
#            this invocation (its output changed, so every later stage runs fresh), or FORCE=1.
# "Matches": the stage's config composed by Hydra from conf/<stage>.yaml and these overrides and
# converted to its dataclass exactly as the stage does (what it saves as config.yaml) is equal, key
# by key, to the saved config.yaml, train.resume and train.overwrite excepted. Paths compare as written. Not compared:
# the contents of data files, the code, LAUNCH: after changing those use FORCE=1.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="${OUTPUT_DIR:-outputs}"
LAUNCH="${LAUNCH:-python}"
PIPELINE_GIVEN="${PIPELINE:-}"  # TASK=tools runs a pipeline of its own: a PIPELINE beside it is refused, not dropped
PIPELINE="${PIPELINE:-ppo}"
case "$PIPELINE" in
  ppo|dpo|tools) ;;
  *) echo "run_all.sh: unknown PIPELINE=$PIPELINE (known: ppo = SFT -> reward -> PPO, dpo = SFT -> DPO)" >&2; exit 2 ;;
esac
case "${DRY_RUN:-0}" in 0|1) ;; *) echo "run_all.sh: DRY_RUN is 1 (print the commands, run nothing) or 0, got '$DRY_RUN'" >&2; exit 2 ;; esac
SFT=() RM=() PPO=() DPO=()
case "${TASK:-default}" in
  default)
    # 8 passes over the demonstrations instead of the stage's 5 (SFT -> reward -> RL only): at 5 the SFT model
    # still miscopies digits in 16-18 of 44 held-out sort answers on some seeds, which PPO does not repair
    # (it removes the demonstrator's order habit, not a missing skill); 8 passes took that to 0 on seeds 2
    # and 1234 (PPO gold 85.5 -> 94.5, 93.5 -> 95.5), not on seed 3 (22; PPO 85.5): docs/results-log.md
    # And 12 attention heads of 16 dimensions instead of 6 of 32 (the same parameters; the reward model and the policy
    # inherit it from the SFT output): seeds 2 / 3 / 4 miscopied 0 / 1 / 2 instead of 6 / 14 / 12, and PPO read
    # 96.5 / 96.0 / 94.5 instead of 90.0 / 85.5 / 85.5; three SFT starts (sft:starts.n=3) did less (96.0 / 94.0 / 91.0)
    # for a quarter more SFT steps. The cost: its reward models rank held-out pairs worse (0.877-0.957 over five seeds,
    # three under 0.90; 6 heads: 0.913-0.960), yet train the better policies (docs/results-log.md). With the pairs shipped
    # since 2026-11-28 (a sort's slips mostly wrong digits): 0.887-0.923, and PPO 95.0-97.5 at KL <= 0.48
    if [ "$PIPELINE" = ppo ]; then
      SFT+=(train.epochs=8 model.config.num_attention_heads=12 model.config.num_key_value_heads=12)
    fi ;;
  tools)  # SFT -> RL with the calculator tool; no reward model (the judge scores the final answer)
    if [ -n "$PIPELINE_GIVEN" ] && [ "$PIPELINE_GIVEN" != tools ]; then
      echo "run_all.sh: TASK=tools runs its own pipeline (SFT -> GRPO with the calculator tool, no reward model):" \
           "PIPELINE=$PIPELINE_GIVEN does not apply to it; drop PIPELINE, or drop TASK=tools" >&2; exit 2
    fi
    PIPELINE=tools
    TOOL_DATA=(data.eval_prompts_path=data/tools/eval_tools.jsonl)
    # data.max_len=112: a tool demonstration is ~93 tokens (the default 64 would cut its answer turn off);
    # train.epochs=3 (918 steps) rather than the default 5: the pipeline within 10 minutes on 2 CPU cores
    SFT+=(train.epochs=3)
    case "${TOOL:-on}" in
      on) SFT+=("data.path=[data/default/sft_train.jsonl,data/tools/sft_tools.jsonl]" "${TOOL_DATA[@]}" data.max_len=112)
          PPO+=(data.path=data/tools/prompts_tools.jsonl "${TOOL_DATA[@]}" "reward.sources=[judge]"
                rollout.env=rlhf.rl.environments.calculator:Calculator rollout.max_turns=3 rollout.max_new_tokens=16
                rollout.max_episode_tokens=64 rollout.env_workers=0) ;;  # the calculator: bounded arithmetic, in-process
      off)  # the control arm: the same sums demonstrated as direct answers, RL on the same prompts without the tool
          SFT+=("data.path=[data/default/sft_train.jsonl,data/tools/sft_direct.jsonl]" "${TOOL_DATA[@]}" data.max_len=112)
          PPO+=(data.path=data/tools/prompts_tools.jsonl "${TOOL_DATA[@]}" "reward.sources=[judge]" rollout.max_new_tokens=16) ;;
      *) echo "run_all.sh: unknown TOOL=${TOOL} (known: on = with the calculator, off = the same sums without it)" >&2; exit 2 ;;
    esac
    ALGO="${ALGO:-grpo}"
    ;;
  long)  # long answers: counts written out term by term, 50-400 tokens (data/long, scripts/make_long_data.py)
    if [ "$PIPELINE" != ppo ]; then
      echo "run_all.sh: TASK=long runs SFT -> reward -> RL (ALGO=ppo or grpo): PIPELINE=$PIPELINE does not apply to it;" \
           "drop PIPELINE" >&2; exit 2
    fi
    # Positions for a 48-token prompt (bos counted) and 448 new tokens (512; the tiny model's 128 would not hold an
    # answer); rows of up to 456 tokens (the longest demonstration is 449 with its prompt and eos); every generation up
    # to 448 new tokens, the held-out ones too, so a response that never stops is truncated at the same budget in every
    # stage. DAPO's overlong shaping on the last 40 of them: no correct answer (<= 401 tokens with its eos) is shaped.
    # The schedule (docs/stages.md, the long-answer task): 600 SFT steps of 8 demonstrations, 100 reward steps of 16
    # pairs, 10 RL steps of 32 responses at actor.lr=2e-4 (below, after ALGO's settings), evaluated every 5 steps on
    # 50 held-out prompts.
    LONG_EVAL=(data.eval_prompts_path=data/long/eval_prompts.jsonl data.num_eval_prompts=50 eval.max_new_tokens=448)
    SFT+=(data.path=data/long/sft_train.jsonl "${LONG_EVAL[@]}" data.max_len=456 model.config.max_position_embeddings=512
          train.global_batch_size=8 train.micro_batch_size=8 train.lr=2e-3 train.warmup_steps=10 train.max_steps=600)
    RM+=(data.path=data/long/pairs_train.jsonl data.eval_path=data/long/pairs_eval.jsonl data.max_len=456
         train.max_steps=100 train.global_batch_size=16 train.micro_batch_size=16)
    PPO+=(data.path=data/long/prompts_train.jsonl "${LONG_EVAL[@]}" rollout.max_new_tokens=448
          ppo.overlong_buffer=40 ppo.overlong_penalty=1.0) ;;
  *) echo "run_all.sh: unknown TASK=${TASK} (known: default, tools = sums with the calculator tool," \
          "long = long answers: counts written out term by term)" >&2; exit 2 ;;
esac
if [ -n "${TOOL:-}" ] && [ "${TASK:-default}" != tools ]; then
  echo "run_all.sh: TOOL=${TOOL} chooses the tool task's arm: it needs TASK=tools" >&2; exit 2
fi
# The embedded default's one deviation from the stage defaults: a stronger KL penalty than
# DeepSpeed-Chat's ppo.kl_coef=0.1, because a ~1M-parameter reward model is easy to over-optimise.
# Measured on 2 CPU cores, shipped data, seeds 1234 / 1 / 2 (their SFT and reward outputs, reward
# models trained before reward.head_only_fraction existed): with 0.3 the gold gain was
# +25.5 / +16.0 / +26.0 (seed 1 peaked at +18.5 on step 10, then the policy hacked the reward model: training reward up, gold down, KL 1.37); with 0.8, +28.0 / +22.0 / +25.0
# at KL 0.21 / 0.63 / 0.50 (0.5: seed 1 +21.0). Any ppo:ppo.kl_coef=... argument overrides it. ALGO picks the RL stage's
# algorithm (python -m rlhf.ppo algorithm=$ALGO); the critic-free ones keep their own KL settings.
# The PPO stage holds a KL budget (issue #37): the coefficient starts at 0.8 and the controller only raises it
# while the KL is over 0.3 (ppo.kl_coef_min=null: never below 0.8; Ziegler's rule alone had taken it from 0.8
# to 0.31 before the KL rose). On the 5-epoch SFT outputs of seeds 2 / 1 the fixed 0.8 ended at gold 85.5 /
# 96.0 at KL 0.52 / 0.55, this at 87.5 / 97.0 at KL 0.48 / 0.46 (docs/results-log.md).
# GRPO on the embedded default's reward model holds a KL budget of its own (issue #37): its KL is a loss term (k3 per
# token, ppo.kl_loss_coef), which the controller moves when the reward carries none; the coefficient starts at 0.4
# instead of the algorithm's 0.01 and is only raised while the KL is over 0.3. With 0.01 it over-optimised the reward
# model on 3 of 5 seeds (KL 1.6-3.9, gold down to 64.5); docs/results-log.md. (The tool task, rewarded by the judge, keeps
# the algorithm's own settings.) GRPO's step takes 16 prompts x 8 samples (128 responses; the algorithm's 8 x 8
# is 64), sampled at temperature 1.2: the same 31 steps then see 496 prompts instead of 248. Gold on seeds 1 / 2 / 3 / 4 / 1234: 8 x 8 at 1.0 95.0 / 89.5 / 95.5 /
# 94.0 / 91.5; 16 x 8 at 1.0 96.5 / 97.5 / 95.5 / 93.0 / 95.5; 16 x 8 at 1.2 96.0 / 96.5 / 96.0 / 96.5 / 96.0,
# held-out KL at temperature 1 of 0.24-0.39 (the budget reads the KL at the sampling temperature); docs/results-log.md.
# Both end within a KL budget of 0.5 nats (train.kl_budget=0.5): the controllers aim at 0.3 on the sampled
# training responses, but the held-out KL reported (one sampled response per held-out prompt) can end over 0.5 (seed 2: 0.29 at step 20, 0.82 at step 31); an
# evaluation over the budget ends the stage and the actor of the last evaluation within it is exported
# (summary.json: exported_step, kl_budget_exceeded; docs/algorithms.md).
ALGO="${ALGO:-ppo}"
case "$ALGO" in
  ppo) PPO+=(ppo.kl_coef=0.8 ppo.adaptive_kl=true ppo.kl_target=0.3 ppo.kl_horizon=150 ppo.kl_coef_min=null
             train.kl_budget=0.5) ;;
  grpo) PPO+=(algorithm=grpo)
        if [ "$PIPELINE" = ppo ]; then
          PPO+=(ppo.kl_loss_coef=0.4 ppo.adaptive_kl=true ppo.kl_target=0.3 ppo.kl_horizon=64 ppo.kl_coef_min=null
                train.kl_budget=0.5 rollout.prompts_per_step=16 rollout.temperature=1.2)
        fi ;;
  rloo|reinforce_pp) PPO+=("algorithm=$ALGO") ;;
  *) echo "run_all.sh: unknown ALGO=$ALGO (known: ppo grpo rloo reinforce_pp)" >&2; exit 2 ;;
esac
if [ "${TASK:-default}" = long ]; then  # 32 responses of up to 448 tokens a step (GRPO, RLOO: 4 prompts x 8 samples)
  # alarms.window=5: the trend alarms (length, entropy) compare steps 6-10 with 1-5 (at 10, they need 20 steps)
  # KL to the reference is summed over a response: ~225 tokens here, ~10 on the default task, so the KL budget and the
  # controllers' target are the default's x6 and x3 (per token still ~0.01 nats); at 0.5 the held-out KL of 0.97-1.2
  # after 5 steps stopped 2 of 3 seeds with the SFT model exported, though one had reached gold 86 (docs/stages.md)
  PPO+=(train.max_steps=10 train.eval_every=5 actor.lr=2e-4 alarms.window=5 ppo.kl_target=1.0 train.kl_budget=3.0)
  if [ "$ALGO" = grpo ] || [ "$ALGO" = rloo ]; then PPO+=(rollout.prompts_per_step=4); else PPO+=(rollout.prompts_per_step=32); fi
fi

RM_ENSEMBLE="${RM_ENSEMBLE:-1}"
case "$RM_ENSEMBLE" in
  ""|*[!0-9]*|0) echo "run_all.sh: RM_ENSEMBLE is the number of reward models (an integer >= 1), got '$RM_ENSEMBLE'" >&2; exit 2 ;;
esac

case "${PRESET:-}" in
  "") ;;
  smoke)
    SFT+=(train.max_steps=30 train.eval_every=0 data.num_eval_prompts=40 train.lr=3e-3)
    RM+=(train.max_steps=20 train.eval_every=0)
    PPO+=(train.max_steps=2 train.eval_every=0 train.kl_budget=null data.num_eval_prompts=40)  # no evaluations to budget
    # 32 sampled responses per step, whatever the algorithm's samples per prompt
    if [ "$ALGO" = grpo ] || [ "$ALGO" = rloo ]; then PPO+=(rollout.prompts_per_step=4); else PPO+=(rollout.prompts_per_step=32); fi
    DPO+=(train.max_steps=10 train.eval_every=0 data.num_eval_prompts=40)
    ;;
  *) echo "run_all.sh: unknown PRESET=$PRESET (known: smoke)" >&2; exit 2 ;;
esac
if [ "${PRESET:-}" = smoke ] && [ "${TASK:-default}" = long ]; then
  # the long task at smoke size (CI): a few steps of 8 rows, generations cut at 64 new tokens (most answers are
  # longer, so truncation is exercised and counted), overlong shaping on the last 16 of them
  SMOKE_LONG=(eval.max_new_tokens=64 data.num_eval_prompts=8)
  SFT+=(train.max_steps=4 train.global_batch_size=8 train.micro_batch_size=8 "${SMOKE_LONG[@]}")
  RM+=(train.max_steps=4 train.global_batch_size=8 train.micro_batch_size=8)
  PPO+=(train.max_steps=2 "${SMOKE_LONG[@]}" rollout.max_new_tokens=64 ppo.overlong_buffer=16 rollout.mini_batch_size=8
        rollout.micro_batch_size=8)
  if [ "$ALGO" = grpo ] || [ "$ALGO" = rloo ]; then PPO+=(rollout.prompts_per_step=1); else PPO+=(rollout.prompts_per_step=8); fi
fi

MEMBER_ARGS=()  # "k:override" of reward_k: arguments (one ensemble member's own, after reward:'s)
for arg in "$@"; do
  case "$arg" in
    sft:*) SFT+=("${arg#sft:}") ;;
    reward:*) RM+=("${arg#reward:}") ;;
    reward_*:*)
      k="${arg%%:*}"; k="${k#reward_}"
      case "$k" in
        ""|*[!0-9]*) echo "run_all.sh: prefix each override with its stage (sft:, reward:, reward_<k>:, ppo:, dpo: or all:), got '$arg'" >&2; exit 2 ;;
      esac
      if [ "$PIPELINE" != ppo ] || [ "$k" -lt 2 ] || [ "$k" -gt "$RM_ENSEMBLE" ]; then
        echo "run_all.sh: '$arg' goes to reward model $k of the ensemble, but there are members 2 to $RM_ENSEMBLE" \
             "(RM_ENSEMBLE=$RM_ENSEMBLE, PIPELINE=$PIPELINE; reward: goes to every reward model)" >&2; exit 2
      fi
      MEMBER_ARGS+=("$k:${arg#*:}") ;;
    ppo:*) PPO+=("${arg#ppo:}") ;;
    dpo:*) DPO+=("${arg#dpo:}") ;;
    all:*) SFT+=("${arg#all:}"); RM+=("${arg#all:}"); PPO+=("${arg#all:}"); DPO+=("${arg#all:}") ;;
    *) echo "run_all.sh: prefix each override with its stage (sft:, reward:, reward_<k>:, ppo:, dpo: or all:), got '$arg'" >&2; exit 2 ;;
  esac
done

explorer() {  # $ROOT/report.html: the run explorer over every run under $ROOT (needs plotly: the report extra)
  if python -c "import plotly" 2>/dev/null; then
    python -m rlhf.report "$ROOT" --out "$ROOT/report.html"
  else
    echo "run_all.sh: no $ROOT/report.html: the run explorer needs plotly (pip install -e \".[report]\")"
  fi
}

if [ -n "${SEEDS:-}" ]; then  # a seed sweep: this script once per seed, then the table of all of them
  seeds=()
  for s in $SEEDS; do
    case "$s" in *[!0-9]*) echo "run_all.sh: SEEDS holds seeds (integers >= 0) separated by spaces, got '$s'" >&2; exit 2 ;; esac
    seeds+=("$s")
  done
  [ "${#seeds[@]}" -gt 0 ] || { echo "run_all.sh: SEEDS holds no seed" >&2; exit 2; }
  for s in "${seeds[@]}"; do
    echo "=== seed $s -> $ROOT/seed_$s"
    SEEDS="" OUTPUT_DIR="$ROOT/seed_$s" bash scripts/run_all.sh "$@" "all:seed=$s"
  done
  [ "${DRY_RUN:-0}" = 1 ] && exit 0
  python scripts/report.py "$ROOT" --sweep "${seeds[@]}"
  explorer  # over every seed's stages
  exit 0
fi

run() {  # run <module> <overrides...> (DRY_RUN=1: print the command instead)
  local module="$1"; shift
  if [ "${DRY_RUN:-0}" = 1 ]; then
    if [ "$LAUNCH" = python ]; then printf '%q ' python -m "rlhf.$module" "$@"; else printf '%s ' "$LAUNCH"; printf '%q ' -m "rlhf.$module" "$@"; fi
    echo; return 0
  fi
  if [ "$LAUNCH" = python ]; then python -m "rlhf.$module" "$@"; else $LAUNCH -m "rlhf.$module" "$@"; fi
}

UPSTREAM_RAN=""  # set once a stage ran or resumed: the stages after it must run fresh
SKIPPED=""       # set once a stage was skipped: this invocation's wall time is then not the pipeline's

stage() {  # stage <module> <title> <overrides...>: skip, resume or run it, and say which and why
  local module="$1" title="$2"; shift 2
  local out="$ROOT/${STAGE_DIR:-$module}" action reason  # STAGE_DIR: another directory than <module> (reward_2)
  local skipped=skipped resumed=resumed running=running ran=ran
  [ "${DRY_RUN:-0}" = 1 ] && skipped="would skip" resumed="would resume" running="would run" ran="would run"
  if [ "${FORCE:-0}" = 1 ]; then
    action=run reason="FORCE=1"
  elif [ -n "$UPSTREAM_RAN" ]; then
    action=run reason="the $UPSTREAM_RAN stage before it $ran in this invocation"
  else
    read -r action reason < <(python scripts/stage_plan.py "$module" "$out" "output_dir=$out" "$@")
  fi
  case "$action" in
    skip) echo "== $title: $skipped ($reason) -> $out"; SKIPPED=1 ;;
    resume) echo "== $title: $resumed ($reason) -> $out"
            run "$module" "output_dir=$out" "$@" train.resume=true; UPSTREAM_RAN="$module" ;;
    *) echo "== $title: $running (${reason:-stage_plan.py gave no answer}) -> $out"
       run "$module" "output_dir=$out" "$@" train.overwrite=true; UPSTREAM_RAN="$module" ;;
  esac
}

member_overrides() {  # member_overrides <k> [quiet]: MEMBER_OVR = reward model k's overrides (its stage's, after reward:'s)
  # Member k: seed + 1000 x (k - 1), on pairs of its own: on the embedded default the shipped independent samples
  # data/default/pairs_train_<k>.jsonl (k = 2, 3; scripts/make_default_data.py), with your data what
  # reward_<k>:data.path=... names. Members trained on the same pairs share their blind spots (docs/algorithms.md,
  # "The over-optimisation case").
  local k="$1" base=1234 own_data="" member_data="" a
  local MEMBER=() DATA=() OWN=()
  for a in ${RM[@]+"${RM[@]}"}; do
    case "$a" in seed=*) base="${a#seed=}" ;; *) MEMBER+=("$a") ;; esac
    case "$a" in data.path=*) own_data=1 ;; esac
  done
  for a in ${MEMBER_ARGS[@]+"${MEMBER_ARGS[@]}"}; do [ "${a%%:*}" = "$k" ] && OWN+=("${a#*:}"); done
  for a in ${OWN[@]+"${OWN[@]}"}; do case "$a" in data.path=*) member_data=1 ;; esac; done
  if [ -z "$own_data$member_data" ] && [ -f "data/default/pairs_train_$k.jsonl" ]; then
    DATA=("data.path=data/default/pairs_train_$k.jsonl" data.eval_path=data/default/pairs_eval.jsonl)
  elif [ -z "$member_data" ] && [ -z "${2:-}" ]; then
    echo "run_all.sh: reward model $k of $RM_ENSEMBLE trains on the first member's pairs (give it its own with" \
         "reward_$k:data.path=...; the embedded default ships three samples of its pairs): it shares their blind spots"
  fi
  MEMBER_OVR=("model.name_or_path=$ROOT/sft" model.fallback_to_config=false ${DATA[@]+"${DATA[@]}"}
              ${MEMBER[@]+"${MEMBER[@]}"} "seed=$(( base + 1000 * (k - 1) ))" ${OWN[@]+"${OWN[@]}"})
}

if [ "$PIPELINE" = ppo ] && [ "$RM_ENSEMBLE" -gt 1 ]; then  # PPO scores with every member (reward.ensemble_models)
  members=()
  for k in $(seq 2 "$RM_ENSEMBLE"); do members+=("$ROOT/reward_$k"); done
  PPO+=("reward.ensemble_models=[$(IFS=,; echo "${members[*]}")]")
fi

# Every stage's config is checked before the first stage runs (python -m rlhf.check: keys, types, group choices,
# ranges, batch arithmetic, the choices that conflict), DRY_RUN=1 included: a pipeline that would stop at its
# third stage stops here, naming the stage and the key, before the first has spent a minute.
WORLD=1
if [[ "$LAUNCH" =~ --nproc[_-]per[_-]node[=\ ]+([0-9]+) ]]; then WORLD="${BASH_REMATCH[1]}"; fi
CHECK=(sft "output_dir=$ROOT/sft" ${SFT[@]+"${SFT[@]}"})
if [ "$PIPELINE" = dpo ]; then
  CHECK+=(--- dpo "output_dir=$ROOT/dpo" "model.name_or_path=$ROOT/sft" ${DPO[@]+"${DPO[@]}"})
elif [ "$PIPELINE" = tools ]; then
  CHECK+=(--- ppo "output_dir=$ROOT/ppo" "actor.model=$ROOT/sft" "critic.model=$ROOT/sft" ${PPO[@]+"${PPO[@]}"})
else
  CHECK+=(--- reward "output_dir=$ROOT/reward" "model.name_or_path=$ROOT/sft" model.fallback_to_config=false
          ${RM[@]+"${RM[@]}"})
  for k in $(seq 2 "$RM_ENSEMBLE"); do
    member_overrides "$k" quiet
    CHECK+=(--- reward "output_dir=$ROOT/reward_$k" "${MEMBER_OVR[@]}")
  done
  CHECK+=(--- ppo "output_dir=$ROOT/ppo" "actor.model=$ROOT/sft" "critic.model=$ROOT/reward" ${PPO[@]+"${PPO[@]}"})
fi
python -m rlhf.check --world "$WORLD" "${CHECK[@]}" || exit $?

start=$(date +%s)
stage sft SFT "${SFT[@]}"
if [ "$PIPELINE" = dpo ]; then
  stage dpo DPO "model.name_or_path=$ROOT/sft" "${DPO[@]}"
elif [ "$PIPELINE" = tools ]; then  # no critic (GRPO) and no reward model: critic.model is only read as a path
  stage ppo "RL with the calculator tool" "actor.model=$ROOT/sft" "critic.model=$ROOT/sft" "${PPO[@]}"
else
  stage reward "reward model" "model.name_or_path=$ROOT/sft" model.fallback_to_config=false "${RM[@]}"
  for k in $(seq 2 "$RM_ENSEMBLE"); do  # the ensemble's other members: the same stage (member_overrides)
    member_overrides "$k"
    STAGE_DIR="reward_$k" stage reward "reward model $k of $RM_ENSEMBLE" "${MEMBER_OVR[@]}"
  done
  stage ppo PPO "actor.model=$ROOT/sft" "critic.model=$ROOT/reward" "${PPO[@]}"
fi
[ "${DRY_RUN:-0}" = 1 ] && exit 0  # nothing ran: no report
if [ -n "$SKIPPED" ]; then
  python scripts/report.py "$ROOT" --pipeline "$PIPELINE"  # total time = the stages' own times, from their summaries
else
  python scripts/report.py "$ROOT" --pipeline "$PIPELINE" --total-s "$(( $(date +%s) - start ))"
fi
explorer
