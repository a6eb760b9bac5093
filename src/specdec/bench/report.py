"""`report.md` and `report.json` for a bench: tables for people, every figure for programs.

The markdown ends with the command line that serves the recommended method, e.g.

    specdec serve qwen2.5-coder-1.5b-instruct --speculative-config '{"method": "eagle", ...}'
"""

from __future__ import annotations

import json
from pathlib import Path

from specdec.bench.compare import Summary, recommend

PLAUSIBLE = 1.05  # speedup over tokens per target pass beyond which the timing is suspect


def mib(n: int) -> str:
    """Bytes for people: 0, 37 KiB, 487 MiB."""
    return "0" if not n else f"{n / 2**10:.0f} KiB" if n < 2**20 else f"{n / 2**20:.0f} MiB"


def percent(x: float) -> str:
    return f"{100 * x:.0f}%"


def serve_command(target: str, best: Summary) -> str:
    """`specdec serve TARGET` with the recommended method's flag (none for plain decoding)."""
    flag = f" --speculative-config '{best.config_json}'" if best.config_json else ""
    return f"specdec serve {target}{flag}"


def method_table(summaries: list[Summary]) -> list[str]:
    n = len(summaries[0].speedup_per_prompt)
    lines = ["| method | decode tokens/s | speedup (per prompt: 25th-75th pct) | tokens per target pass | "
             "acceptance rate | time: draft / target / other | drafter memory | identical to plain |",
             "|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        low, high = s.speedup_quartiles
        plain = s.config_json is None
        identical = "-" if s.identical is None or plain else \
            f"{s.identical}/{n}" + ("" if s.identical == n else " **NO**")
        lines.append(
            f"| {s.name} | {s.tokens_per_s:.2f} | {s.speedup:.2f}x ({low:.2f}-{high:.2f}) | {s.tokens_per_pass:.2f} | "
            f"{'-' if plain else f'{s.pooled.acceptance_rate:.2f}'} | "
            f"{' / '.join(percent(x) for x in s.time_split)} | {mib(s.memory_bytes)} | {identical} |")
    return lines


def position_table(summaries: list[Summary]) -> list[str]:
    drafting = [s for s in summaries if s.per_position]
    width = max((len(s.per_position) for s in drafting), default=0)
    if not width:
        return []
    lines = ["| method | " + " | ".join(f"position {i + 1}" for i in range(width)) + " |",
             "|---|" + "---|" * width]
    for s in drafting:
        cells = [f"{x:.2f}" for x in s.per_position] + ["-"] * (width - len(s.per_position))
        lines.append(f"| {s.name} | " + " | ".join(cells) + " |")
    return lines


def category_table(summaries: list[Summary]) -> list[str]:
    categories = list(summaries[0].speedup_by_category)
    lines = ["| method | " + " | ".join(categories) + " |", "|---|" + "---|" * len(categories)]
    for s in summaries[1:]:
        lines.append(f"| {s.name} | " + " | ".join(f"{s.speedup_by_category[c]:.2f}x" for c in categories) + " |")
    return lines


def warnings(summaries: list[Summary]) -> list[str]:
    """What makes the figures suspect: greedy outputs that differ from plain decoding's (a bug), and speedups
    above the tokens each target pass yields (no verification pass is cheaper than a plain one, so only a
    change in the machine's speed during the run gives those)."""
    n = len(summaries[0].speedup_per_prompt)
    out = []
    not_exact = [s.name for s in summaries if s.identical is not None and s.identical < n]
    if not_exact:
        out.append(f"Greedy outputs differ from plain decoding for {', '.join(not_exact)}: speculation must never "
                   "change a greedy output. This is a bug; please report it.")
    for s in summaries[1:]:
        if s.speedup > PLAUSIBLE * max(1.0, s.tokens_per_pass):
            out.append(f"{s.name} measured {s.speedup:.2f}x with {s.tokens_per_pass:.2f} tokens per target pass: "
                       "more than speculation can give, so the machine's speed changed during the run (other "
                       "load?). Rerun on a quiet machine, or with more prompts.")
    return out


def render(summaries: list[Summary], info: dict, plots: list[Path]) -> str:
    """The markdown report. `info`: target, source (of the prompts), prompts, max_tokens, temperature, setup."""
    best = recommend(summaries)
    sampling = "greedy" if info["temperature"] == 0 else f"temperature {info['temperature']}"
    out = [f"# specdec bench: {info['target']}", "",
           f"{info['prompts']} prompts ({info['source']}), up to {info['max_tokens']} tokens each, {sampling}; "
           f"{info['setup']}. The methods took turns prompt by prompt. Decode time leaves out the target's prefill; "
           "speedup is decode tokens/s over plain decoding's, pooled over the prompts.", "",
           *method_table(summaries), ""]
    for warning in warnings(summaries):
        out += [f"**{warning}**", ""]
    positions = position_table(summaries)
    if positions:
        out += ["## Acceptance by draft position", "",
                "The share of drafts whose token at each position was accepted, and with it every token before "
                "it (acceptance stops at the first rejected token, so the share falls with the position).", "",
                *positions, ""]
    passes = {int(rows): ms for rows, ms in (info.get("target_pass_ms") or {}).items()}
    if len(passes) > 1 and 1 in passes:
        out += ["## Target pass cost by rows", "",
                "A target pass of R rows (one sequence's last token and a draft of R - 1), as the controller "
                "measured it while the methods ran: what verification costs on this target and machine.", "",
                "| rows | ms | x one row |", "|---|---|---|",
                *[f"| {rows} | {ms:.2f} | {ms / passes[1]:.2f} |" for rows, ms in sorted(passes.items())], ""]
    if len(summaries[0].speedup_by_category) > 1:
        out += ["## Speedup by category", "", *category_table(summaries), ""]
    if plots:
        out += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots] + [""]
    out += ["## Recommendation", ""]
    if best.config_json is None:
        out += ["No method beat plain decoding on these prompts: serve without `--speculative-config`.", ""]
    else:
        low, _ = best.speedup_quartiles
        doubt = " Its per-prompt spread reaches below 1.0: more prompts would make the choice surer." if low < 1 else ""
        out += [f"For this workload: **{best.name}**, {best.speedup:.2f}x plain decoding's decode speed, "
                f"{best.tokens_per_pass:.2f} tokens per target pass.{doubt}", ""]
    out += ["```bash", serve_command(info["target"], best), "```", ""]
    return "\n".join(out)


def write_report(out_dir: Path, summaries: list[Summary], info: dict, plots: list[Path]) -> Path:
    """`out_dir/report.md` (returned) and `out_dir/report.json` (the same figures, and each method's pooled
    metrics)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    best = recommend(summaries)
    (out_dir / "report.json").write_text(json.dumps(
        {**info, "methods": [s.to_dict() for s in summaries], "recommended": best.name,
         "speculative_config": best.config_json}, indent=1) + "\n")
    path = out_dir / "report.md"
    path.write_text(render(summaries, info, plots))
    return path
