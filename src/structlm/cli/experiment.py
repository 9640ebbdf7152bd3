"""``structlm experiment study|share|convert|demo``: the long, resumable experiments that
write reports (:mod:`structlm.experiments`); ``structlm demo`` is the demo's shortcut."""

from __future__ import annotations

import argparse
from typing import Any

from structlm.cli.args import MODEL_HELP, positive_int
from structlm.cli.dataclass_flags import add_dataclass_flags
from structlm.config import read_yaml

_YAML_TITLE = "{} fields (a flag given overrides the YAML's key; lists are comma-separated)"


def _cmd_study(args: argparse.Namespace) -> int:
    from structlm.experiments.study.config import load_study_config
    from structlm.experiments.study.run import run_study

    cfg = load_study_config(args.config, out_dir=args.out, max_steps=args.max_steps,
                            threads=args.threads)
    report = run_study(cfg)
    print(report.read_text())
    print(f"wrote {report} (and runs.csv, arms.csv, curves.png, loss_vs_macs.png)")
    return 0


def share_experiment_config(args: argparse.Namespace) -> Any:
    """The ExperimentConfig of ``experiment share``: the YAML, then the flags given (the
    ``--finetune-*`` / ``--seed-finetune-*`` flags override keys of the nested mappings)."""
    from structlm.experiments.share.experiment import ExperimentConfig

    raw = {**read_yaml(args.config), "model": args.model, **args.flags.values(args)}
    for key, flags in (("finetune", args.ft_flags), ("seed_finetune", args.seed_ft_flags)):
        if flags.values(args):
            raw[key] = {**(raw.get(key) or {}), **flags.values(args)}
    return ExperimentConfig.from_dict(raw)


def _cmd_share(args: argparse.Namespace) -> int:
    import torch

    from structlm.experiments.share.experiment import run_experiment

    torch.set_num_threads(args.threads)
    cfg = share_experiment_config(args)
    res = run_experiment(cfg, args.out, analytic_only=args.analytic_only,
                         add_runs=args.add_runs, probe_only=args.probe_only)
    print(f"{args.out.rstrip('/')}/report.md written ({res['seconds'] / 60:.1f} min)")
    return 0


def _cmd_transfer(args: argparse.Namespace) -> int:
    from structlm.experiments.share.transfer import load_results, write_transfer_report

    a = load_results(args.analysis[0], args.experiment[0])
    b = load_results(args.analysis[1], args.experiment[1])
    print(f"{write_transfer_report(a, b, args.out)} written")
    return 0


def convert_experiment_config(args: argparse.Namespace) -> Any:
    """The ConvertExperimentConfig of ``experiment convert``: the YAML, then the flags."""
    from structlm.experiments.convert.experiment import ConvertExperimentConfig

    raw = {**read_yaml(args.config), "model": args.model, **args.flags.values(args)}
    if args.heal_flags.values(args):
        raw["heal"] = {**(raw.get("heal") or {}), **args.heal_flags.values(args)}
    return ConvertExperimentConfig.from_dict(raw)


def _cmd_convert(args: argparse.Namespace) -> int:
    import torch

    from structlm.experiments.convert.experiment import run_convert_experiment

    cfg = convert_experiment_config(args)
    torch.set_num_threads(args.threads)
    res = run_convert_experiment(cfg, args.out, report_only=args.report_only,
                                 add_runs=args.add_runs)
    print(f"{args.out.rstrip('/')}/report.md written ({res['seconds'] / 60:.1f} min)")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from structlm.experiments.demo import run_demo

    run_demo(args.out, steps=args.steps, algebra=args.algebra, share=not args.no_share)
    return 0


def _add_demo(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=positive_int, default=100,
                        help="training steps per model")
    parser.add_argument("--algebra", default="Q2^2")
    parser.add_argument("--out", default="demo-report")
    parser.add_argument("--no-share", action="store_true",
                        help="skip the shared-basis section (SmolLM2, ~2 min)")
    parser.set_defaults(func=_cmd_demo)


