"""Two calibration diagnostics of the synthetic default (README, "Calibration"), run as

    python -m icml.methods.gradient_route.diagnostics topic-gap steps=800 lr=0.003 [key=value …]
    python -m icml.methods.gradient_route.diagnostics attack-lr RUN_DIR [divisor …]

topic-gap: trains the dense baseline alone and prints, every steps/8 steps, the val loss on an aux topic
it was trained on (a1), on a1's held-out entities, and on an *unseen* topic of the same structure (a1 of
the world of another seed: same syllables, templates, shared names; other entities, objects and facts).
unseen − seen is the topic-specific knowledge (names, objects, facts) that deleting a module or filtering
a domain can remove; the shared structure cannot be removed by either.

attack-lr: the relearning attack of a trained run's deployed core+a0 models (gram, filter, maxent, ft_lora
where present) on a1 at several lr divisors (attack lr = peak lr / divisor): held-out loss before the
attack, after round 1, and its minimum over the rounds.
"""
from __future__ import annotations

import sys
import time

UNSEEN_WORLD = 1000  # a world seed no run uses as its data seed in this package's presets and tests


def unseen_topic(cfg, n: int, tokenizer):
    from icml.methods.gradient_route.data import _cut, build_world, story

    world, ids, index = build_world(UNSEEN_WORLD), [], 0
    while len(ids) < n * (cfg.gpt.context + 1):
        ids += tokenizer.encode(story(world, UNSEEN_WORLD, "val", "a1", index))
        index += 1
    return _cut(ids, n, cfg.gpt.context + 1)


def topic_gap(overrides: list[str]) -> None:
    from icml.cli.config import apply_overrides
    from icml.cli.threads import single_thread
    from icml.methods.gradient_route import training as T
    from icml.methods.gradient_route.config import preset
    from icml.methods.gradient_route.data import build_corpus
    from icml.methods.gradient_route.model import build_model

    cfg = apply_overrides(preset("default"), overrides)
    corpus = build_corpus(cfg, 0)
    unseen = unseen_topic(cfg, cfg.val_windows, corpus.tokenizer)  # the run's tokenizer: --model's, or characters
    model = build_model(cfg, corpus.vocab_size, cfg.d_dense, [], cfg.d_aux, 0)
    base = T.baseline_counts(cfg, corpus)
    steps = T.plan({d: corpus.train(d, n) for d, n in base.items()}, cfg, 0, routed=False, modules=[])
    every, started = max(1, len(steps) // 8), time.process_time()

    def on_step(done: int) -> None:
        if done % every:
            return
        loss = {name: T.mean_loss(model, windows, corpus.pad_id) for name, windows in
                (("core", corpus.val["core"]), ("a1", corpus.val["a1"]), ("a1_heldout", corpus.val_heldout["a1"]),
                 ("unseen", unseen))}
        print(f"step {done} " + " ".join(f"{k} {v:.3f}" for k, v in loss.items())
              + f" gap {loss['unseen'] - loss['a1']:.3f} cpu_s {time.process_time() - started:.0f}", flush=True)

    with single_thread():
        T.train_steps(model, steps, cfg, corpus.pad_id, on_step=on_step)


def attack_lr(run_dir: str, divisors: list[float]) -> None:
    from pathlib import Path

    from icml.cli.lifecycle import config_from_run
    from icml.cli.runstore import Run
    from icml.cli.threads import single_thread
    from icml.methods.gradient_route import METHOD
    from icml.methods.gradient_route.pipeline import checkpoint_path, corpus_for, deployed_model
    from icml.methods.gradient_route.training import elicit

    cfg, _, seed = config_from_run(METHOD, Run(Path(run_dir)))
    corpus = corpus_for(cfg, seed)
    folder = Path(run_dir) / "checkpoints"
    with single_thread():
        for variant in ("gram", "filter", "maxent", "ft_lora"):
            probe = checkpoint_path(folder, variant, None if variant in ("gram", "ft_lora") else "core+a0", seed)
            if not probe.exists():
                continue
            model = deployed_model(cfg, corpus, folder, variant, "core+a0", seed, "cpu")
            for divisor in divisors:
                curve = elicit(model, corpus.attack["a1"], corpus.val_heldout["a1"], cfg, corpus.pad_id, divisor)
                best = min(range(1, len(curve)), key=curve.__getitem__)
                print(f"{variant} lr/{divisor:g}: round0 {curve[0]:.4f} round1 {curve[1]:.4f} "
                      f"min {curve[best]:.4f} at round {best} of {len(curve) - 1}", flush=True)


if __name__ == "__main__":
    command, args = sys.argv[1], sys.argv[2:]
    if command == "topic-gap":
        topic_gap(args)
    elif command == "attack-lr":
        attack_lr(args[0], [float(d) for d in args[1:]] or [4.0, 16.0, 64.0, 256.0])
    else:
        sys.exit("usage: diagnostics topic-gap [key=value …] | attack-lr RUN_DIR [divisor …]")
