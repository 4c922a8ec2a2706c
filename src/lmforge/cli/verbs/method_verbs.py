"""The CLI verbs that train one method (`lmforge sft`, `lmforge dpo`, ...): each is `lmforge train` with
objective.name set to the verb's name, a method of config/methods.py (one of the methods' own files: the
test of method boundaries lists it). Not in config/, whose package loads pydantic, so that `lmforge --help`
lists the verbs without loading the config layer (0.1 s rather than 0.4 s). A method without a verb here
trains through `lmforge train` with objective.name set."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MethodVerb:
    help: str  # the verb's one line in `lmforge --help`
    # flags of the verb that, when given, run a function of the loaded config instead of training:
    # (flag, its help, "module:function")
    actions: tuple[tuple[str, str, str], ...] = ()
    # "module:function" planning and running the method in a wall-clock budget (`--budget DURATION`)
    budget: str | None = None


# verb (= the method's objective.name) -> its verb, in `lmforge --help` order
METHOD_VERBS: dict[str, MethodVerb] = {
    "dpo": MethodVerb("preference optimisation on chosen/rejected pairs (objective dpo: DPO, IPO, SimPO, "
                      "ORPO, ... by preference.loss), full or with adapters"),
    "reward": MethodVerb("train a reward model on chosen/rejected pairs (objective reward: a scalar score "
                         "head, Bradley-Terry loss), full or with adapters"),
    "rl": MethodVerb("reinforcement learning on sampled completions scored by rewards (objective rl: GRPO "
                     "or RLOO by rl.algorithm), full or with adapters"),
    "sft": MethodVerb("fine-tune on chat data (objective sft): full, LoRA, DoRA or QLoRA (the finetune "
                      "section)", budget="lmforge.tools.sft_planner_run:run_sft_budget"),
    "distill": MethodVerb(
        "knowledge distillation (objective distill): a student learns a teacher's next-token distributions "
        "(forward / reverse KL, generalised JSD) mixed with the data loss",
        actions=(("--precompute-topk", "write distill.teacher's top-k logits of every training and "
                  "validation window to distill.topk_cache, and exit",
                  "lmforge.finetune.topk_cache:precompute_topk"),)),
    "gkd": MethodVerb("knowledge distillation on chat data (objective gkd, generalized KD): a student "
                      "learns gkd.teacher's distributions on the completions (generalised JSD, gkd.beta), "
                      "partly on its own samples (gkd.lmbda)"),
    "classify": MethodVerb(
        "fine-tune a sequence classifier or regressor on labelled records (objective classify: a head of "
        "classify.num_labels outputs), full or with adapters",
        actions=(("--report", "evaluate the run (run.dir) on its validation split (eval.split): accuracy, "
                  "macro-F1, MCC, per-class precision / recall / F1, or Pearson / Spearman for regression",
                  "lmforge.eval.classification_metrics:report"),)),
    "tag": MethodVerb(
        "fine-tune a token tagger (NER-style token classification) on tagged words (objective tag: a "
        "per-token head of token_classify.num_labels outputs), full or with adapters",
        actions=(("--report", "evaluate the run (run.dir) on its validation split (eval.split): token "
                  "accuracy, entity-level precision / recall / F1 (seqeval's, BIO / IOB2 tags), per entity "
                  "type and per tag", "lmforge.eval.span_metrics:tag_report"),)),
    "qa": MethodVerb(
        "fine-tune an extractive question answerer on SQuAD-like records (objective qa: a start / end "
        "span head on every token), full or with adapters",
        actions=(("--report", "evaluate the run (run.dir) on its validation split (eval.split): exact match "
                  "and F1 of the best valid span (the SQuAD v1.1 script's)",
                  "lmforge.eval.span_metrics:qa_report"),)),
}