def add_experiment_commands(sub: Any) -> None:
    """Register ``experiment`` (and the ``demo`` shortcut) on the top-level subparsers."""
    from structlm.experiments.convert.experiment import ConvertExperimentConfig
    from structlm.experiments.share.experiment import ExperimentConfig
    from structlm.hf.finetune import FinetuneConfig

    ex = sub.add_parser("experiment", help="long resumable experiments that write reports "
                        "(study, share, convert, demo)").add_subparsers(
        dest="experiment_command", required=True)

    st = ex.add_parser("study", help="train a set of LM arms on the same data, tokens and "
                       "seeds, then report (resumes arm by arm)")
    st.add_argument("config", help="study YAML (see configs/study/)")
    st.add_argument("--out", default=None, help="override out_dir")
    st.add_argument("--max-steps", type=positive_int, default=None,
                    help="override train.max_steps")
    st.add_argument("--threads", type=positive_int, default=None,
                    help="torch threads (runtime only: a run may resume with another value)")
    st.set_defaults(func=_cmd_study)

    sh = ex.add_parser("share", help="shared-basis compression tests 4-9 end to end (hours "
                       "on 2 cores with the defaults; resumes arm by arm)")
    sh.add_argument("model", help=MODEL_HELP)
    sh.add_argument("--config", default=None, help="YAML with ExperimentConfig fields")
    sh.add_argument("--analytic-only", action="store_true",
                    help="stop after compressing and evaluating every arm (no fine-tuning)")
    sh.add_argument("--probe-only", action="store_true",
                    help="stop after the learning-rate probe (lr_probe_rates); split over "
                         "processes by --methods, the whole-model runs then --add-runs them")
    sh.add_argument("--threads", type=positive_int, default=2)
    sh.add_argument("--out", default="share-experiment")
    sh.add_argument("--add-runs", nargs="+", default=[], metavar="DIR",
                    help="first add the finished arms of these folders of the same "
                         "experiment (parts of the plan run elsewhere) to OUT's arms.json")
    sh.set_defaults(func=_cmd_share,
                    flags=add_dataclass_flags(sh, ExperimentConfig, exclude=("model",),
                                              title=_YAML_TITLE.format("ExperimentConfig")),
                    ft_flags=add_dataclass_flags(
                        sh, FinetuneConfig, prefix="finetune",
                        title="FinetuneConfig fields of the whole-model and scope arms"),
                    seed_ft_flags=add_dataclass_flags(
                        sh, FinetuneConfig, prefix="seed-finetune",
                        title="FinetuneConfig fields of the seed regime's arms"))

    tr = ex.add_parser("transfer", help="test 8: two models' shared-basis findings side by "
                       "side (does each transfer?)")
    tr.add_argument("--analysis", nargs=2, required=True, metavar=("A", "B"),
                    help="the two `structlm share analyze` folders (results.json)")
    tr.add_argument("--experiment", nargs=2, required=True, metavar=("A", "B"),
                    help="the two `structlm experiment share` folders (experiment.json), "
                         "in the same model order")
    tr.add_argument("--out", default="share-transfer")
    tr.set_defaults(func=_cmd_transfer)

    cv = ex.add_parser("convert", help="convert a pretrained model, heal it, and compare "
                       "equal-MAC baselines healed the same way (resumes arm by arm)")
    cv.add_argument("model", help=MODEL_HELP)
    cv.add_argument("--config", default=None, help="YAML with ConvertExperimentConfig fields")
    cv.add_argument("--threads", type=positive_int, default=2)
    cv.add_argument("--out", default="convert-report")
    cv.add_argument("--add-runs", nargs="+", default=[], metavar="DIR",
                    help="first add the finished runs of these folders of the same "
                         "experiment (parts of the plan run elsewhere) to OUT's arms.json")
    cv.add_argument("--report-only", action="store_true",
                    help="run nothing: rebuild results.json and the report from the "
                         "finished runs in OUT/arms.json")
    cv.set_defaults(func=_cmd_convert,
                    flags=add_dataclass_flags(cv, ConvertExperimentConfig, exclude=("model",),
                                              title=_YAML_TITLE.format(
                                                  "ConvertExperimentConfig")),
                    heal_flags=add_dataclass_flags(cv, FinetuneConfig, prefix="heal",
                                                   title=_YAML_TITLE.format(
                                                       "healing FinetuneConfig")))

    _add_demo(ex.add_parser("demo", help="dense vs algebra LMs end to end (about 8 min on "
                            "2 cores)"))
    _add_demo(sub.add_parser("demo", help="the demo (= structlm experiment demo)"))
