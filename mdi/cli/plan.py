"""mdi-plan: split a model's layers over a config's nodes by their measured speed, memory and links."""
import argparse
import os
import sys
from typing import TYPE_CHECKING, List, Optional

from mdi.cli.arguments import ArgumentParser, positive_int
from mdi.cli.output import check_output
from mdi.cli.process import EXIT_CONFIG, EXIT_RUN, fail, setup_process
from mdi.model.layout import CheckpointError
from mdi.model.tokenizers import TokenizerError
from mdi.runconfig import ConfigError, load_config
from mdi.system.files import write_text

if TYPE_CHECKING:  # the starter is imported when mdi-plan runs, not when the CLI loads
    from mdi.starter.planning.planner import LayerPlan
    from mdi.starter.planning.run_plan import RunPlan


def plan_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="mdi-plan",
        description="Split a model's layers over a config's nodes by their measured speed, memory and links: "
                    "every worker times the model's blocks (random weights, nothing of the model is sent), the "
                    "starter its own and the head, all at once, then the split predicted to make the most "
                    "tokens/s for S samples in flight wins (the fastest slowest stage, when S fills the ring). "
                    "A node that would slow the ring gets no layers and is left out, and the plan says why. "
                    "Prints the plan as a table and as YAML; `layers: auto` in a config makes mdi-start plan "
                    "the same way at start.",
        epilog="Example: mdi-plan --config configs/ring3.yaml --samples 6 --write configs/ring3-planned.yaml")
    p.add_argument("--config", required=True, help="run configuration (YAML): its nodes, model and runtime")
    p.add_argument("--samples", type=positive_int, metavar="S",
                   help="samples in flight to plan for (default: generation.n_samples, else the prompts, else 2 "
                        "per node: enough to keep every node busy)")
    p.add_argument("--max-len", type=positive_int, metavar="N",
                   help="positions per KV cache slot to budget memory for (default: the longest prompt + "
                        "generation.n_tokens, at most the model's context)")
    p.add_argument("--write", metavar="PLAN.yaml", help="also write the config with the planned layers here")
    p.add_argument("--refresh", action="store_true",
                   help="measure again instead of using the cached profiles ($MDI_PROFILE_CACHE, ~/.cache/mdi)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON (for scripts) instead of a table")
    return p


def plan_main(argv: Optional[List[str]] = None) -> int:
    args = plan_parser().parse_args(argv)
    from mdi.model.source import ModelSource
    from mdi.ring.auth import TokenError, load_token
    from mdi.starter.control import NodeError
    from mdi.starter.planning.planner import format_plan
    from mdi.starter.planning.run_plan import plan_run
    from mdi.starter.planning.run_shape import planning_shape
    try:
        check_output(args.write, "--write")  # before every node is measured, not after
        if args.write and os.path.exists(args.write) and os.path.exists(args.config) and \
                os.path.samefile(args.write, args.config):
            raise ConfigError("--write %s is the --config being planned: its comments and its layers: auto would "
                              "be lost; write the plan to another file" % args.write)
        cfg = load_config(args.config)
        cfg.runtime.token = load_token(cfg.runtime.token_file)
        setup_process(threads=cfg.runtime.threads)
        source = ModelSource(cfg.model.path)
        shape = planning_shape(cfg, source, args.samples, args.max_len)
        run_plan = plan_run(cfg, source, shape, measure=True, refresh=args.refresh,
                            say=_say)
    except (ConfigError, CheckpointError, TokenizerError, TokenError) as e:
        return fail(str(e), EXIT_CONFIG)
    except NodeError as e:
        return fail(str(e), EXIT_RUN)
    plan = run_plan.layer_plan
    if plan is None:  # measure=True always plans
        raise AssertionError("mdi-plan: no layer plan")
    text = _plan_yaml(args.config, run_plan, plan, shape.n_slots)
    if args.json:
        import json
        print(json.dumps(plan.metrics(), indent=1))
    else:
        print(format_plan(plan))
        for name, why in plan.dropped.items():
            print("%s: %s" % (name, why))
        print("\n" + text)
    if args.write:
        try:
            write_text(args.write, text)  # its folder made, whole or not at all
        except OSError as e:
            return fail("--write %s: cannot write it: %s" % (args.write, e.strerror or e), EXIT_CONFIG)
        print("mdi-plan: wrote %s" % args.write, file=sys.stderr)
    return 0


def _plan_yaml(config_path: str, run_plan: "RunPlan", plan: "LayerPlan", samples: int) -> str:
    """The user's config file with each kept node's planned layer count and the left-out nodes
    removed (their names in a comment), and generation.n_samples the `samples` it was planned
    for; every other key and value as they wrote it, but not their comments (YAML's loader
    drops them: the header names the file that has them)."""
    import yaml
    from mdi.runconfig import read_yaml
    data = read_yaml(config_path)
    counts = {n.name: n.layers[1] - n.layers[0] for n in run_plan.nodes}
    nodes = []
    for i, raw in enumerate(data.get("nodes") or []):
        name = raw.get("name") or ("starter" if i == 0 else "node%d" % i)
        if name in counts:
            nodes.append(dict(raw, layers=counts[name]))
    data["nodes"] = nodes
    # a run of the written file has the samples in flight it was planned for
    data["generation"] = dict(data.get("generation") or {}, n_samples=samples)
    head = ("# planned by mdi-plan from %s (its comments are there) for %d samples in flight: slowest stage "
            "%.2f ms, %.1f tokens/s predicted\n" % (config_path, plan.samples, plan.bottleneck_ms,
                                                     plan.predicted_tokens_per_s))
    if plan.dropped:
        head += "# left out: %s\n" % ", ".join(sorted(plan.dropped))
    return head + yaml.safe_dump(data, sort_keys=False)


def _say(line: str) -> None:
    """A progress line, whole: the nodes are timed from threads of their own, and two print()s
    at once had run into each other ("timing board1's blocksmdi: plan: timing board2's ...")."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
