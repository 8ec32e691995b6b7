"""`icml metaphor-bench generate --out DIR` (the procedural benchmark + synthetic KG in the official
layout) and `icml metaphor-bench score --bench DIR --pred FILE.jsonl` (judge an existing prediction file)."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from icml.cli import console
from icml.cli.commands import guarded
from icml.cli.options import Debug, Json, Quiet

Out = Annotated[Path, typer.Option("--out", help="Folder to write (train/, test/, kg/).")]
Seed = Annotated[int, typer.Option("--seed", help="Generator seed.")]
PresetName = Annotated[str, typer.Option("--preset", help="smoke | default | paper: the sizes to generate.")]
Bench = Annotated[Path, typer.Option("--bench", help="Benchmark folder (datas.jsonl or test.jsonl + frames).")]
Pred = Annotated[Path, typer.Option("--pred", help="Predictions: JSON lines with video_id and analysis_dict "
                                                   "(or a model output string under 'output').")]
JudgeName = Annotated[str, typer.Option("--judge", help="rule (needs gold_ids.jsonl) | llm (needs --judge-model).")]
JudgeModel = Annotated[Optional[Path], typer.Option("--judge-model", help="Local HF causal LM for --judge llm.",
                                                    show_default=False)]
Prompts = Annotated[Optional[Path], typer.Option("--prompts", help="The official MetaphorVU checkout (or a JSON "
                                                 "file) to take the judge prompt from; default: ours.",
                                                 show_default=False)]


def register(app: typer.Typer) -> None:
    @app.command("generate")
    @guarded
    def generate_command(out: Out, seed: Seed = 0, preset: PresetName = "default", json_: Json = False,
                         quiet: Quiet = False, debug: Debug = False):
        """Write the procedural metaphor-video benchmark (official layout + gold_ids.jsonl) and its synthetic KG."""
        from icml.cli.errors import UsageError
        from icml.methods.metaphor_bench.bench import generate
        from icml.methods.metaphor_bench.config import preset as make_preset

        if preset not in ("smoke", "default", "paper"):
            raise UsageError(f"unknown preset '{preset}'", "use smoke, default or paper")
        cfg = make_preset(preset)
        table = generate(out, seed, cfg.n_train, cfg.n_test_heldout, cfg.n_test_seen, cfg.heldout_frac,
                         cfg.n_frames, cfg.frame_size, cfg.embed_dim)
        summary = {"out": str(out), "pairs": len(table.pairs), "heldout_pairs": len(table.heldout),
                   "train_videos": cfg.n_train, "test_videos": cfg.n_test_heldout + cfg.n_test_seen}
        console.emit_json(summary) if json_ else console.say(f"wrote {summary}")

    @app.command("score")
    @guarded
    def score_command(bench: Bench, pred: Pred, judge: JudgeName = "rule", judge_model: JudgeModel = None,
                      prompts: Prompts = None, json_: Json = False, quiet: Quiet = False, debug: Debug = False):
        """Judge an existing official-format prediction file and print the official aggregation."""
        import json

        from icml.cli.errors import UsageError
        from icml.methods.metaphor_bench import protocol
        from icml.methods.metaphor_bench.judges import LLMJudge, rule_judge

        if judge not in ("rule", "llm"):
            raise UsageError(f"unknown judge '{judge}'", "use --judge rule or --judge llm")
        if judge == "llm" and judge_model is None:
            raise UsageError("--judge llm needs --judge-model PATH", "pass a local HF causal LM folder")
        if not pred.exists():
            raise UsageError(f"--pred '{pred}' does not exist", "check the path")
        records = {r.video_id: r for r in protocol.load_bench(bench)}
        if judge == "rule" and not any(r.gold for r in records.values()):
            raise UsageError(f"'{bench}' has no gold_ids.jsonl for the rule judge", "use --judge llm --judge-model PATH")
        if prompts is not None:
            protocol.prompts(str(prompts))  # a bad source fails here, before any model loads
        scorer = LLMJudge(str(judge_model), prompts=str(prompts) if prompts else None) if judge == "llm" else None
        items = []
        for number, line in enumerate(pred.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
                record = records[str(entry["video_id"])]
            except (ValueError, KeyError) as exc:
                raise UsageError(f"{pred}:{number} is not a prediction for this benchmark ({exc})",
                                 "each line needs a video_id of the benchmark and analysis_dict (or output)") from None
            answer = entry.get("analysis_dict")
            if not isinstance(answer, dict):
                answer = protocol.parse_analysis(str(entry.get("output", "")))
            item = {"metaphor_types": record.metaphor_type, "parse_ok": answer is not None, "judge_ok": False,
                    "strict": 0, "loose": 0}
            if answer is not None:
                verdict = (rule_judge(answer, [tuple(p) for p in record.gold["pairs"]]) if judge == "rule"
                           else scorer(answer, record.golden_answers))
                if verdict is not None:
                    item.update(strict=verdict["strict"], loose=verdict["loose"], judge_ok=True)
            items.append(item)
        if not items:
            raise UsageError(f"--pred '{pred}' holds no predictions", "check the file")
        result = protocol.aggregate(items)
        if json_:
            console.emit_json({k: (None if v != v else v) for k, v in result.items()})
            return
        for key, value in result.items():
            print(f"{key:>16}  {value:.3f}")
        print(f"note: {protocol.OFFICIAL_PER_TYPE_NOTE}")
