"""`dflash-datagen`: regenerate training responses with the target (Hydra entry point).

    dflash-datagen out_dir=data/sharegpt-smollm2                 # recipes/datagen.yaml
    dflash-datagen --config-name datagen_quickstart              # a few hundred prompts, CPU

Settings are Hydra overrides of recipes/datagen.yaml (or of the recipe --config-name names):
key=value, group=option (target=qwen3_8b).

Exit status: 0 when a dataset was produced, 1 when nothing usable was (no rows, backend
unavailable, shards left to do), 2 on a configuration or input error.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from data_gen.config import DatagenConfig
from data_gen.generators import GeneratorUnavailable
from data_gen.inputs import check_inputs
from dflash_train.errors import one_line, run_command
from dflash_train.recipe import load_command
from dflash_train.run_lock import hold_folder

if TYPE_CHECKING:
    from data_gen.pipeline import RunResult


def format_summary(result: RunResult) -> str:
    c = result.counts
    lines = [f"dflash-datagen summary: {result.out_dir}",
             f"  {'prompts (usable)':<28}{c['prompts']:>10}",
             f"  {'rows written':<28}{c['rows']:>10}",
             f"  {'tokens (prompt + response)':<28}{c['tokens']:>10}",
             f"  {'response tokens':<28}{c['response_tokens']:>10}",
             f"  {'generated this run':<28}{result.generated_tokens:>10}  "
             f"({result.tokens_per_s:.1f} tok/s over {result.elapsed_s:.1f} s)",
             f"  {'seconds of this process':<28}prompts ready after {result.prompts_s:.1f} (magpie prompts "
             f"written in {result.magpie_s:.1f}), answering generator built in {result.build_s:.1f},",
             f"  {'':<28}shards written in {result.write_s:.1f} (of the {result.elapsed_s:.1f}), the target loaded "
             f"in {result.load_s:.1f} (by the first generator built: the magpie writer's, else the answers')"]
    for reason, n in sorted(c["finish_reasons"].items()):
        lines.append(f"  {'finish_reason=' + reason:<28}{n:>10}")
    if c["retokenized"]:
        lines.append(f"  {'retokenized responses':<28}{c['retokenized']:>10}  (server sent no token ids)")
    for reason, n in sorted(c["ended_early"].items()):
        lines.append(f"  {'conversation ended: ' + reason:<28}{n:>10}")
    lines += _magpie_lines(c.get("magpie", {}))
    lines.append(f"  {'skipped prompts':<28}{sum(c['skipped'].values()):>10}")
    for reason, n in sorted(c["skipped"].items()):
        example = c["skipped_examples"].get(reason, [""])[0]
        lines.append(f"    {reason:<26}{n:>10}  {example}"[:160])
    if result.budget_reached:
        lines.append(f"  stopped by the budget (budget_min): {result.unstarted} prompts not answered; the dataset "
                     "holds the conversations begun")
    elif not result.complete:
        lines.append("  INCOMPLETE: some shards are not committed; rerun the same command to finish")
    return "\n".join(lines)


def _magpie_lines(reports: dict) -> list[str]:
    """What each magpie source's prompts cost: candidates and tokens kept, dropped, unused."""
    lines = []
    for name, r in sorted(reports.items()):
        dropped = ", ".join(f"{reason} {n}" for reason, n in r["dropped"].items()) or "none"
        wasted = r["tokens_dropped"] + r["tokens_unused"]
        cut = f" ({r['cut']} read cut at max_tokens, kept_truncated)" if "cut" in r else ""
        lines += [f"  magpie {name}: {r['candidates']} candidates written, {r['kept']} kept{cut}, "
                  f"{sum(r['dropped'].values())} dropped ({dropped}), {r['unused']} unused",
                  f"    {r['tokens']} tokens written, {wasted} ({100 * r['waste']:.1f}% waste) on candidates not "
                  f"kept: {r['tokens_dropped']} dropped ({r['tokens_truncated']} truncated), "
                  f"{r['tokens_unused']} unused"]
        if r["stopped_by_budget"]:
            lines.append("    its writing was stopped by the budget (budget_min): fewer prompts than num_prompts")
    return lines


def generate(cfg: DatagenConfig, **run_kwargs) -> int:
    """Run and report; the exit status of the command."""
    try:
        with hold_folder(cfg.out_dir, "out_dir", "dflash-datagen"):
            check_inputs(cfg)  # before torch: a mistake fails in a second
            cfg.backend.resolve()  # backend.kind=auto asks torch for a GPU
            from data_gen.pipeline import run

            result = run(cfg, **run_kwargs)
    except GeneratorUnavailable as e:
        print(f"dflash-datagen: error: {one_line(e)}; rerun the same command once the backend is up "
              "(committed shards are kept)", file=sys.stderr)
        return 1
    print(format_summary(result))
    if not (result.complete or result.budget_reached) or result.counts["rows"] == 0:
        print("dflash-datagen: no usable dataset was produced", file=sys.stderr)
        return 1
    return 0


def load(argv: list[str] | None = None) -> DatagenConfig:
    """The checked settings of a command line; loads nothing, imports no torch (``generate``
    resolves backend.kind=auto)."""
    return load_command(DatagenConfig, argv, "datagen", __doc__, DatagenConfig.check)


def main(argv: list[str] | None = None) -> None:
    # A user mistake or a refusal of the machine: one line naming the file or value, exit 2.
    sys.exit(run_command("dflash-datagen", lambda: generate(load(argv))))


if __name__ == "__main__":
    main()
